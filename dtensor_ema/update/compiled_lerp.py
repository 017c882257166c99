"""A compiled single-pass lerp: each source value read once, each EMA value read and written once.

Eager ``torch._foreach_lerp_`` needs both operands in the EMA dtype, so a bf16 model with an
fp32 EMA pays for an upcast pass (about 18 bytes moved per value instead of the 10 a single
pass needs), and K EMAs of one model read every source K times. ``torch.compile`` fuses the
upcast into the lerp and the K lerps into one loop per tensor: Inductor emits C++ on CPU and
Triton on CUDA.

The result equals eager ``lerp_`` bit for bit. torch computes
``self + w * (end - self)`` for ``|w| < 0.5``, else ``end - (end - self) * (1 - w)``, with a
fused multiply-add on both CPU (``vec::fmadd``) and CUDA; Inductor's lerp decomposition keeps
that formula and emits ``fma`` on CUDA, and on CPU it needs ``-ffp-contract=fast`` to contract
the same multiply-add (off by default: without it about a quarter of the values differ in the
last bit). The upcast is exact.

The weight goes in as a 0-dim tensor (data, not a constant), so changing the decay never
recompiles. Each graph is its own function (a fresh code object, hence its own Dynamo
cache) over flat views of contiguous tensors, at most :data:`CHUNK_TENSORS` tensors per
graph so compile time stays linear in the number of tensors.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "COMPILED_EMA_DTYPES",
    "CompiledLerp",
    "compile_unavailable_reason",
    "warn_unavailable",
]

logger = logging.getLogger(__name__)

COMPILED_EMA_DTYPES = (torch.float32, torch.float64)
"""EMA dtypes the compiled kernel covers; other EMA dtypes (a bf16 EMA) stay eager."""

INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"cpp.enable_floating_point_contract_flag": "fast"},
    "cuda": {},
}
"""Inductor options per device type, read when a kernel is built (benchmarks vary them)."""
_ids = itertools.count()
_broken: dict[str, str] = {}
"""Device type -> why compiling failed there; later groups go eager without retrying."""
_warned: set[str] = set()


def warn_unavailable(device_type: str, reason: str) -> None:
    """The one-line notice that a device falls back to eager, once per device type."""
    if device_type in _warned:
        return
    _warned.add(device_type)
    warnings.warn(
        f"dtensor_ema: compiled update unavailable on {device_type} ({reason}); "
        "using the eager kernel",
        RuntimeWarning,
        stacklevel=4,
    )


def _lerp_body(
    emas: list[list[torch.Tensor]], sources: list[torch.Tensor], weights: list[torch.Tensor]
) -> None:
    # One loop per tensor i: read sources[i] once, upcast in registers, update K EMAs.
    for i, source in enumerate(sources):
        end = source.to(emas[0][i].dtype)
        for ema_list, weight in zip(emas, weights, strict=True):
            ema = ema_list[i]
            ema.copy_(torch.lerp(ema, end, weight))


def compile_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build the kernel on ``device``, or ``None``."""
    if device.type in _broken:
        return _broken[device.type]
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is not installed"
    elif device.type != "cpu":
        return f"no compiled kernel for device type {device.type!r}"
    return None


CHUNK_TENSORS = 32
"""Tensors per compiled graph. Inductor's scheduler tries fusions pairwise, so one graph of
n independent tensors costs O(n^2) to compile (ResNet-50's 267 tensors: minutes on CPU);
graphs of <= 32 keep compile time linear, and repeated layers hit Inductor's caches."""

DYNAMIC = False
"""Static shapes: one kernel per distinct tensor size, deduplicated by Inductor (a
transformer has a handful); symbolic sizes would share one kernel but make every graph pay
for symbolic shape reasoning."""


