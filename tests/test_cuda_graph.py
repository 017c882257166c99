"""The CUDA-graph decision and bookkeeping of ``update()``, on CPU.

:func:`dtensor_ema.update.cuda_graph.decide` is pure, so every reason is checked here. The graph
path of ``ModelEMA`` runs on CPU with a fake CUDA: ``decide`` is told the model is on CUDA
and the graph factory is a stand-in that, like a real graph, runs the step once when it is
captured and then replays *the captured step function*, bound to the update groups of
capture time. A replay after the model re-allocated its tensors without a re-capture would
read the old tensors: the comparisons with the reference below would then fail.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from models import mismatches
from torch import nn

from dtensor_ema import ModelEMA
from dtensor_ema.decay import CallableDecay, RampDecay
from dtensor_ema.update import cuda_graph as graphs

SAFE = {
    "requested": None,
    "device_type": "cuda",
    "cuda_available": True,
    "graphs_supported": True,
    "offload": False,
    "schedule_on_device": True,
    "ema_dtypes": {torch.float32},
}


@pytest.mark.parametrize(
    ("change", "use", "reason"),
    [
        # Opt-in until proven on hardware: auto stays eager where replay would be safe.
        ({}, False, "cuda_graph=None: replay would be exact here"),
        ({"auto_replay": True}, True, "CUDA model, float32 EMA"),
        ({"requested": True}, True, "CUDA model"),
        # An unsafe fact is named before the opt-in reason, auto or not.
        ({"offload": True, "auto_replay": True}, False, "offload=True"),
        ({"requested": False}, False, "cuda_graph=False"),
        ({"device_type": "cpu"}, False, "the model is on cpu, not CUDA"),
        ({"device_type": "meta", "cuda_available": False}, False, "on meta, not CUDA"),
        ({"cuda_available": False}, False, "torch.cuda.is_available() is False"),
        ({"graphs_supported": False}, False, "no torch.cuda.CUDAGraph"),
        ({"offload": True}, False, "offload=True"),
        ({"schedule_on_device": False}, False, "schedule is not one of the built-in"),
        ({"ema_dtypes": {torch.float32, torch.bfloat16}}, False, "torch.bfloat16"),
        ({"ema_dtypes": {torch.float64}}, False, "float32 EMAs only"),
        ({"formula": "subtract"}, False, "formula='subtract'"),
        # The first failing fact decides: off beats everything, then the device.
        ({"requested": False, "device_type": "cpu"}, False, "cuda_graph=False"),
        ({"device_type": "cpu", "offload": True}, False, "not CUDA"),
    ],
)
def test_decide_every_reason(change: dict[str, Any], use: bool, reason: str) -> None:
    decision = graphs.decide(**{**SAFE, **change})
    assert decision.use is use
    assert reason in decision.reason


def test_cpu_model_auto_is_eager_and_required_raises() -> None:
    model = nn.Linear(3, 2)
    ema = ModelEMA(model, decay=0.9)
    assert ema.cuda_graph == (False, "the model is on cpu, not CUDA")
    assert ema.engine.graph is None
    assert ModelEMA(model, cuda_graph=False).cuda_graph.reason == "cuda_graph=False"
    with pytest.raises(ValueError, match=r"cuda_graph=True.*the model is on cpu, not CUDA"):
        ModelEMA(model, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph must be None \(auto\), True or False"):
        ModelEMA(model, cuda_graph="yes")  # type: ignore[arg-type]


def test_auto_is_opt_in_until_proven_on_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AUTO_REPLAY`` is ``False`` until a GPU run proves replay exact (issue 25), and
    ``resolve`` reads it at each call, so the flip is one assignment."""
    assert graphs.AUTO_REPLAY is False
    facts = {
        "cuda_available": True,
        "graphs_supported": True,
        "offload": False,
        "schedule_on_device": True,
        "ema_dtypes": {torch.float32},
    }
    seen: list[bool] = []

    def record(**kwargs: Any) -> graphs.GraphDecision:
        seen.append(kwargs["auto_replay"])
        return graphs.GraphDecision(False, "recorded")

    monkeypatch.setattr(graphs, "decide", record)
    schedule = RampDecay(decay=0.9, tau=2)
    graphs.resolve(None, torch.device("cpu"), offload=False, schedule=schedule, ema_dtypes=[])
    monkeypatch.setattr(graphs, "AUTO_REPLAY", True)
    graphs.resolve(None, torch.device("cpu"), offload=False, schedule=schedule, ema_dtypes=[])
    assert seen == [False, True]
    monkeypatch.undo()
    auto = graphs.decide(requested=None, device_type="cuda", **facts)
    assert not auto.use and "opt-in until proven on hardware" in auto.reason
    assert "cuda_graph=True" in auto.reason
    assert graphs.decide(requested=True, device_type="cuda", **facts).use


