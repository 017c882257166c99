"""torchtitan 0.3.0 models on the CPU, for the tests (one copy of the CPU setup).

torchtitan targets CUDA; the CPU switches, in one place:

* SDPA attention (``ScaledDotProductAttention.Config()`` as every block's
  ``inner_attention``): the shipped debugmodels use FlexAttention, which has no CPU backward.
* ``device_type = "cpu"`` in ``torchtitan.tools.utils`` and ``torchtitan.distributed.
  parallel_dims`` (which copied it at import): torchtitan picked CUDA at import and builds its
  meshes on that module-level device (:func:`use_cpu`).
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP2 module after
  torchtitan's ``parallelize_llama``/``parallelize_deepseekv3``: gloo has no ``PREMUL_SUM``.

torchtitan's own ``Trainer`` needs more (:func:`use_cpu_trainer`, :func:`trainer_assets`,
:func:`cpu_trainer_config`, :func:`build_cpu_trainer`): ``device_type`` set in the modules
that copied it (then its ``init_distributed`` starts gloo, not NCCL), ``device_module``
(``torch.cuda`` at import) pointed at ``torch.cpu`` (``set_device``, barriers), a memory
monitor without CUDA's statistics, the FSDP2 sum reduction applied inside torchtitan's own
FSDP setup, SDPA as a torchtitan ``--override.imports`` override (and an unfused-QKV one for
the tests of a resume across QKV settings), CUDA graphs off, fp32
parameters, and the tokenizer and ``c4_test`` dataset that the wheel does not ship (written
here: a word-level tokenizer and a few lines of generated text). ``python -m titan_models
SCRIPT ARGS`` (under ``torchrun``) runs a script with these switches on.

Every function imports torchtitan lazily, so this module imports without it (rank bodies
reach it through the test modules, which the spawned ranks import by name).
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
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
    on the CPU in fp32 by ``config.build()`` then ``init_weights()``, as torchtitan's
    ``Trainer`` does. ``seed``: ``torch.manual_seed`` right before the build, else the
    caller's RNG state. One process, no communication."""
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    _cpu_blocks(config, layers)
    if seed is not None:
        torch.manual_seed(seed)
    return _build_initialized(config)


def qwen3_debugmodel(layers: int = 2, *, fused: bool = True, seed: int | None = None) -> nn.Module:
    """torchtitan's qwen3 ``debugmodel`` (fused Q/K/V ``wqkv``: 16 query heads over 8 KV
    heads, head_dim 128; tied embeddings), or with ``fused=False`` its
    ``debugmodel_non_fused_qkv`` (``wq``/``wk``/``wv``), cut to ``layers`` blocks with SDPA,
    built and initialized on the CPU as :func:`llama3_debugmodel`."""
    from torchtitan.models.qwen3 import model_registry

    flavor = "debugmodel" if fused else "debugmodel_non_fused_qkv"
    config = model_registry(flavor, attn_backend="flex").model
    _cpu_blocks(config, layers)
    if seed is not None:
        torch.manual_seed(seed)
    return _build_initialized(config)


def deepseek_v3_debugmodel(layers: int = 2) -> nn.Module:
    """torchtitan's DeepSeek-V3 ``debugmodel`` cut to its first ``layers`` blocks, SDPA
    attention, built on the CPU (caller's RNG state). At 2 blocks: block 0 dense, block 1
    MoE (8 grouped experts, ``w1_EFD``/``w2_EDF``/``w3_EFD`` of shape (8, 256, 256), run by
    ``torch._grouped_mm`` in bf16; top-3 softmax router; 2 shared experts), with the float32
    buffers ``expert_bias_E`` (persistent) and ``tokens_per_expert_E`` (non-persistent).
    Built then initialized by ``init_weights()``: ``config.build()`` alone leaves the grouped
    experts as ``torch.empty`` (whatever the allocator held: NaN or 1e21 in a process that
    ran other models first)."""
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel", attn_backend="flex").model
    _cpu_blocks(config, layers)
    return _build_initialized(config)


def _build_initialized(config: Any) -> nn.Module:
    """``config.build()`` then torchtitan's own ``init_weights()`` under ``no_grad``, the
    order its ``Trainer`` uses (there after ``to_empty``): every parameter and buffer set
    from the caller's RNG state, none left uninitialized."""
    model = config.build()
    with torch.no_grad():
        model.init_weights()
    return model


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


