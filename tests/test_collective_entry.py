"""Collective entry points called by only some ranks fail instead of hanging (issue 19).

One W=2 spawn. With ``DTENSOR_EMA_CHECK_COLLECTIVES`` set, each entry point called on rank
0 alone raises within the check's seconds, naming the missing rank; rank 1, which skips
the call, just goes on. Each case runs on a fresh process group (a collective entered by
one rank leaves that group's sequence numbers out of step), and WORLD stays usable to
line the ranks up between cases. The same body checks that our own calls emit no
``FutureWarning`` (torch 2.14 deprecates ``all_gather_into_tensor``), that ranks that
track different models are told which tensors differ, and that no collective call returns
while the process group still holds one of its tensors (issue 35, clean exits: a gloo
worker thread that lets go of a Python-referenced tensor while the interpreter finalizes
aborts the process, pytorch#190489).
"""

from __future__ import annotations

import os
import re
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtensor_ema import ModelEMA, export_ema
from dtensor_ema.checkpoint.save_load import save_checkpoint
from dtensor_ema.compat.swa_utils import AveragedModel
from dtensor_ema.integrations._common import copy_ema_into_model

pytestmark = pytest.mark.distributed

CHECK_ENV = "DTENSOR_EMA_CHECK_COLLECTIVES"
CHECK_SECONDS = 2.0  # the mechanism is the same at 10 s; 2 s keeps six cases short
CASES = [
    "ModelEMA",
    "ema.module forward",
    "average_parameters",
    "get_model_state_dict",
    "save_checkpoint",
    "export_ema",
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _case(name: str, tmp: Path, mesh: DeviceMesh, group: Any) -> Callable[[], Any]:
    """Set up ``name`` on every rank; return the call that rank 0 then makes alone."""
    model = _model()
    if name == "ModelEMA":
        return lambda: ModelEMA(model, mesh=mesh)
    ema = ModelEMA(model, mesh=mesh)
    if name == "ema.module forward":
        module = ema.module  # built on every rank (local)
        return lambda: module(torch.randn(2, 4))
    if name == "average_parameters":

        def swap() -> None:
            with ema.average_parameters():
                pass

        return swap
    if name == "get_model_state_dict":
        return ema.get_model_state_dict
    if name == "save_checkpoint":
        return lambda: save_checkpoint({"ema": ema}, tmp / "ckpt", process_group=group)
    return lambda: export_ema(ema, tmp / "ema.pt")


class _HandedToBackend(TorchDispatchMode):
    """Records (weakly) every tensor passed to a c10d op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace in ("c10d", "_c10d_functional"):
            leaves = tree_leaves((args, kwargs or {}))
            self.tensors += [weakref.ref(t) for t in leaves if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def _state(refs: list[weakref.ref[torch.Tensor]]) -> list[tuple[bool, int]]:
    """Per recorded tensor: (its Python object is alive, C++ references to it)."""
    out = []
    for ref in refs:
        t = ref()
        out.append((False, 0) if t is None else (True, t._use_count()))
    return out


def _held_after_return(call: Callable[[], Any]) -> bool:
    """Whether ``call`` returned while the process group still held one of the tensors it
    was given: a tensor it handed over whose Python object dies, or whose C++ references
    drop, within 20 ms after the call returned (a gloo worker thread letting go late; its
    object stays alive until then). A tensor that is still alive then is the caller's own."""
    recorder = _HandedToBackend()
    with recorder:
        call()
    now = _state(recorder.tensors)  # at once: this thread still holds the GIL
    if not any(alive for alive, _ in now):
        return False
    time.sleep(0.02)
    return _state(recorder.tensors) != now


HELD_ROUNDS = 30


def _held_counts() -> dict[str, int]:
    """How many of HELD_ROUNDS calls of each collective entry point returned while the
    process group still held one of their tensors (0 for every entry point)."""
    ema = ModelEMA(_model())
    model = _model()
    average = AveragedModel(model, use_buffers=True)  # the Lightning drop-in's average

    def swap() -> None:
        with ema.average_parameters():
            pass

    calls: dict[str, Callable[[], Any]] = {
        "average_parameters": swap,
        "get_model_state_dict": ema.get_model_state_dict,
        "AveragedModel.gather_for_save": average.gather_for_save,
        "Lightning hand-over (copy_ema_into_model)": lambda: copy_ema_into_model(
            average.engine, model
        ),
    }
    counts = dict.fromkeys(calls, 0)
    for _ in range(HELD_ROUNDS):
        for name, call in calls.items():
            ema.update()
            average.update_parameters(model)
            counts[name] += _held_after_return(call)
    return counts


def entry_body(rank: int, world_size: int, tmp_dir: str) -> dict[str, Any]:
    tmp = Path(tmp_dir)
    out: dict[str, Any] = {}

    # Clean exits: no collective returns while the process group holds its tensors, and
    # the wait for it never runs out (it would warn).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["held"] = _held_counts()
    out["release_warnings"] = [str(w.message) for w in caught if "release" in str(w.message)]

    # Our own calls: no FutureWarning from dtensor_ema (construction, gathers, export).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema = ModelEMA(_model())
        ema.get_model_state_dict()
        export_ema(ema, tmp / "warn.pt")
    out["future_warnings"] = [
        f"{Path(w.filename).name}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, FutureWarning) and "dtensor_ema" in w.filename
    ]

    # Ranks that track different models: the differing tensor is named first.
    try:
        ModelEMA(nn.Linear(4, 5 + rank))
        out["structure_error"] = None
    except ValueError as e:
        out["structure_error"] = str(e)

    # Every entry point with the check on and all ranks calling: works.
    os.environ[CHECK_ENV] = "60"
    try:
        checked = ModelEMA(_model())
        checked.get_model_state_dict()
        export_ema(checked, tmp / "checked.pt")
        save_checkpoint({"ema": checked}, tmp / "checked")
        checked.module(torch.randn(2, 4))
        out["all_ranks_ok"] = True
    finally:
        del os.environ[CHECK_ENV]

    # Each entry point on rank 0 alone.
    for name in CASES:
        group = dist.new_group(backend="gloo")
        mesh = DeviceMesh.from_group(group, "cpu")
        call = _case(name, tmp / name.replace(" ", "_"), mesh, group)
        (tmp / name.replace(" ", "_")).mkdir(exist_ok=True)
        dist.barrier()
        if rank == 0:
            os.environ[CHECK_ENV] = str(CHECK_SECONDS)
            start = time.monotonic()
            try:
                call()
                out[name] = (None, time.monotonic() - start)
            except RuntimeError as e:
                out[name] = (str(e), time.monotonic() - start)
            finally:
                del os.environ[CHECK_ENV]
        dist.barrier()  # rank 1 skipped the call and waits here, never inside it
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("entry")
    return run_ranks(entry_body, 2, tmp, str(tmp), deadline_s=240)


@pytest.mark.parametrize("name", CASES)
def test_call_on_one_rank_raises_naming_the_missing_rank(
    results: list[dict[str, Any]], name: str
) -> None:
    error, seconds = results[0][name]
    assert error is not None, f"{name} on rank 0 alone returned"
    assert f"{name}() is a collective" in error, error
    assert re.search(r"Ranks? 1 failed", error), error  # gloo's monitored barrier names it
    assert seconds < CHECK_SECONDS + 20, seconds


def test_check_passes_when_every_rank_calls(results: list[dict[str, Any]]) -> None:
    assert all(r["all_ranks_ok"] for r in results)


def test_no_future_warning_from_our_own_calls(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["future_warnings"] == []


def test_structure_mismatch_names_the_tensors_before_pipelines(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        error = r["structure_error"]
        assert error is not None
        assert "'weight': (5, 4) torch.float32 on rank 0, (6, 4) torch.float32 on rank 1" in error
        assert "'bias'" in error
        assert error.index("'weight'") < error.index("pipeline")
        assert "One possible cause" in error


def test_no_collective_returns_while_the_backend_holds_its_tensors(
    results: list[dict[str, Any]],
) -> None:
    """Issue 35 (clean exits): each call returns only once gloo's worker thread has let go
    of the tensors it was given, so a process may exit right after (a Lightning ddp_spawn
    child after ``Trainer.fit``). Before, 1-12% of such calls returned early."""
    for rank, r in enumerate(results):
        assert r["held"] == dict.fromkeys(r["held"], 0), (rank, r["held"], HELD_ROUNDS)
        assert r["release_warnings"] == []
