"""Replaying ``update()`` as a captured CUDA graph: when it is safe, and the graph itself.

A CUDA graph of the capturable update (counter and decay on the device) replays it with
one launch, where the eager update is bound by host launch cost; replay is **opt-in until
proven on hardware** (:data:`AUTO_REPLAY`): both in ``docs/performance-cuda.md``.

When it is safe (:func:`decide`, a pure function of its inputs so CPU tests cover every
reason):

* the model is on CUDA and ``torch.cuda`` works, with ``torch.cuda.graph`` available;
* no ``offload`` (that path hands work to the host);
* the schedule computes its decay on the device exactly as on the host (the built-in
  schedules; a user callable may not be written in torch ops);
* every EMA tensor is float32: the device decay is rounded to the EMA dtype, which equals
  eager's Python-float weight bit for bit for float32 only;
* the sources' storage is stable: the graph reads fixed addresses, so ``update()`` checks
  the plan first (``EmaPlan.sync``: one integer compare and one ``data_ptr`` per tensor) and
  re-captures after any re-bind (model surgery, ``build_module``, a load).

:class:`GraphedStep` owns the graph: the first call runs the step once eagerly on a side
stream (that is this call's update, and the warm-up ``torch.cuda.graph`` requires: lazy
initialization, cached scratch buffers and compiled kernels happen outside the capture),
then captures it; later calls replay. :meth:`GraphedStep.invalidate` drops the graph (and
its memory pool) so the next call captures again.

:class:`GraphedUpdater` is the replay as an :class:`~dtensor_ema.update.updater.Updater`: it runs
each ``update()`` call through the graph, and through the updater it wraps (inline or
capturable) inside a caller's own capture or after a failed capture.
:func:`dtensor_ema.engine.make_updater` wraps an updater in it when :func:`resolve` says yes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch

from dtensor_ema.update.counter import UpdateCounter
from dtensor_ema.update.fused_update import UpdateGroup
from dtensor_ema.update.updater import CapturableUpdater, Done, Updater

__all__ = [
    "AUTO_REPLAY",
    "CAPTURE_FAILED",
    "DEVICE_DECAY_SCHEDULES",
    "CaptureFailed",
    "GraphDecision",
    "GraphRequest",
    "GraphedStep",
    "GraphedUpdater",
    "decide",
    "log_decision",
    "resolve",
]

logger = logging.getLogger("dtensor_ema")


def _device_decay_schedules() -> tuple[type, ...]:
    from dtensor_ema.decay import ConstantDecay, HalfLifeDecay, RampDecay, WarmupDecay

    return (RampDecay, ConstantDecay, WarmupDecay, HalfLifeDecay)


DEVICE_DECAY_SCHEDULES: tuple[type, ...] = _device_decay_schedules()
"""Schedules whose ``decay_tensor_for`` equals ``decay_for`` once rounded to float32
(tests/test_options.py checks the capturable path against the host path)."""


AUTO_REPLAY = False
"""What ``cuda_graph=None`` does where replay is safe: ``False`` (eager) until a GPU run has
proven replay exact and captured in the common cases (issue 25: the last GPU run predates
the replay path); ``cuda_graph=True`` opts in meanwhile. :func:`resolve` reads it at each
construction."""


CAPTURE_FAILED = "capturing failed"
"""How a decision's reason starts once a capture failed on this EMA: it stays eager."""


class GraphDecision(NamedTuple):
    """Whether ``update()`` replays a CUDA graph, and why (or why not)."""

    use: bool
    reason: str


class GraphRequest(NamedTuple):
    """What :func:`dtensor_ema.engine.make_updater` needs to wrap an updater in the replay."""

    decision: GraphDecision
    device: torch.device
    """The EMA's CUDA device."""
    required: bool
    """``cuda_graph=True``: a failed capture raises."""


