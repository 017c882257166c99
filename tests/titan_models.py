"""torchtitan 0.3.0 models on the CPU, for the tests (one copy of the CPU setup).

torchtitan targets CUDA; the CPU switches, in one place:

* SDPA attention (``ScaledDotProductAttention.Config()`` as every block's
  ``inner_attention``): the shipped debugmodels use FlexAttention, which has no CPU backward.
* ``device_type = "cpu"`` in ``torchtitan.tools.utils`` and ``torchtitan.distributed.
  parallel_dims`` (which copied it at import): torchtitan picked CUDA at import and builds its
  meshes on that module-level device (:func:`use_cpu`).
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP2 module after
  torchtitan's ``parallelize_llama``/``parallelize_deepseekv3``: gloo has no ``PREMUL_SUM``.

Every function imports torchtitan lazily, so this module imports without it (rank bodies
reach it through the test modules, which the spawned ranks import by name).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _cpu_blocks(config: Any, layers: int) -> None:
    """Cut a torchtitan model ``config`` (``Llama3Model.Config``/``DeepSeekV3Model.Config``)
    to its first ``layers`` blocks and give each SDPA attention, in place."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config.layers = config.layers[:layers]
    for layer in config.layers:  # FlexAttention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def llama3_debugmodel(layers: int = 2, seed: int | None = None) -> nn.Module:
    """torchtitan's llama3 ``debugmodel`` (``model_registry("debugmodel")``: fused Q/K/V
    ``wqkv``, dim 256, vocab 2048) cut to its first ``layers`` blocks, SDPA attention, built
    on the CPU in fp32 by ``config.build()`` (its own init). ``seed``: ``torch.manual_seed``
    right before the build, else the caller's RNG state. One process, no communication."""
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    _cpu_blocks(config, layers)
    if seed is not None:
        torch.manual_seed(seed)
    return config.build()


def deepseek_v3_debugmodel(layers: int = 2) -> nn.Module:
    """torchtitan's DeepSeek-V3 ``debugmodel`` cut to its first ``layers`` blocks, SDPA
    attention, built on the CPU (caller's RNG state). At 2 blocks: block 0 dense, block 1
    MoE (8 grouped experts, ``w1_EFD``/``w2_EDF``/``w3_EFD`` of shape (8, 256, 256), run by
    ``torch._grouped_mm`` in bf16; top-3 softmax router; 2 shared experts), with the float32
    buffers ``expert_bias_E`` (persistent) and ``tokens_per_expert_E`` (non-persistent)."""
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    _cpu_blocks(config, layers)
    return config.build()


def use_cpu() -> None:
    """Point torchtitan's module-level ``device_type`` at ``"cpu"`` (in
    ``torchtitan.tools.utils`` and its copy in ``torchtitan.distributed.parallel_dims``):
    torchtitan picked CUDA at import and builds its meshes on that device."""
    import torchtitan.distributed.parallel_dims as pd_module
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = pd_module.device_type = "cpu"


def parallel_dims(world_size: int, spmd_backend: str = "spmd_types", **degrees: int) -> Any:
    """torchtitan's ``ParallelDims`` on the CPU with its meshes built (``build_mesh()``:
    collective, every rank calls it with the same arguments). ``degrees``: any of
    ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep`` (each 1 unless given);
    their product (without ``ep``) must be ``world_size``. ``spmd_backend``: torchtitan's
    ``"spmd_types"`` (its default), ``"full_dtensor"`` or ``"partial_dtensor"``.
    torchtitan caches the meshes on the object: build one per layout per process."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    use_cpu()
    kw = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, **degrees}
    dims = ParallelDims(**kw, world_size=world_size, spmd_backend=spmd_backend)
    dims.build_mesh()
    return dims


def llama3_trainer(
    model: Any | None = None, layers: int = 2, replicate: int = 1, shard: int = 1, tp: int = 1
) -> Any:
    """torchtitan's ``llama3_debugmodel()`` trainer config (from its ``config_registry``)
    for the CPU: its model is the shipped debugmodel (fused Q/K/V) cut to ``layers`` blocks
    with SDPA, or ``model`` (a ``Llama3Model.Config``) when given; ``seq_len`` 8, fp32
    parameters (``mixed_precision_param="float32"``), data-parallel ``replicate`` x
    ``shard`` and tensor-parallel ``tp`` degrees; ``update_from_config`` applied. Calls
    :func:`use_cpu` first. Build the model with :func:`build_titan`."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as registry_config

    use_cpu()
    trainer = registry_config()
    if model is None:
        _cpu_blocks(trainer.model_spec.model, layers)
    else:
        trainer.model_spec.model = model
    trainer.training.seq_len = 8
    trainer.training.mixed_precision_param = "float32"
    trainer.parallelism.data_parallel_replicate_degree = replicate
    trainer.parallelism.data_parallel_shard_degree = shard
    trainer.parallelism.tensor_parallel_degree = tp
    trainer.model_spec.model.update_from_config(config=trainer)
    return trainer


