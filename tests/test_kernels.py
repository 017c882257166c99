"""The compiled update kernel (``kernel="compiled"``) equals a reference written here bit for
bit: fp32, bf16->fp32 and fp16->fp32 groups in one model, channels_last and non-contiguous
parameters, 0-dim tensors, empty shards, copied tensors, K EMAs per pass; with no process
group, at W=1 and W=3 (gloo, or NCCL under ``DTENSOR_EMA_TEST_BACKEND=nccl``), and on CUDA
when one is present. Also: the decay goes in as data (no recompilation), the eager fallback
where compiling fails, and option validation."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import DEVICE_TYPE, run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema import ModelEMA, MultiModelEMA
from dtensor_ema.update import compiled_lerp

STEPS = 4
DECAY, TAU = 0.9, 2.0
MULTI = {
    "fast": {"decay": 0.5, "tau": None},
    "slow": {"decay": DECAY, "tau": TAU, "update_every": 2},
}
MULTI_EVERY_STEP = {"fast": MULTI["fast"], "slow": {"decay": DECAY, "tau": TAU}}
"""Spawned ranks: both EMAs average on every call, so one kernel per group (K = 2)."""


class MixedModel(nn.Module):
    """One model, every kind of group: fp32, bf16 and fp16 parameters, a channels_last conv,
    a non-contiguous (transposed) parameter, a 0-dim one, dim 0 < W (empty shards), float
    buffers; ``vec`` is excluded (copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalar = nn.Parameter(torch.tensor(0.25))
        self.tiny = nn.Parameter(torch.randn(1, 4))
        self.odd = nn.Parameter(torch.randn(13, 7))
        self.vec = nn.Parameter(torch.randn(5))
        self.t = nn.Parameter(torch.randn(3, 5).t())  # non-contiguous (5, 3)
        self.conv = nn.Conv2d(3, 6, 3).to(memory_format=torch.channels_last)
        self.half = nn.Linear(7, 9).to(torch.float16)
        self.low = nn.Linear(5, 11).to(torch.bfloat16)
        self.low_t = nn.Parameter(torch.randn(4, 6).to(torch.bfloat16).t())
        self.register_buffer("float_buf", torch.randn(7))
        self.register_buffer("int_buf", torch.zeros((), dtype=torch.long))


def _perturb(model: nn.Module, step: int) -> None:
    """A training step's worth of change to every float tensor, identical on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=g).to(device=t.device, dtype=t.dtype)
                t.add_(noise * 0.1)


def _reference(states: list[dict[str, torch.Tensor]], decay_of: Any, every: int) -> dict:
    """Unsharded EMA: ``ref.lerp_(p.to(fp32), 1 - d)`` on full tensors on every
    ``every``-th call, ``d = decay_of(call)``; ``vec`` copied."""
    ref = {
        k: v.detach().to(torch.float32).cpu().clone()
        for k, v in states[0].items()
        if v.is_floating_point()
    }
    for call, state in enumerate(states[1:], start=1):
        if call % every:
            continue
        for k, v in ref.items():
            p = state[k].detach().cpu().to(torch.float32)
            if k == "vec":
                v.copy_(p)
            else:
                v.lerp_(p, 1 - decay_of(call))
    return ref


def _ramp(n: int) -> float:
    return DECAY * (1 - math.exp(-n / TAU))


def _full(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in ema.ema_tensors().items()
    }


def _mismatches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(actual) ^ set(expected))
    bad += [
        k
        for k in expected
        if k in actual
        and (actual[k].dtype != expected[k].dtype or not torch.equal(actual[k], expected[k]))
    ]
    return bad


def scenario(device: str, mesh: Any, spawned: bool = False) -> dict[str, Any]:
    """Compiled ModelEMA, compiled capturable ModelEMA and a compiled two-EMA MultiModelEMA
    on :class:`MixedModel`, against references written here. Returns mismatching fqns."""
    torch.manual_seed(0)
    model = MixedModel().to(device)
    common = {"mesh": mesh, "exclude": ["vec"], "kernel": "compiled"}
    single = ModelEMA(model, decay=DECAY, tau=TAU, **common)
    multi = MultiModelEMA(model, MULTI_EVERY_STEP if spawned else MULTI, **common)
    graphable = None
    if not spawned:
        graphable = ModelEMA(model, decay=DECAY, tau=TAU, capturable=True, **common)
    states = [{k: v.detach().cpu().clone() for k, v in model.state_dict().items()}]
    for step in range(STEPS):
        _perturb(model, step)
        states.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        single.update()
        multi.update()
        if graphable is not None:
            graphable.update()
    expected = _reference(states, _ramp, 1)
    slow_reference = expected if spawned else _reference(states, lambda c: _ramp(c) ** 2, 2)
    out = {
        "kernels": sorted({g.kernel for g in single.engine.groups}),
        "groups": len(single.engine.groups),
        "single": _mismatches(_full(single), expected),
        "multi_fast": _mismatches(_full(multi["fast"]), _reference(states, lambda n: 0.5, 1)),
        "multi_slow": _mismatches(_full(multi["slow"]), slow_reference),
    }
    if graphable is not None:
        out["capturable"] = _mismatches(_full(graphable), expected)
    return out


def _rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE_TYPE, (world_size,))
    out = scenario(DEVICE_TYPE, mesh, spawned=True)
    ema = ModelEMA(MixedModel().to(DEVICE_TYPE), mesh=mesh)
    out["empty_shards"] = sum(1 for e in ema.engine.plan if e.ema_local.numel() == 0)
    return out


def _check(result: dict[str, Any], groups: int) -> None:
    assert result["kernels"] == ["compiled"]
    assert result["groups"] == groups  # fp32, bf16, fp16 averaged + the copied fp32 group
    for key in ("single", "multi_fast", "multi_slow", "capturable"):
        assert result.get(key, []) == [], key


def test_compiled_matches_reference_without_process_group() -> None:
    _check(scenario("cpu", None), groups=4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3])
def test_compiled_matches_reference_distributed(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(_rank_body, world_size, tmp_path, deadline_s=600)
    for rank, result in enumerate(results):
        # At W=3 rank 2 holds no piece of some small tensors: fewer groups is fine there.
        assert result["kernels"] == ["compiled"], rank
        for key in ("single", "multi_fast", "multi_slow"):
            assert result[key] == [], (rank, key)
    if world_size == 3:
        assert results[2]["empty_shards"] > 0  # the empty-shard path was exercised


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_matches_reference_on_cuda() -> None:
    _check(scenario("cuda", None), groups=4)


def test_decay_is_data_not_a_constant() -> None:
    """Changing decays (a ramp, two EMAs, skipped steps) never recompiles."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = MixedModel()
    ema = ModelEMA(model, decay=DECAY, tau=TAU, kernel="compiled")
    ema.update()  # compiles one graph per group
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(5):
            _perturb(model, step)
            ema.update()
    assert counters["stats"]["unique_graphs"] == graphs
    assert len({ema.get_decay(n) for n in range(2, 7)}) == 5  # every step a new decay


def test_compile_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_lerp, "_broken", {})
    monkeypatch.setattr(compiled_lerp, "_warned", set())
    monkeypatch.setitem(compiled_lerp.INDUCTOR_OPTIONS, "cpu", {"no_such_inductor_option": 1})
    torch.manual_seed(0)
    model = MixedModel()
    ema = ModelEMA(model, decay=DECAY, tau=TAU, exclude=["vec"], kernel="compiled")
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    with pytest.warns(RuntimeWarning, match=r"compiled update unavailable on cpu .*eager kernel"):
        _perturb(model, 0)
        ema.update()
    states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one notice, not one per step
        for step in range(1, 3):
            _perturb(model, step)
            ema.update()
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        later = ModelEMA(model, kernel="compiled")  # the device is known broken: eager at once
    assert {g.kernel for g in ema.engine.groups if g.averaged} == {"eager"}  # switched on failure
    assert {g.kernel for g in later.engine.groups} == {"eager"}
    assert _mismatches(_full(ema), _reference(states, _ramp, 1)) == []