def decide(
    *,
    requested: bool | None,
    device_type: str,
    cuda_available: bool,
    graphs_supported: bool,
    offload: bool,
    schedule_on_device: bool,
    ema_dtypes: Collection[torch.dtype],
    formula: str = "lerp",
    auto_replay: bool = False,
) -> GraphDecision:
    """Whether the update replays a captured CUDA graph (with the same bits as eager).

    Pure: no torch state is read, so every branch is testable without a GPU.

    Args:
        requested: the ``cuda_graph`` option: ``None`` (auto), ``False`` (off), ``True``
            (required; the caller raises with ``reason`` when ``use`` is ``False``).
        device_type: the model's device type (``"cuda"``, ``"cpu"``, ...).
        cuda_available: ``torch.cuda.is_available()``.
        graphs_supported: this torch build has ``torch.cuda.graph``/``CUDAGraph``.
        offload: the ``offload`` option.
        schedule_on_device: the schedule's device decay equals its host decay
            (:data:`DEVICE_DECAY_SCHEDULES`).
        ema_dtypes: the dtypes of the EMA tensors.
        formula: the ``formula`` option; the device-side update implements ``"lerp"`` only.
        auto_replay: whether ``requested=None`` replays where that is safe
            (:data:`AUTO_REPLAY`); ``False``: only ``requested=True`` does.

    Returns:
        ``(use, reason)``; ``reason`` is one line naming the deciding fact.
    """
    if requested is False:
        return GraphDecision(False, "cuda_graph=False")
    if device_type != "cuda":
        return GraphDecision(False, f"the model is on {device_type}, not CUDA")
    if not cuda_available:
        return GraphDecision(False, "torch.cuda.is_available() is False")
    if not graphs_supported:
        return GraphDecision(False, "this torch build has no torch.cuda.CUDAGraph")
    if offload:
        return GraphDecision(
            False, "offload=True updates host-resident shards, which a CUDA graph cannot"
        )
    if formula != "lerp":
        return GraphDecision(
            False, f"formula={formula!r}: the device-side update implements 'lerp' only"
        )
    if not schedule_on_device:
        return GraphDecision(
            False,
            "the decay schedule is not one of the built-in ones (RampDecay, ConstantDecay, "
            "WarmupDecay, HalfLifeDecay) whose device decay is known to equal the host decay",
        )
    others = sorted({str(d) for d in ema_dtypes if d != torch.float32})
    if others:
        return GraphDecision(
            False,
            f"EMA dtype(s) {others}: the device decay is rounded to the EMA dtype, which "
            "equals eager's weight bit for bit for float32 EMAs only",
        )
    if requested is None and not auto_replay:
        return GraphDecision(
            False,
            "cuda_graph=None: replay would be exact here (CUDA model, float32 EMA, built-in "
            "schedule) but is opt-in until proven on hardware; pass cuda_graph=True",
        )
    return GraphDecision(
        True, "CUDA model, float32 EMA, built-in schedule: device counter and decay"
    )


def resolve(
    requested: bool | None,
    device: torch.device,
    *,
    offload: bool,
    schedule: Any,
    ema_dtypes: Collection[torch.dtype],
    formula: str = "lerp",
) -> GraphDecision:
    """:func:`decide` with this process's facts; raises if ``requested`` is ``True`` but
    the graph is unsafe.

    Raises:
        ValueError: ``cuda_graph=True`` where the decision is no, naming the reason.
    """
    decision = decide(
        requested=requested,
        device_type=device.type,
        cuda_available=torch.cuda.is_available(),
        graphs_supported=hasattr(torch.cuda, "CUDAGraph") and hasattr(torch.cuda, "graph"),
        offload=offload,
        schedule_on_device=isinstance(schedule, DEVICE_DECAY_SCHEDULES),
        ema_dtypes=ema_dtypes,
        formula=formula,
        auto_replay=AUTO_REPLAY,
    )
    if requested is True and not decision.use:
        raise ValueError(
            f"cuda_graph=True, but the update cannot replay a CUDA graph here: "
            f"{decision.reason}. Pass cuda_graph=None (auto) or False"
        )
    return decision


_logged: set[str] = set()


def log_decision(decision: GraphDecision, device_type: str) -> None:
    """Log the decision once per distinct reason on the ``dtensor_ema`` logger (INFO for
    CUDA models, DEBUG for others, where a graph never applies)."""
    if decision.reason in _logged:
        return
    _logged.add(decision.reason)
    level = logging.INFO if device_type == "cuda" else logging.DEBUG
    mode = "replays a CUDA graph" if decision.use else "runs eagerly"
    logger.log(level, "dtensor_ema: update() %s (%s)", mode, decision.reason)


def stream_is_capturing() -> bool:
    """Whether the caller is itself capturing a graph or compiling (then the update runs
    as written, inside the caller's graph, never a graph of ours)."""
    if torch.compiler.is_compiling():
        return True
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class CaptureFailed(RuntimeError):
    """The step ran (once, eagerly) but capturing it failed: it must not run again."""


class _CudaGraph:
    """``fn`` run once on a side stream (this call's step, and the warm-up), then captured."""

    def __init__(self, fn: Callable[[], None], device: torch.device) -> None:
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                fn()
            current.wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph synchronizes, captures on its own stream and keeps the
            # temporaries of fn in the graph's private memory pool. "thread_local": other
            # threads (a DataLoader's pin-memory thread) may keep calling CUDA meanwhile.
            try:
                with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
                    fn()
            except Exception as err:
                raise CaptureFailed(f"{type(err).__name__}: {err}") from err

    def replay(self) -> None:
        self._graph.replay()


GraphFactory = Callable[[Callable[[], None], torch.device], Any]