def test_resolve_reads_the_schedule_and_dtypes() -> None:
    cpu = torch.device("cpu")
    assert graphs.resolve(
        None, cpu, offload=False, schedule=RampDecay(decay=0.9, tau=2), ema_dtypes={torch.float32}
    ).reason.endswith("not CUDA")
    # With a fake CUDA device type the remaining facts decide.
    fake = {"cuda_available": True, "graphs_supported": True}
    for schedule, dtypes, use in [
        (RampDecay(decay=0.9, tau=2), {torch.float32}, True),
        (CallableDecay(lambda s: 0.5), {torch.float32}, False),
        (RampDecay(decay=0.9, tau=2), {torch.float64}, False),
    ]:
        decision = graphs.decide(
            requested=True,
            device_type="cuda",
            offload=False,
            schedule_on_device=isinstance(schedule, graphs.DEVICE_DECAY_SCHEDULES),
            ema_dtypes=dtypes,
            **fake,
        )
        assert decision.use is use, (schedule, dtypes)


# --------------------------------------------------------------------------- fake CUDA
class FakeGraph:
    """Runs the step once (the warm-up that is also this call's step), keeps the function
    captured at that time, replays it."""

    made: ClassVar[list[FakeGraph]] = []

    def __init__(self, fn: Callable[[], None], device: torch.device) -> None:
        self.fn = fn
        self.replays = 0
        fn()
        FakeGraph.made.append(self)

    def replay(self) -> None:
        self.replays += 1
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[FakeGraph]:
    real = graphs.decide

    def on_cuda(**kwargs: Any) -> graphs.GraphDecision:
        kwargs.update(device_type="cuda", cuda_available=True, graphs_supported=True)
        return real(**kwargs)

    monkeypatch.setattr(graphs, "decide", on_cuda)
    monkeypatch.setattr(graphs, "_CudaGraph", FakeGraph)
    monkeypatch.setattr(FakeGraph, "made", [])
    return FakeGraph.made


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)
        self.register_buffer("stat", torch.randn(3))


def _reference_decay(updates: int, *, decay: float, tau: float, every: int, after: int) -> float:
    """Written here: the ramp, raised to ``every``; 0 (copy) within ``after``."""
    step = updates - after
    if step <= 0:
        return 0.0
    return (decay * (1 - math.exp(-step / tau))) ** every


def _perturb(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.1)


def _ema_values(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ema.ema_tensors().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_path_equals_eager_and_reference(
    fake_cuda: list[FakeGraph], dtype: torch.dtype
) -> None:
    """Replays give the host path's bits (fp32 model, and bf16 model with an fp32 EMA:
    the upcast goes through the reused scratch); the counters agree without a sync."""
    model = Net().to(dtype)
    opts = {"decay": 0.9, "tau": 3.0, "update_every": 2, "update_after_step": 1}
    graphed = ModelEMA(model, cuda_graph=True, **opts)
    eager = ModelEMA(model, cuda_graph=False, **opts)
    assert graphed.cuda_graph.use and not eager.cuda_graph.use
    ref = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    for step in range(1, 8):
        _perturb(model, step)
        graphed.update()
        eager.update()
        if step % 2 == 0:
            d = _reference_decay(step, decay=0.9, tau=3.0, every=2, after=1)
            for k, v in model.state_dict().items():
                ref[k].lerp_(v.float(), 1 - d)
        assert graphed.updates == eager.updates == step
        assert graphed.last_decay == eager.last_decay
    assert all(torch.isfinite(v).all() for v in ref.values())
    assert mismatches(_ema_values(graphed), _ema_values(eager)) == []
    assert mismatches(_ema_values(graphed), ref) == []
    assert len(fake_cuda) == 1 and fake_cuda[0].replays == 6
    assert graphed.engine.graph is not None and graphed.engine.graph.captures == 1


def test_recapture_after_rebind_build_module_and_load(fake_cuda: list[FakeGraph]) -> None:
    model = Net()
    ema = ModelEMA(model, decay=0.5, tau=None, cuda_graph=True)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def step(i: int) -> None:
        _perturb(model, i)
        ema.update()
        for k, v in model.state_dict().items():
            ref[k].lerp_(v, 0.5)

    assert ema.engine.graph is not None
    step(1)
    step(2)
    assert ema.engine.graph.captures == 1
    # Storage re-allocated in place of the same Parameter: only data_ptr tells.
    model.a.weight.data = model.a.weight.data.clone()
    step(3)
    assert ema.engine.graph.captures == 2
    # A new Parameter registered (module surgery with the same shape).
    model.b.weight = nn.Parameter(model.b.weight.detach().clone() + 1.0)
    step(4)
    step(5)
    assert ema.engine.graph.captures == 3
    assert mismatches(_ema_values(ema), ref) == []
    # A load re-captures; the loaded values and counter carry on.
    state = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ema.state_dict().items()
    }
    state["ema"] = {k: v.detach().clone() for k, v in state["ema"].items()}
    ema.load_state_dict(state)
    step(6)
    assert ema.engine.graph.captures == 4
    ema.load_full_state_dict({k: v.clone() for k, v in ref.items()}, updates=6)
    step(7)
    assert ema.engine.graph.captures == 5
    # build_module moves nothing without a process group but re-caches the groups.
    ema.build_module()
    step(8)
    assert ema.engine.graph.captures == 6
    assert ema.updates == 8
    assert mismatches(_ema_values(ema), ref) == []