# ------------------------------------------------------------------ torchtitan's Trainer
class _CpuMemoryMonitor:
    """torchtitan's ``DeviceMemoryMonitor`` without CUDA's memory statistics: zeros."""

    device_name = "cpu"
    device_capacity_gib = 1.0

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


class _CpuDeviceModule:
    """``torch.cpu`` as torchtitan's ``device_module``, with ``current_device() == 0``
    (``torch.cpu`` says ``"cpu"``, which ``dist.barrier(device_ids=...)`` refuses)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


def use_cpu_trainer() -> None:
    """:func:`use_cpu`, plus what torchtitan's ``Trainer`` reaches: ``device_type`` in
    ``torchtitan.distributed.utils`` (so its ``init_distributed`` starts gloo) and
    ``torchtitan.components.metrics``; ``device_module`` = ``torch.cpu``
    (:class:`_CpuDeviceModule`) wherever a module copied ``torch.cuda`` at import; a memory
    monitor that reads no CUDA statistics; every FSDP2 module torchtitan builds set to sum
    its gradients (:func:`_sum_on_gloo`); and the override :func:`sdpa_on_cpu` registered
    for ``--override.imports titan_models.sdpa_on_cpu``. Process-wide, idempotent; call it
    in every rank before the build."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as dispatcher
    import torchtitan.tools.profiler as profiler
    import torchtitan.tools.utils as tt_utils
    from torchtitan.config import override
    from torchtitan.models.common.attention import FlexAttention

    use_cpu()
    dist_utils.device_type = metrics.device_type = "cpu"
    for module in (tt_utils, dist_utils, metrics, dispatcher, profiler):
        module.device_module = _CpuDeviceModule()  # type: ignore[attr-defined]
    metrics.build_device_memory_monitor = _CpuMemoryMonitor  # type: ignore[assignment]
    if not getattr(titan_fsdp.disable_fsdp_gradient_division, "sums_on_gloo", False):
        titan_fsdp.disable_fsdp_gradient_division = _sum_on_gloo(
            titan_fsdp.disable_fsdp_gradient_division
        )
    from torchtitan.models.common.attention import FusedQKVLinear

    with contextlib.suppress(ValueError):  # registered already
        override(target=FlexAttention.Config, description="CPU: SDPA")(sdpa_on_cpu)
    with contextlib.suppress(ValueError):
        override(target=FusedQKVLinear.Config, description="unfused Q/K/V")(unfused_qkv)