class GraphedStep:
    """A step captured once, replayed on every later call, re-captured after
    :meth:`invalidate`.

    Args:
        device: the CUDA device of the EMA.
        factory: builds a replayable from ``(fn, device)``, running ``fn`` once for real
            (tests pass a fake; the default captures a ``torch.cuda.CUDAGraph``).

    Memory: the graph's private pool keeps the temporaries of one step (0-dim decay
    tensors; upcast copies of bf16/fp16 sources are bounded by the update's reused
    scratch buffer, which lives in the group cache).
    """

    def __init__(self, device: torch.device, factory: GraphFactory | None = None) -> None:
        self.device = device
        self._factory: GraphFactory = factory or _CudaGraph
        self._graph: Any = None
        self.captures = 0
        """How many times the step was captured (1 + the re-captures after re-binds)."""
        self.capture_seconds: float | None = None
        """Wall seconds of the latest capture, warm-up step included (host side)."""
        self.failed: str | None = None
        """Why capturing failed (the caller then stays eager), or ``None``."""

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def invalidate(self) -> None:
        """Drop the graph (its addresses are stale); the next call captures again."""
        self._graph = None

    def __call__(self, build: Callable[[], Callable[[], None]]) -> None:
        """Replay; or, with no graph, ``build()`` the step function, run it once and
        capture it."""
        if self._graph is not None:
            self._graph.replay()
            return
        start = time.perf_counter()
        try:
            self._graph = self._factory(build(), self.device)
        except CaptureFailed as err:  # this call's step did run, once
            self.failed = str(err)
            logger.warning(
                "dtensor_ema: capturing the update in a CUDA graph failed (%s); "
                "update() stays eager from now on",
                self.failed,
            )
            return
        self.captures += 1
        self.capture_seconds = time.perf_counter() - start
        logger.debug(
            "dtensor_ema: captured the update on %s in %.3f s (capture %d)",
            self.device,
            self.capture_seconds,
            self.captures,
        )


class GraphedUpdater(Updater):
    """``update()`` replayed as a captured CUDA graph of the capturable step.

    Each :meth:`run` counts and applies one call on the device through :class:`GraphedStep`
    (captured on the first call and after :meth:`rebind`/:meth:`invalidate`, replayed
    otherwise); the host counts beside the device (unless ``capturable``), so reading
    ``updates`` does not synchronize. Inside the caller's own capture or compilation
    (:func:`stream_is_capturing`), and for good once a capture failed, ``run`` is the
    wrapped ``inner`` updater's (the eager path). Local: no communication.

    Args:
        inner: the updater of the same groups (:class:`~dtensor_ema.update.updater.
            InlineUpdater`, or :class:`~dtensor_ema.update.updater.CapturableUpdater` with
            ``capturable=True``); :meth:`submit`, :meth:`wait` and :meth:`close` are its.
        device: the CUDA device of the EMA.
        decision: why replay is on (:func:`resolve`); :attr:`decision` says why it is off
            after a failed capture.
        capturable: the ``capturable`` option (the device count is then authoritative).
        required: ``cuda_graph=True``: a failed capture raises (after this call's step was
            applied eagerly and counted).
        factory: see :class:`GraphedStep` (tests pass a fake).

    Memory: the graph's private pool (see :class:`GraphedStep`).
    """

    def __init__(
        self,
        inner: Updater,
        device: torch.device,
        decision: GraphDecision,
        *,
        capturable: bool,
        required: bool,
        factory: GraphFactory | None = None,
    ) -> None:
        super().__init__(inner.groups)
        self.inner = inner
        self.graph = GraphedStep(device, factory)
        self.decision = decision
        self.capturable = capturable
        self.required = required

    @property
    def replays(self) -> bool:
        """Whether the next :meth:`run` goes through the graph."""
        return self.graph.failed is None and not stream_is_capturing()

    @property
    def checks_sources(self) -> bool:  # type: ignore[override]
        return self.replays or self.inner.checks_sources

    def run(self, counter: UpdateCounter) -> None:
        if not self.replays:
            self.inner.run(counter)
            return
        self.ensure_open()
        counter.refresh_device()
        groups = self.groups

        def build() -> Callable[[], None]:
            return functools.partial(counter.device_step, CapturableUpdater(groups).submit)

        if self.capturable:
            self.graph(build)
        else:
            updates, decay = counter.next_step()
            self.graph(build)
            counter.record(updates, decay)
        if self.graph.failed is not None:  # the step ran eagerly; the inner path from now on
            self.decision = GraphDecision(False, f"{CAPTURE_FAILED}: {self.graph.failed}")
            if self.required:
                raise RuntimeError(
                    f"cuda_graph=True, but capturing the update failed ({self.graph.failed}); "
                    "this call's update was applied eagerly and counted"
                )

    def submit(self, step: Any, done: Done | None = None) -> None:
        self.inner.submit(step, done)

    def buffer_nbytes(self) -> dict[str, int]:
        return self.inner.buffer_nbytes()

    def wait(self) -> None:
        self.inner.wait()

    def rebind(self, groups: list[UpdateGroup]) -> None:
        """New groups: the graph read the old addresses, so it is dropped (the next call
        captures again)."""
        self.inner.rebind(groups)
        self.groups = groups
        self.graph.invalidate()

    def invalidate(self) -> None:
        """A load wrote in place (addresses hold), but a re-capture rules out any state the
        graph baked in."""
        self.graph.invalidate()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def ensure_open(self) -> None:
        self.inner.ensure_open()

    def close(self) -> None:
        self._closed = True
        self.inner.close()