def deepseek_v3_trainer(layers: int = 2, shard: int = 1, ep: int = 1) -> Any:
    """torchtitan's ``deepseek_v3_debugmodel()`` trainer config (from its
    ``config_registry``) for the CPU: the debugmodel cut to ``layers`` blocks (at 2: block 0
    dense, block 1 MoE with 8 grouped experts, see :func:`deepseek_v3_debugmodel`) with
    SDPA, ``seq_len`` 8, fp32 parameters, FSDP2 degree ``shard`` and expert-parallel
    degree ``ep`` (``moe_comm_backend="standard"``: all-to-all token dispatch), on
    torchtitan's ``"partial_dtensor"`` backend (set it globally with ``torchtitan.
    distributed.utils.set_spmd_backend`` and on the ``ParallelDims`` too); its sharding
    config set by ``update_from_config``. Calls :func:`use_cpu` first.

    Why ``"partial_dtensor"``: on the default ``"spmd_types"`` backend the dispatcher's
    uneven all-to-all is ``dist.all_to_all`` on tensor lists, which gloo refuses
    (``ProcessGroupGloo::alltoall: invalid tensor size``); the DTensor backends call
    ``all_to_all_single`` with split sizes, which gloo runs. ``"full_dtensor"`` wants
    DTensor inputs (torchtitan's trainer makes them), so it is not used here."""
    from torchtitan.models.deepseek_v3.config_registry import (
        deepseek_v3_debugmodel as registry_config,
    )

    use_cpu()
    trainer = registry_config()
    _cpu_blocks(trainer.model_spec.model, layers)
    trainer.training.seq_len = 8
    trainer.training.mixed_precision_param = "float32"
    trainer.parallelism.spmd_backend = "partial_dtensor"
    trainer.parallelism.data_parallel_shard_degree = shard
    trainer.parallelism.expert_parallel_degree = ep
    trainer.model_spec.model.update_from_config(config=trainer)
    return trainer


def build_titan(trainer: Any, dims: Any | None = None, full_ac: bool = False) -> nn.Module:
    """The model of ``trainer`` (:func:`llama3_trainer` or :func:`deepseek_v3_trainer`)
    built on the meta device, parallelized by torchtitan's own ``parallelize_fn`` of its
    model spec (``parallelize_llama`` / ``parallelize_deepseekv3``) on ``dims`` (a built
    ``ParallelDims``: FSDP2/HSDP/TP/EP as its degrees say; ``full_ac``: its full activation
    checkpointing) unless ``dims`` is None (then the plain model), moved to the CPU with
    ``to_empty``, and initialised by its ``init_weights`` after ``torch.manual_seed(0)``.
    Every FSDP2 module sums its gradients (``set_force_sum_reduction_for_comms``: gloo has
    no ``PREMUL_SUM``). Parallelized, its parameters are DTensors on ``dims``' meshes.
    For llama3, every rank and the plain model get the same full weights, sharded or not."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.activation_checkpoint import FullAC

    with torch.device("meta"):
        model = trainer.model_spec.model.build()
    if dims is not None:
        model = trainer.model_spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=trainer.training,
            parallelism=trainer.parallelism,
            compile_config=trainer.compile,
            ac_config=FullAC.Config() if full_ac else None,
            dump_folder="",
        )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model
