"""``ema.module`` on wrapped and compiled models, W=2 on gloo.

Each case trains a few real optimizer steps, then compares ``ema.module(x)`` with an
unsharded copy of the model loaded with ``ema.get_model_state_dict()[0]`` (relative error
<= 1e-5, as in ``test_ema_module.py``), checks that the raw model's output is far from it
(so a twin that ran the training weights would fail), and that ``average_parameters()``
puts exactly the EMA into the model:

* torch's ``checkpoint_wrapper`` on every block (plain model and FSDP2 model): parameter
  names carry ``_checkpoint_wrapped_module.``;
* ``module.compile()`` per block (torchtitan's per-block compile) and ``torch.compile`` of
  the whole model;
* a forward set on the instance as a closure over the module (torchtitan's
  ``Module.parallelize``), and torchtitan 0.3.0's own tiny llama3 parallelized by
  ``parallelize_llama`` (FSDP2, with and without its activation checkpointing).

One spawn at W=2 runs every case.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from titan_models import build_titan, llama3_trainer, parallel_dims
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtensor_ema import ModelEMA

pytestmark = pytest.mark.distributed

DECAY = 0.6
STEPS = 3
DIM = 10


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 13)
        self.w2 = nn.Linear(13, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _closure_forward(module: nn.Module) -> None:
    """What torchtitan's ``Module.parallelize`` does: ``self.forward`` becomes a closure
    over the module and its bound forward."""
    fn = module.forward

    def forward_with_redistribution(*args: Any, **kwargs: Any) -> Any:
        assert module.training is not None
        return fn(*args, **kwargs)

    module.forward = forward_with_redistribution  # type: ignore[method-assign]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(expected).all():
        return float("inf")
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _case(
    model: nn.Module,
    reference: nn.Module,
    batch: Callable[[int], torch.Tensor],
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda y: y.float().square().mean(),
    context: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Train, then compare ema.module with ``reference`` loaded with the EMA."""
    import contextlib

    ctx = context or contextlib.nullcontext
    ema = ModelEMA(model, decay=DECAY, tau=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        with ctx():
            loss(model(batch(step))).backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    x = batch(99)
    with torch.no_grad(), ctx():
        y = ema.module(x)
        raw = model(x)
    state = ema.get_model_state_dict()[0]
    reference.load_state_dict(state)
    reference.eval()
    with torch.no_grad():
        expected = reference(x)
    with ema.average_parameters():
        inside = _full_state(getattr(model, "_orig_mod", model))
    swap = [k for k, v in inside.items() if v.is_floating_point() and not torch.equal(v, state[k])]
    return {
        "rel_err": _rel_err(y, expected),
        "raw_err": _rel_err(raw, expected),
        "swap_mismatch": swap,
    }


def _plain_cases() -> dict[str, Callable[[], dict[str, Any]]]:
    def batch(step: int) -> torch.Tensor:
        return torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(step))

    def fresh() -> tuple[Net, Net]:
        torch.manual_seed(0)
        model = Net()
        return model, copy.deepcopy(model)

    def ac_plain() -> dict[str, Any]:
        model, reference = fresh()
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        return _case(model, reference, batch)

    def ac_fsdp() -> dict[str, Any]:
        model, reference = fresh()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
            fully_shard(model.layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _case(model, reference, batch)

    def compile_blocks() -> dict[str, Any]:
        model, reference = fresh()
        for layer in model.layers:
            layer.compile(backend="eager")
        return _case(model, reference, batch)

    def compile_whole() -> dict[str, Any]:
        model, reference = fresh()
        return _case(torch.compile(model, backend="eager"), reference, batch)

    def closure() -> dict[str, Any]:
        model, reference = fresh()
        for module in [model, model.embed, *model.layers]:
            _closure_forward(module)
        return _case(model, reference, batch)

    def closure_fsdp() -> dict[str, Any]:
        model, reference = fresh()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in [model, model.embed, *model.layers]:
            _closure_forward(module)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _case(model, reference, batch)

    return {
        "ac_plain": ac_plain,
        "ac_fsdp": ac_fsdp,
        "compile_blocks": compile_blocks,
        "compile_whole": compile_whole,
        "closure": closure,
        "closure_fsdp": closure_fsdp,
    }


# ------------------------------------------------------------------ torchtitan 0.3.0
_TITAN: dict[str, Any] = {}


def _titan_llama(parallelize: bool, ac: bool) -> tuple[nn.Module, Any]:
    """torchtitan's llama3 at toy size (unfused Q/K/V, SDPA attention: FlexAttention has
    no CPU backward), parallelized by its own ``parallelize_llama`` on ``ParallelDims``
    (FSDP2 over W ranks) when ``parallelize``; else the plain model."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    dim, heads, vocab = 16, 2, 32
    init = {"weight": nn.init.ones_}
    linear = {"weight": lambda w: nn.init.normal_(w, std=0.3), "bias": nn.init.zeros_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=16, theta=10000.0, scaling="none")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=init),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=init),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=None,
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=False,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=24, w1_param_init=linear, w2w3_param_init=linear
            ),
        )
        for _ in range(2)
    ]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear),
        layers=layers,
    )
    world = dist.get_world_size()
    trainer = llama3_trainer(config, shard=world)
    if "dims" not in _TITAN:  # one ParallelDims per process: torchtitan caches its meshes
        _TITAN["dims"] = parallel_dims(world, dp_shard=world)
    dims = _TITAN["dims"]
    return build_titan(trainer, dims if parallelize else None, full_ac=ac), dims


def _titan_cases() -> dict[str, Callable[[], dict[str, Any]]]:
    from torchtitan.distributed.utils import get_spmd_context

    def batch(step: int) -> torch.Tensor:
        return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))

    def run(ac: bool) -> dict[str, Any]:
        model, dims = _titan_llama(parallelize=True, ac=ac)
        reference, _ = _titan_llama(parallelize=False, ac=False)
        out = _case(model, reference, batch, context=get_spmd_context(parallel_dims=dims))
        out["closures"] = sum("forward" in m.__dict__ for m in model.modules())
        return out

    return {"titan_fsdp": lambda: run(False), "titan_fsdp_ac": lambda: run(True)}


def wrapped_body(rank: int, world_size: int) -> dict[str, Any]:
    cases = _plain_cases()
    if importlib.util.find_spec("torchtitan") is not None:
        cases.update(_titan_cases())
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as error:  # reported per case; pytest names it
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
    return results


@pytest.fixture(scope="module")
def wrapped_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("wrapped")
    return run_ranks(wrapped_body, 2, tmp, deadline_s=500)


CASES = [
    "ac_plain",
    "ac_fsdp",
    "compile_blocks",
    "compile_whole",
    "closure",
    "closure_fsdp",
    "titan_fsdp",
    "titan_fsdp_ac",
]


@pytest.mark.parametrize("name", CASES)
def test_ema_module_forward_equals_unsharded_model_loaded_with_the_ema(
    wrapped_results: list[dict[str, Any]], name: str
) -> None:
    if name.startswith("titan") and importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    for rank, results in enumerate(wrapped_results):
        out = results[name]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["rel_err"] <= 1e-5, out
        assert out["raw_err"] > 1e-3, out  # the EMA is far from the raw weights
        assert out["swap_mismatch"] == [], out
        if name.startswith("titan"):
            assert out["closures"] > 0  # parallelize_llama did set instance forwards