def test_outer_capture_runs_the_host_path_then_the_graph_catches_up(
    fake_cuda: list[FakeGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside the caller's own capture (or compile) the update runs as written; the
    device counter is then behind the host one and is refreshed before the next replay."""
    model = Net()
    opts = {"decay": 0.9, "tau": 2.0}
    graphed = ModelEMA(model, cuda_graph=True, **opts)
    eager = ModelEMA(model, cuda_graph=False, **opts)
    for i in range(1, 9):
        monkeypatch.setattr(graphs, "stream_is_capturing", lambda i=i: 3 <= i <= 5)
        _perturb(model, i)
        graphed.update()
        eager.update()
    assert graphed.engine.graph is not None and graphed.engine.graph.captures == 1
    assert fake_cuda[0].replays == 4  # calls 2, 6, 7, 8
    assert mismatches(_ema_values(graphed), _ema_values(eager)) == []
    assert graphed.updates == 8


def test_graph_path_refusals(fake_cuda: list[FakeGraph], monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    ema = ModelEMA(model, decay=0.9, cuda_graph=True)
    with ema.average_parameters(), pytest.raises(RuntimeError, match="swapped"):
        ema.update()
    ema.close()
    with pytest.raises(RuntimeError, match="closed"):
        ema.update()
    # Unsafe options fall back (auto, even once auto replays) or raise (required), naming
    # the reason.
    monkeypatch.setattr(graphs, "AUTO_REPLAY", True)
    bf16 = ModelEMA(model, ema_dtype=torch.bfloat16)
    assert bf16.engine.graph is None and "torch.bfloat16" in bf16.cuda_graph.reason
    with pytest.raises(ValueError, match=r"cuda_graph=True.*schedule is not one of"):
        ModelEMA(model, schedule=lambda s: 0.5, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True.*offload=True"):
        ModelEMA(model, offload=True, cuda_graph=True)


def test_reason_logged_once(
    fake_cuda: list[FakeGraph], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(graphs, "_logged", set())
    model = Net()
    with caplog.at_level(logging.DEBUG, logger="dtensor_ema"):
        ModelEMA(model)
        ModelEMA(model)
        ModelEMA(model, cuda_graph=True)
        monkeypatch.setattr(graphs, "AUTO_REPLAY", True)  # what the flip will log
        ModelEMA(model)
        ModelEMA(model, cuda_graph=False)
    records = [r.getMessage() for r in caplog.records if r.name == "dtensor_ema"]
    assert records == [
        "dtensor_ema: update() runs eagerly (cuda_graph=None: replay would be exact here "
        "(CUDA model, float32 EMA, built-in schedule) but is opt-in until proven on "
        "hardware; pass cuda_graph=True)",
        "dtensor_ema: update() replays a CUDA graph (CUDA model, float32 EMA, built-in "
        "schedule: device counter and decay)",
        "dtensor_ema: update() runs eagerly (cuda_graph=False)",
    ]


class FailingGraph:
    """Runs the step once (as the warm-up does), then the capture fails."""

    def __init__(self, fn: Callable[[], None], device: torch.device) -> None:
        fn()
        raise graphs.CaptureFailed("RuntimeError: operation not permitted when stream is capturing")


@pytest.mark.parametrize("required", [False, True])
def test_a_failed_capture_applies_the_step_once_then_stays_eager(
    fake_cuda: list[FakeGraph],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    required: bool,
) -> None:
    monkeypatch.setattr(graphs, "_CudaGraph", FailingGraph)
    monkeypatch.setattr(graphs, "AUTO_REPLAY", True)  # auto: the fallback once it replays
    model = Net()
    opts = {"decay": 0.9, "tau": 2.0}
    graphed = ModelEMA(model, cuda_graph=True if required else None, **opts)
    eager = ModelEMA(model, cuda_graph=False, **opts)
    for i in range(1, 5):
        _perturb(model, i)
        if required and i == 1:
            with pytest.raises(RuntimeError, match=r"capturing the update failed.*counted"):
                graphed.update()
        else:
            with caplog.at_level(logging.WARNING, logger="dtensor_ema"):
                graphed.update()
        eager.update()
    assert not graphed.cuda_graph.use and "capturing failed" in graphed.cuda_graph.reason
    assert graphed.updates == eager.updates == 4
    assert mismatches(_ema_values(graphed), _ema_values(eager)) == []
    assert graphed.engine.graph is not None and graphed.engine.graph.captures == 0
    if not required:
        assert [r.levelname for r in caplog.records if "failed" in r.getMessage()] == ["WARNING"]
    # A change of the tracked set does not forget the failure: it stays eager, no retry.
    graphed.drop_tensors(["stat"])
    eager.drop_tensors(["stat"])
    _perturb(model, 5)
    graphed.update()
    eager.update()
    assert not graphed.cuda_graph.use and "capturing failed" in graphed.cuda_graph.reason
    assert mismatches(_ema_values(graphed), _ema_values(eager)) == []


def test_multi_ema_refuses_the_option_and_never_graphs(fake_cuda: list[FakeGraph]) -> None:
    from dtensor_ema import MultiModelEMA

    with pytest.raises(ValueError, match=r"\['cuda_graph'\] not supported by MultiModelEMA"):
        MultiModelEMA(Net(), {"a": {"cuda_graph": True}})
    multi = MultiModelEMA(Net(), {"a": {"decay": 0.5}})
    multi.update()
    assert multi["a"].cuda_graph.reason == "cuda_graph=False" and fake_cuda == []


def test_the_decision_follows_add_and_drop_tensors(
    fake_cuda: list[FakeGraph], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracking a float64 tensor later rules the graph out as it would at construction:
    ``cuda_graph=True`` refuses the add (tracked set unchanged); auto falls back to eager
    and returns to the graph once the tensor is dropped, the bits equal to eager's."""
    monkeypatch.setattr(graphs, "AUTO_REPLAY", True)

    def make() -> nn.Module:
        model = Net()
        model.register_buffer("wide", torch.randn(4, dtype=torch.float64))
        return model

    not_wide = lambda fqn, t: fqn != "wide"  # noqa: E731
    model = make()
    required = ModelEMA(model, cuda_graph=True, decay=0.9, tau=None, track=not_wide)
    with pytest.raises(ValueError, match=r"cuda_graph=True.*torch.float64"):
        required.add_tensors(["wide"])
    assert "wide" in required.untracked and "wide" not in required.ema_tensors()
    assert required.cuda_graph.use
    auto = ModelEMA(model, decay=0.9, tau=None, track=not_wide)
    eager = ModelEMA(model, cuda_graph=False, decay=0.9, tau=None, track=not_wide)
    assert auto.cuda_graph.use
    for step in range(1, 7):
        if step == 3:
            auto.add_tensors(["wide"])
            eager.add_tensors(["wide"])
            assert not auto.cuda_graph.use and "float64" in auto.cuda_graph.reason
        if step == 5:
            auto.drop_tensors(["wide"])
            eager.drop_tensors(["wide"])
            assert auto.cuda_graph.use
        _perturb(model, step)
        auto.update()
        eager.update()
        required.update()
    assert mismatches(_ema_values(auto), _ema_values(eager)) == []
    assert mismatches(_ema_values(required), _ema_values(eager)) == []
    # With track="trainable", the refused add leaves the trainable-set check as it was: a
    # change made meanwhile is still reported by the next update.
    model = make()
    model.wide_p = nn.Parameter(torch.randn(3, dtype=torch.float64), requires_grad=False)
    trainable = ModelEMA(model, cuda_graph=True, decay=0.9, tau=None, track="trainable")
    model.wide_p.requires_grad_(True)
    model.a.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"cuda_graph=True.*torch.float64"):
        trainable.add_tensors(["wide_p"])
    with pytest.raises(ValueError, match=r"now trainable \['wide_p'\].*frozen \['a.bias'\]"):
        trainable.update()