class CompiledLerp:
    """``emas[k][i].lerp_(sources[i], weights[k])`` for all k and i in one compiled pass.

    Args:
        emas: K lists of EMA tensors (K >= 1), each aligned with the sources; one device,
            one dtype from :data:`COMPILED_EMA_DTYPES`.

    Call with the sources (any float dtype, same shapes) and K 0-dim weight tensors of the
    EMA dtype on the EMA device. The first call compiles (seconds; logged at INFO and kept
    in :attr:`compile_seconds`). If compiling fails, the call warns once (one line), leaves
    the EMAs untouched and returns ``False``: the caller then runs its eager path.
    """

    def __init__(self, emas: Sequence[Sequence[torch.Tensor]]) -> None:
        self._emas = [list(e) for e in emas]
        self.device = self._emas[0][0].device
        self.compile_seconds: float | None = None
        self._args: dict[int, tuple[list[tuple[Any, Any]], list[torch.Tensor]]] = {}
        self._fns: list[Callable[..., None]] = []

    def _compile(self) -> Callable[..., None]:
        name = f"_dtensor_ema_lerp_{next(_ids)}"
        # A fresh code object per graph: Dynamo keys its cache (and its recompile limit) on
        # the code object, so graphs of other shapes never count as recompiles.
        fn = types.FunctionType(_lerp_body.__code__.replace(co_name=name), _lerp_body.__globals__)
        options = dict(INDUCTOR_OPTIONS.get(self.device.type, {})) or None
        return torch.compile(fn, fullgraph=True, dynamic=DYNAMIC, options=options)

    def __call__(self, sources: list[torch.Tensor], weights: list[torch.Tensor]) -> bool:
        if torch.compiler.is_compiling():
            # Inside the caller's torch.compile (a captured capturable update): trace what the
            # eager kernel does, which the caller's Inductor lowers with eager's bits; our
            # body would be compiled without our options (no FMA contraction on CPU).
            ends = [s.to(self._emas[0][0].dtype) for s in sources]
            for ema_list, weight in zip(self._emas, weights, strict=True):
                torch._foreach_lerp_(ema_list, ends, [weight] * len(ema_list))
            return True
        chunks = self._chunked_args(sources)
        if self.compile_seconds is not None:
            for fn, (emas, flat_sources) in zip(self._fns, chunks, strict=True):
                fn(emas, flat_sources, weights)
            return True
        if compile_unavailable_reason(self.device) is not None:
            return False
        start = time.perf_counter()
        try:
            # Compile (and run) every chunk's graph. Dynamo and Inductor raise
            # TorchDynamoException subclasses for anything that fails while tracing or
            # compiling, i.e. before a graph writes an EMA value; a failure after some chunks
            # ran is re-raised (never silently applied twice), as are errors while running.
            for emas, flat_sources in chunks:
                fn = self._compile()
                fn(emas, flat_sources, weights)
                self._fns.append(fn)
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError) as err:
            compile_error = isinstance(err, torch._dynamo.exc.TorchDynamoException) or (
                "option" in str(err)  # torch.compile(options=...) rejected before tracing
            )
            if self._fns or not compile_error:
                raise
            first_line = str(err).splitlines()[0] if str(err) else ""
            reason = f"{type(err).__name__}: {first_line[:120]}"
            _broken[self.device.type] = reason
            warn_unavailable(self.device.type, reason)
            return False
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "dtensor_ema: compiled the update of %d tensors x %d EMAs on %s in %.1f s",
            len(sources),
            len(self._emas),
            self.device,
            self.compile_seconds,
        )
        return True

    def _chunked_args(
        self, sources: list[torch.Tensor]
    ) -> list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]:
        """Per chunk of <= :data:`CHUNK_TENSORS` tensors: flat views where the source and
        every EMA are contiguous, the tensors themselves otherwise. Cached per sources list
        (the list object is kept, so its ``id`` cannot be reused while cached)."""
        cached = self._args.get(id(sources))
        if cached is not None and cached[1] is sources:
            return cached[0]
        flat_sources: list[torch.Tensor] = []
        emas: list[list[torch.Tensor]] = [[] for _ in self._emas]
        for i, source in enumerate(sources):
            column = [e[i] for e in self._emas]
            if source.is_contiguous() and all(e.is_contiguous() for e in column):
                source, column = source.view(-1), [e.view(-1) for e in column]
            flat_sources.append(source)
            for out, ema in zip(emas, column, strict=True):
                out.append(ema)
        chunks = [
            ([e[i : i + CHUNK_TENSORS] for e in emas], flat_sources[i : i + CHUNK_TENSORS])
            for i in range(0, len(flat_sources), CHUNK_TENSORS)
        ]
        self._args[id(sources)] = (chunks, sources)
        return chunks
