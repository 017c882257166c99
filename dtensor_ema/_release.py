"""Collectives that return only once the process group has let go of their tensors.

Why: a synchronous collective returns as soon as its result is ready, but the backend's
worker thread (gloo's ``pt_gloo_runloop``) still holds the tensors it was given until it
destroys the finished work, a moment later. Under torch 2.14 a tensor that has a Python
object gives that object one reference while any C++ code holds the tensor, and the last
C++ holder to let go drops it, which takes the GIL. When the process exits meanwhile (a
Lightning ``ddp_spawn`` child returning right after ``Trainer.fit``, a script ending
without ``destroy_process_group``), the worker thread asks for the GIL while the
interpreter is finalizing; CPython then ends the thread (``pthread_exit``), the unwind
meets a ``noexcept`` frame, and the process aborts: "terminate called without an active
exception", SIGABRT (pytorch#190489, #179291). On a loaded machine the worker still held
the tensors when the call returned after 3-30% of the all-reduces measured.

:func:`released` closes that window for the tensors the library hands to a collective:
after the call it waits (the GIL released, polling every 50 us to 1 ms) until no C++
code holds more of each tensor than before the call and its Python object is back to the
references it had, i.e. until the worker thread has finished with it. Usually it does not
wait at all. So when a collective method of this library returns, the process group holds
nothing of it, and exiting right after is safe.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

__all__ = ["RELEASE_SECONDS", "released"]

RELEASE_SECONDS = 1.0
"""How long :func:`released` waits at most. Reached only if something other than the
process group keeps a reference taken during the call; it then warns once and stops waiting
for the rest of the process (the collective itself has completed either way)."""

_POLL_FIRST, _POLL_MAX = 5e-5, 1e-3
_waiting = [True]  # cleared once a wait ran out (see RELEASE_SECONDS)

# torch-private: the number of C++ references to a tensor (its Python object counts one).
# Without it (another torch), the Python reference count alone still shows the hazard: the
# backend's hold adds one to it until the worker thread lets go.
_use_count = getattr(torch.Tensor, "_use_count", None)


def _references(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(C++ references, Python references)`` of each tensor, as seen from this call (the
    same call before and after a collective sees the same Python references)."""
    return [(_use_count(t) if _use_count is not None else 0, sys.getrefcount(t)) for t in tensors]


def _wait(tensors: Sequence[torch.Tensor], before: Sequence[tuple[int, int]]) -> None:
    deadline = None
    poll = _POLL_FIRST
    while _waiting[0]:
        now = _references(tensors)
        if all(n[0] <= b[0] and n[1] <= b[1] for n, b in zip(now, before, strict=True)):
            return
        if deadline is None:
            deadline = time.monotonic() + RELEASE_SECONDS
        elif time.monotonic() > deadline:
            _waiting[0] = False
            warnings.warn(
                "dtensor_ema: a collective's tensors were still referenced "
                f"{RELEASE_SECONDS:g} s after it returned; no longer waiting for the process "
                "group to release them (a process that exits right after a collective may "
                "then abort in torch's teardown, pytorch#190489)",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        time.sleep(poll)  # releases the GIL, which the worker thread needs
        poll = min(2 * poll, _POLL_MAX)


@contextlib.contextmanager
def released(*tensors: torch.Tensor) -> Iterator[None]:
    """Hand ``tensors`` to a collective in the body; return once the process group let go.

    Wrap exactly the tensors passed to the collective (a view passed as an argument is its
    own tensor). Only CPU tensors are waited for: gloo runs their collectives synchronously
    and lets go of them a moment later; NCCL's collectives on CUDA tensors return before
    the GPU ran them, so waiting for their release would synchronize the host on every
    collective. Local, no communication; no extra memory. Waits only after the body
    completed normally (an error propagates at once).
    """
    cpu = tuple(t for t in tensors if t.device.type == "cpu")
    before = _references(cpu)
    yield
    if cpu:
        _wait(cpu, before)