def _sum_on_gloo(disable_division: Any) -> Any:
    """torchtitan's ``disable_fsdp_gradient_division`` (called on every model its
    ``apply_fsdp_to_decoder`` shards), then ``set_force_sum_reduction_for_comms(True)`` on
    every FSDP2 module: gloo has no ``PREMUL_SUM``."""
    from torch.distributed.fsdp import FSDPModule

    def wrapped(model: nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    wrapped.sums_on_gloo = True  # type: ignore[attr-defined]
    return wrapped


def sdpa_on_cpu(config: Any) -> Any:
    """A torchtitan ``@override`` of every ``FlexAttention.Config`` (registered by
    :func:`use_cpu_trainer`): SDPA, since FlexAttention has no CPU backward. Activate it on
    torchtitan's command line with ``--override.imports titan_models.sdpa_on_cpu``."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    del config
    return ScaledDotProductAttention.Config()


def unfused_qkv(config: Any) -> Any:
    """A torchtitan ``@override`` of every ``FusedQKVLinear.Config`` (registered by
    :func:`use_cpu_trainer`): the unfused ``QKVLinear`` of the same shapes (``wq``, ``wk``,
    ``wv``; default init), as a model built with ``fuse_qkv=False`` has. Activate it with
    ``--override.imports titan_models.unfused_qkv``."""
    from torchtitan.models.common.attention import QKVLinear
    from torchtitan.models.common.linear import Linear

    dim, head_dim = config.wqkv.in_features, config.head_dim
    return QKVLinear.Config(
        head_dim=head_dim,
        wq=Linear.Config(in_features=dim, out_features=config.n_heads * head_dim),
        wkv=Linear.Config(in_features=dim, out_features=config.n_kv_heads * head_dim),
    )


WORDS = 300
"""Words of :func:`trainer_assets`' vocabulary (ids 3..302; 0-2 are unk, bos, eos)."""


def trainer_assets(root: Path, documents: int = 64, seed: int = 0) -> tuple[str, str]:
    """``(tokenizer folder, dataset folder)`` under ``root`` for torchtitan's
    ``hf_assets_path`` and its ``c4_test`` dataset's ``dataset_path``: a word-level
    ``tokenizer.json`` (``<unk>``, ``<bos>``, ``<eos>``, ``w0``..``w299``) with a
    ``tokenizer_config.json`` naming its BOS/EOS tokens, and ``documents`` lines of
    ``{"text": ...}`` JSON of 20-60 random words (fixed ``seed``). Idempotent."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir, data_dir = root / "tokenizer", root / "c4_test"
    if (data_dir / "data.json").is_file():
        return str(tokenizer_dir), str(data_dir)
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(seed)
    lines = [
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 60)))})
        for _ in range(documents)
    ]
    (data_dir / "data.json").write_text("\n".join(lines) + "\n")
    return str(tokenizer_dir), str(data_dir)


def cpu_trainer_config(
    config: Any,
    root: Path,
    *,
    layers: int = 2,
    steps: int = 4,
    replicate: int = 1,
    shard: int = 1,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    seq_len: int = 16,
    batch: int = 2,
    validate_every: int | None = None,
    checkpoint_every: int | None = None,
) -> Any:
    """A torchtitan trainer ``config`` (any ``Trainer.Config``, e.g. from a
    ``config_registry``) set up for CPU ranks, in place and returned: the model cut to
    ``layers`` blocks with SDPA, the assets of :func:`trainer_assets` under ``root`` (train
    and validation on the same ``c4_test`` data), ``steps`` steps of ``batch`` x ``seq_len``
    tokens per data-parallel rank, fp32 parameters, CUDA graphs off, the given parallel
    degrees (MoE models on torchtitan's ``partial_dtensor`` backend: see
    :func:`deepseek_v3_trainer`), outputs under ``root/outputs``, metrics every step; the
    validator (one batch per rank) every ``validate_every`` steps, and checkpoints every
    ``checkpoint_every`` steps, when given."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.moe import MoE

    tokenizer, data = trainer_assets(root)
    model = config.model_spec.model
    _cpu_blocks(model, layers)
    config.hf_assets_path = tokenizer
    config.dump_folder = str(root / "outputs")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data)
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = batch
    config.training.global_batch_size = -1
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 1
    config.metrics.log_freq = 1
    p = config.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = replicate, shard
    p.tensor_parallel_degree, p.pipeline_parallel_degree = tp, pp
    p.expert_parallel_degree = ep
    p.context_parallel_degree = cp
    if pp > 1:
        p.pipeline_parallel_schedule = "1F1B"
        p.pipeline_parallel_microbatch_size = 1
    if any(model.traverse(MoE.Config)):
        p.spmd_backend = "partial_dtensor"  # gloo refuses spmd_types' list all_to_all
    config.validator.enable = validate_every is not None
    config.validator.freq = validate_every or 10
    config.validator.steps = 1
    config.validator.dataloader = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=data, infinite=False
    )
    config.checkpoint.enable = checkpoint_every is not None
    config.checkpoint.interval = checkpoint_every or 500
    return config


def build_cpu_trainer(config: Any) -> Any:
    """``config.build()`` on CPU ranks: :func:`use_cpu_trainer` first; a gloo group must
    exist (torchtitan's ``init_distributed`` then keeps it); ``RANK``/``LOCAL_RANK``/
    ``WORLD_SIZE`` set from it as ``torchrun`` would. Collective: every rank builds."""
    import os

    import torch.distributed as dist

    use_cpu_trainer()
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world)
    return config.build()


if __name__ == "__main__":
    # ``torchrun ... -m titan_models SCRIPT ARGS``: SCRIPT on CPU ranks with the switches above
    # (the example smoke test runs torchtitan's entry point this way).
    import runpy
    import sys

    import titan_models

    titan_models.use_cpu_trainer()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