def test_offloaded_update_with_compiled_kernel() -> None:
    """The offload worker thread runs the compiled kernel on the staged host copies."""
    torch.manual_seed(0)
    model = MixedModel()
    ema = ModelEMA(model, decay=DECAY, tau=TAU, exclude=["vec"], kernel="compiled", offload=True)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for step in range(3):
        _perturb(model, step)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        ema.update()
    assert _mismatches(_full(ema), _reference(states, _ramp, 1)) == []


def test_kernel_option_is_validated() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"kernel must be 'eager', 'compiled' or 'auto', got 'fa"):
        ModelEMA(model, kernel="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sets \['kernel'\], which all EMAs share"):
        MultiModelEMA(model, {"a": {"kernel": "eager"}})
    auto = ModelEMA(model, kernel="auto")
    assert {g.kernel for g in auto.engine.groups} == {"eager"}  # CPU default
    bf16_ema = ModelEMA(model, kernel="compiled", ema_dtype=torch.bfloat16)
    assert {g.kernel for g in bf16_ema.engine.groups} == {"eager"}  # not covered: stays eager


def test_compiled_capturable_update_inside_the_callers_compile() -> None:
    """``torch.compile(ema.update, fullgraph=True)`` with ``kernel="compiled"`` traces the
    kernel into the caller's graph and keeps eager's bits (no FMA contraction is lost)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    graphed = ModelEMA(model, decay=DECAY, tau=TAU, capturable=True, kernel="compiled")
    host = ModelEMA(model, decay=DECAY, tau=TAU, kernel="eager")
    update = torch.compile(graphed.update, fullgraph=True)
    for step in range(3):
        _perturb(model, step)
        update()
        host.update()
    assert _mismatches(_full(graphed), _full(host)) == []
