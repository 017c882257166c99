"""Nothing lost (issue 40, items 2-4): a failed load changes no EMA, a load reads the bytes
it verified, and background saves keep every promise of a blocking one.

The scenario of the issue: state ``{"ema": e1, "ema2": e2, "model": model_sd}``, both EMAs
at 8 updates, checkpoint ``A`` saved at 3 (and ``B``, the same layout, at 8). One spawn at
W=2 runs every scenario (failures injected on rank 1 only, so rank 0 read everything and
still must not swap), then this process runs them again at W=1 with no process group, on
the checkpoints the spawn saved (each EMA tensor then comes from two chunks). One more spawn
at W=2 kills a rank during a background write.

* Failed loads: an ``OSError``, a short read and an exception of the storage layer injected
  at the 12th tensor read of the reader (``_Reader._item_stream``); a refused pickle at the
  last EMA entry; a corrupted entry under ``verify=False``; in the middle of the staged
  load, an entry whose checksum does not match and one the bounded reader refuses (float64
  data where ``.metadata`` says float32); a counter of ``10**400`` with the checksums
  rewritten to match; a ``Stateful`` beside the EMAs that fails on one rank;
  ``ModelEMA.load_state_dict`` and ``MultiModelEMA.load_state_dict`` with that counter; a
  ``MultiModelEMA`` whose load fails mid-read. Each time every EMA keeps its tensors, count,
  options and tracked set, and keeps updating exactly as twins that saw no failed load.
* Concurrent commits to the path (what a ``save_checkpoint`` commit does: the directory
  renamed away, the new one renamed in, the old one deleted), between the counter pass and
  the tensor pass, between the checksum pass and DCP's reads, and between two ranks' opens;
  and a data file rewritten in place between the passes. A load gives one save's data
  (counter and every row) or an error naming the concurrent save, never "corrupted".
* ``save_checkpoint(..., async_=True)``: returns a future while the write is held in flight;
  the path keeps the previous checkpoint until every rank finished; the EMA updates meanwhile
  and the checkpoint holds the EMA at the call, with one save id and checksums; a failed
  background write (on one rank) raises from every rank's future and leaves the previous
  checkpoint; a killed rank too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from crafted import read_metadata, replace_value, sidecars
from dist_harness import run_ranks, spawn_ranks
from models import error_text as _error
from models import mismatches
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from dtensor_ema import ModelEMA, MultiModelEMA, load_checkpoint, save_checkpoint
from dtensor_ema.checkpoint import checksums as checksums_module
from dtensor_ema.checkpoint import reader as reader_module

pytestmark = pytest.mark.distributed

STEPS_A, STEPS = 3, 8
STATE_KEYS = ("ema", "ema2")
FAIL_AT = 12  # the tensor read that fails


class StorageFault(Exception):
    """What a storage layer raises (not an OSError)."""


class Refused:
    """A pickle ``weights_only`` refuses."""


# ------------------------------------------------------------------------------- the run
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 6), nn.Linear(6, 5)
    )


def _perturb(model: nn.Module, step: int) -> None:
    """Step ``step`` of the trajectory: a seeded delta, the same at every W."""
    generator = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))


def _emas(model: nn.Module) -> dict[str, ModelEMA]:
    return {
        "ema": ModelEMA(model, decay=0.9, tau=2.0),
        "ema2": ModelEMA(model, decay=0.5, tau=None),
    }


def _multi(model: nn.Module) -> MultiModelEMA:
    return MultiModelEMA(model, {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": 0.8}})


class Run:
    """The model, the two EMAs, their twins (which never see a failed load) and a
    ``MultiModelEMA``, advanced along the trajectory."""

    def __init__(self) -> None:
        self.model = _model()
        self.emas = _emas(self.model)
        self.twins = _emas(self.model)
        self.multi = _multi(self.model)
        self.multi_twin = _multi(self.model)
        self.step = 0

    def advance(self, to: int) -> None:
        while self.step < to:
            self.step += 1
            _perturb(self.model, self.step)
            for ema in [*self.emas.values(), *self.twins.values()]:
                ema.update()
            self.multi.update()
            self.multi_twin.update()

    def state(self) -> dict[str, Any]:
        return {**self.emas, "model": self.model.state_dict()}

    def all_emas(self) -> dict[str, ModelEMA]:
        return {**self.emas, **{f"multi.{k}": v for k, v in self.multi.items()}}

    def against_twins(self) -> dict[str, Any]:
        """Each EMA against its twin, which never saw a failed load: the tensors that
        differ, and both counts."""
        twins = {**self.twins, **{f"multi.{k}": v for k, v in self.multi_twin.items()}}
        return {
            name: {
                "tensors": mismatches(
                    {k: _local(v) for k, v in ema.ema_tensors().items()},
                    {k: _local(v) for k, v in twins[name].ema_tensors().items()},
                ),
                "updates": (ema.updates, twins[name].updates),
            }
            for name, ema in self.all_emas().items()
        }


def _local(value: torch.Tensor) -> torch.Tensor:
    return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()


def _snapshot(ema: ModelEMA) -> dict[str, Any]:
    """Everything a failed load must leave as it was."""
    return {
        "tensors": {k: _local(v) for k, v in ema.ema_tensors().items()},
        "updates": ema.updates,
        "config": ema.engine.config(),
        "options": ema.options,
        "tracked": [e.fqn for e in ema.engine.plan],
        "untracked": list(ema.engine.plan.untracked),
    }


def _differences(before: dict[str, Any], ema: ModelEMA) -> list[str]:
    now = _snapshot(ema)
    bad = [f"tensor {k}" for k in mismatches(now["tensors"], before["tensors"])]
    bad += [k for k in ("updates", "config", "tracked", "untracked") if now[k] != before[k]]
    if now["options"] is not before["options"]:
        bad.append("options")
    return bad


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Any, when: bool = True) -> Iterator[None]:
    original = owner.__dict__.get(name)
    if when:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        if when:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _wait_for(flag: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{flag} never appeared")
        time.sleep(0.01)


# ------------------------------------------------------------------- checkpoints to load
def _craft(tmp: Path) -> None:
    """Copies of ``A`` that fail late (rank 0 writes them; every rank reads them)."""
    metadata = read_metadata(tmp / "A")
    last = sorted(k for k in metadata.state_dict_metadata if k.startswith("ema2.ema."))[-1]
    refused = Path(shutil.copytree(tmp / "A", tmp / "refused"))
    replace_value(refused, last, Refused())  # checksums rewritten to match
    counter = Path(shutil.copytree(tmp / "A", tmp / "counter"))
    replace_value(counter, "ema2.updates", 10**400)
    corrupted = Path(shutil.copytree(tmp / "A", tmp / "corrupted"))
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == last)
    with open(corrupted / info.relative_path, "r+b") as f:  # the entry's bytes, zeroed
        f.seek(info.offset)
        f.write(bytes(info.length))
    # The last EMA tensor's last chunk (the last rank reads it), found bad in the middle of
    # the staged load: a flipped byte (its checksum, in the tensor pass's planning) ...
    chunk = max(metadata.state_dict_metadata[last].chunks, key=lambda c: tuple(c.offsets))
    index = next(i for i in metadata.storage_data if i.fqn == last and i.offset == chunk.offsets)
    info = metadata.storage_data[index]
    mismatch = Path(shutil.copytree(tmp / "A", tmp / "mismatch"))
    with open(mismatch / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    # ... and float64 data where .metadata says float32 (checksums rewritten to match): the
    # bounded reader refuses it after every other item of that rank was read.
    retyped = Path(shutil.copytree(tmp / "A", tmp / "retyped"))
    wrong = torch.zeros(tuple(chunk.sizes), dtype=torch.float64)
    replace_value(retyped, last, wrong, at=tuple(chunk.offsets))


def _is_tensor(metadata: Any) -> set[int]:
    return {
        id(info)
        for index, info in (metadata.storage_data or {}).items()
        if isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata)
    }


def _failing_reads(kind: str, at: int) -> Callable[..., Any]:
    """The reader's ``_item_stream`` (where it reads one item from the storage) that fails
    the ``at``-th tensor read: ``oserror``, ``short`` (half the bytes) or ``storage`` (a
    storage layer's own exception)."""
    original = reader_module._Reader._item_stream
    count = [0]

    def slice_file(self: Any, file: Any, sinfo: Any) -> Any:
        stream = original(self, file, sinfo)
        if id(sinfo) not in _is_tensor(self._checkpoint.metadata):
            return stream
        count[0] += 1
        if count[0] != at:
            return stream
        if kind == "oserror":
            raise OSError(5, "injected I/O error")
        if kind == "storage":
            raise StorageFault("injected: the object store is unreachable")
        import io

        return io.BytesIO(stream.read(sinfo.length // 2))

    return slice_file


def _one_rank_stateful(rank: int) -> Any:
    class FailsOnOneRank:
        """A ``Stateful`` model entry whose ``load_state_dict`` fails on rank ``rank``."""

        def __init__(self, model: nn.Module) -> None:
            self.model = model

        def state_dict(self) -> dict[str, Any]:
            return self.model.state_dict()

        def load_state_dict(self, state: Any) -> None:
            if _rank() == rank:
                raise RuntimeError(f"injected: the model refused its state on rank {rank}")
            self.model.load_state_dict(state)

    return FailsOnOneRank


def _bad_state(ema: ModelEMA, updates: int) -> dict[str, Any]:
    """The EMA's own state with other tensors (this rank's pieces, plus one) and a count."""
    own = ema.state_dict()
    return {**own, "updates": updates, "ema": {k: v.detach() + 1 for k, v in own["ema"].items()}}


def failure_scenarios(tmp: Path) -> dict[str, Any]:
    """Each way a load can fail late, each on a fresh run at ``STEPS`` updates: what it
    raised, what changed, and whether the EMAs then update as their twins."""
    rank_to_fail = _world() - 1
    on_this_rank = _rank() == rank_to_fail
    out: dict[str, Any] = {}
    huge = 10**400
    stateful = _one_rank_stateful(rank_to_fail)

    def attempt(name: str, fn: Callable[[Run], object], reads: Any = None) -> None:
        run = Run()
        run.advance(STEPS)
        before = {k: _snapshot(v) for k, v in run.all_emas().items()}
        model_before = {k: v.clone() for k, v in run.model.state_dict().items()}
        with _patched(reader_module._Reader, "_item_stream", reads, when=on_this_rank and reads):
            error = _error(lambda: fn(run))
        out[name] = {
            "error": error,
            "changed": {k: _differences(before[k], v) for k, v in run.all_emas().items()},
            "model_changed": mismatches(run.model.state_dict(), model_before) != [],
            "keeps_updating": _error(lambda: run.advance(STEPS + 1)) or run.against_twins(),
        }

    for kind in ("oserror", "short", "storage"):
        reads = _failing_reads(kind, FAIL_AT)
        attempt(kind, lambda run: load_checkpoint(run.state(), tmp / "A"), reads)
    attempt("refused", lambda run: load_checkpoint(run.state(), tmp / "refused"))
    attempt("corrupted", lambda run: load_checkpoint(run.state(), tmp / "corrupted", verify=False))
    attempt("mismatch", lambda run: load_checkpoint(run.state(), tmp / "mismatch"))
    attempt("retyped", lambda run: load_checkpoint(run.state(), tmp / "retyped"))
    attempt("counter", lambda run: load_checkpoint(run.state(), tmp / "counter"))
    attempt(
        "stateful",
        lambda run: load_checkpoint({**run.emas, "model": stateful(run.model)}, tmp / "A"),
    )
    attempt(
        "multi",
        lambda run: load_checkpoint({"emas": run.multi}, tmp / "M"),
        _failing_reads("oserror", 6),
    )
    attempt(
        "load_state_dict",
        lambda run: run.emas["ema2"].load_state_dict(_bad_state(run.emas["ema2"], huge)),
    )
    attempt(
        "multi_load_state_dict",
        lambda run: run.multi.load_state_dict(
            {"fast": _bad_state(run.multi["fast"], 5), "slow": _bad_state(run.multi["slow"], huge)}
        ),
    )
    return out


# ------------------------------------------------------------------ concurrent commits
def _commit_over(path: Path, other: Path) -> None:
    """What ``save_checkpoint``'s commit does to ``path``: the old directory renamed away,
    the new one (``other``, a finished ``.partial``) renamed in, the old one deleted."""
    previous = path.with_name(path.name + ".previous")
    os.rename(path, previous)
    os.rename(other, path)
    shutil.rmtree(previous)


def _fresh_emas() -> dict[str, ModelEMA]:
    model = _model()
    _perturb(model, 77)  # other values than any save
    return _emas(model)


def _loaded(emas: dict[str, ModelEMA]) -> dict[str, Any]:
    return {
        k: {"updates": e.updates, "tensors": {n: _local(v) for n, v in e.ema_tensors().items()}}
        for k, e in emas.items()
    }


def _which_save(loaded: dict[str, Any], saves: dict[str, dict[str, Any]]) -> str:
    """``"A"`` or ``"B"`` when every counter and row is that save's; else ``"mixed"``."""
    for name, save in saves.items():
        if all(
            loaded[k]["updates"] == save[k]["updates"]
            and not mismatches(loaded[k]["tensors"], save[k]["tensors"])
            for k in STATE_KEYS
        ):
            return name
    return "mixed"


def _folder_with_a_and_b(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """``(folder, path, flag)``: a copy of ``A`` at ``path`` and of ``B`` as its finished
    ``.partial`` (rank 0 makes them; every rank waits)."""
    folder = tmp / name
    path = folder / "ckpt"
    if _rank() == 0:
        folder.mkdir()
        shutil.copytree(tmp / "A", path)
        shutil.copytree(tmp / "B", folder / "ckpt.partial")
    _barrier()
    return folder, path, folder / "committed"


def concurrent_scenarios(tmp: Path, saves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A load of ``path`` (a copy of ``A``) while ``B`` is committed over it, at several
    points; rank 0 commits, the others wait for it there. ``saves``: this rank's pieces
    of ``A`` and ``B`` (what a load at this W gives)."""
    rank, out = _rank(), {}

    def case(name: str, owner: Any, attr: str, make: Callable[..., Any], **kwargs: Any) -> None:
        folder, path, flag = _folder_with_a_and_b(tmp, f"concurrent-{name}")

        def commit() -> None:
            if rank == 0:
                _commit_over(path, folder / "ckpt.partial")
                flag.touch()
            else:
                _wait_for(flag)

        emas = _fresh_emas()
        before = {k: _snapshot(v) for k, v in emas.items()}
        with _patched(owner, attr, make(owner.__dict__[attr], commit)):
            error = _error(lambda: load_checkpoint(dict(emas), path, **kwargs))
        out[name] = {
            "error": error,
            "loaded": _which_save(_loaded(emas), saves) if error is None else None,
            "changed": {k: _differences(before[k], v) for k, v in emas.items()},
        }
        _barrier()

    def after_first_load(original: Any, commit: Callable[[], None]) -> Any:
        calls = [0]

        def load(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            calls[0] += 1
            if calls[0] == 1:  # the counter and options were read: the tensors are next
                commit()
            return result

        return load

    def before_tensor_reads(original: Any, commit: Callable[[], None]) -> Any:
        def read_data(self: Any, plan: Any, planner: Any) -> Any:
            if any(i.type.name != "BYTE_IO" for i in plan.items):  # verified; not read yet
                commit()
            return original(self, plan, planner)

        return read_data

    case("between_passes", reader_module.Checkpoint, "load", after_first_load)
    case("before_reads", reader_module._Reader, "read_data", before_tensor_reads)
    case(
        "before_reads_unverified",
        reader_module._Reader,
        "read_data",
        before_tensor_reads,
        verify=False,
    )
    if _world() > 1:
        out["ranks_open_different_saves"] = _different_opens(tmp, saves)
    out["rewritten_in_place"] = _rewritten_in_place(tmp)
    return out


def _different_opens(tmp: Path, saves: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 opens and checks ``A``; then ``B`` is committed; the other ranks open
    ``B``."""
    import dtensor_ema.checkpoint.save_load as checkpoint_module

    rank = _rank()
    folder, path, flag = _folder_with_a_and_b(tmp, "concurrent-opens")
    check_files = reader_module.Checkpoint.check_files
    open_checkpoint = checkpoint_module.open_checkpoint

    def checked_then_commit(self: Any) -> None:
        check_files(self)
        # After load_checkpoint's own check (open_checkpoint checks the files first): rank
        # 0 has read all it reads before the ranks compare which save they opened.
        if sys._getframe(1).f_code.co_name == "_load":
            _commit_over(path, folder / "ckpt.partial")
            flag.touch()

    def open_after_commit(where: Any) -> Any:
        _wait_for(flag)
        return open_checkpoint(where)

    emas = _fresh_emas()
    before = {k: _snapshot(v) for k, v in emas.items()}
    if rank == 0:
        patch = _patched(reader_module.Checkpoint, "check_files", checked_then_commit)
    else:
        patch = _patched(checkpoint_module, "open_checkpoint", open_after_commit)
    with patch:
        error = _error(lambda: load_checkpoint(dict(emas), path))
    _barrier()
    return {
        "error": error,
        "loaded": _which_save(_loaded(emas), saves) if error is None else None,
        "changed": {k: _differences(before[k], v) for k, v in emas.items()},
        "save_ids": [read_metadata(tmp / s).storage_meta.save_id for s in ("A", "B")],
    }


def _rewritten_in_place(tmp: Path) -> dict[str, Any]:
    """Between the counter pass and the tensor pass, rank 0 rewrites the first EMA tensor's
    bytes in ``__0_0.distcp`` in place (another writer in the same directory)."""
    rank = _rank()
    folder = tmp / "in-place"
    path, flag = folder / "ckpt", folder / "written"
    if rank == 0:
        folder.mkdir()
        shutil.copytree(tmp / "A", path)
    _barrier()
    metadata = read_metadata(path)
    info = min(
        (
            v
            for i, v in metadata.storage_data.items()
            if i.fqn.startswith("ema.ema.") and v.relative_path == "__0_0.distcp"
        ),
        key=lambda v: v.offset,
    )
    original = reader_module.Checkpoint.load
    calls = [0]

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 1:
            if rank == 0:
                time.sleep(0.02)  # past the clock tick of the save's write
                with open(path / info.relative_path, "r+b") as f:
                    f.seek(info.offset + info.length - 8)
                    f.write(b"\x7f" * 8)
                flag.touch()
            else:
                _wait_for(flag)
        return result

    emas = _fresh_emas()
    before = {k: _snapshot(v) for k, v in emas.items()}
    with _patched(reader_module.Checkpoint, "load", load):
        error = _error(lambda: load_checkpoint(dict(emas), path))
    _barrier()
    return {"error": error, "changed": {k: _differences(before[k], v) for k, v in emas.items()}}


# ------------------------------------------------------------------------ async saves
def async_scenarios(run: Run, tmp: Path) -> dict[str, Any]:
    """A background save held in flight (every rank's writer waits for a flag), with
    updates meanwhile; a blocking save right after one; a background write that fails on
    the last rank."""
    rank, out = _rank(), {}
    path = tmp / "async"
    release = tmp / "release"
    save_checkpoint(run.state(), path)  # the previous checkpoint
    previous_id = read_metadata(path).storage_meta.save_id
    at_call = {k: _snapshot(v) for k, v in run.emas.items()}
    original_write = checksums_module.RecordingWriter.write_data

    def held_write(self: Any, plan: Any, planner: Any) -> Any:
        _wait_for(release)
        return original_write(self, plan, planner)

    with _patched(checksums_module.RecordingWriter, "write_data", held_write):
        start = time.perf_counter()
        future = save_checkpoint(run.state(), path, async_=True)
        out["returned_s"] = time.perf_counter() - start
        out["future"] = type(future).__name__
        out["pending"] = not future.done()
        run.advance(run.step + 2)  # training goes on: the save holds the EMA at the call
        out["path_meanwhile"] = read_metadata(path).storage_meta.save_id == previous_id
        _barrier()
        if rank == 0:
            release.touch()
        out["result"] = future.result(timeout=120)
    _barrier()
    ids = {read_metadata(path).storage_meta.save_id} | {
        p.get("save_id") for p in sidecars(path).values()
    }
    out["one_save_id"] = len(ids) == 1 and previous_id not in ids
    out["sidecars"] = len(sidecars(path))
    fresh = _fresh_emas()
    load_checkpoint(dict(fresh), path, verify="require")
    out["saved_at_call"] = {k: _same_values(fresh[k], at_call[k]) for k in STATE_KEYS}

    # A blocking save right after a background one waits for it, then writes its own.
    future = save_checkpoint(run.state(), path, async_=True)
    run.advance(run.step + 1)
    latest = {k: _snapshot(v) for k, v in run.emas.items()}
    save_checkpoint(run.state(), path)
    out["after_blocking"] = future.done() and future.exception() is None
    fresh = _fresh_emas()
    load_checkpoint(dict(fresh), path)
    out["blocking_wins"] = all(_same_values(fresh[k], latest[k]) for k in STATE_KEYS)

    # A background write that fails on the last rank: every rank's future raises, the
    # previous checkpoint stays.
    kept = {k: _snapshot(v) for k, v in run.emas.items()}
    run.advance(run.step + 1)

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "injected: no space left on device")

    with _patched(
        checksums_module.RecordingWriter, "write_data", failing_write, when=rank == _world() - 1
    ):
        future = save_checkpoint(run.state(), path, async_=True)
        out["failed"] = _error(lambda: future.result(timeout=120))
    fresh = _fresh_emas()
    load_checkpoint(dict(fresh), path)
    out["previous_kept"] = all(_same_values(fresh[k], kept[k]) for k in STATE_KEYS)

    # Shards that are views into one flat buffer (which dcp.async_save cannot stage).
    bucket = ModelEMA(run.model, decay=0.5, tau=None, parameters_as_bucket_view=True)
    bucket.update()
    snapshot = _snapshot(bucket)
    future = save_checkpoint({"bucket": bucket}, tmp / "bucket", async_=True)
    _perturb(run.model, 99)
    bucket.update()
    future.result(timeout=120)
    fresh_bucket = ModelEMA(_model(), decay=0.5, tau=None)
    load_checkpoint({"bucket": fresh_bucket}, tmp / "bucket")
    out["bucket_view"] = _same_values(fresh_bucket, snapshot)
    return out


def _same_values(ema: ModelEMA, snapshot: dict[str, Any]) -> bool:
    """The EMA holds the snapshot's tensors (bit for bit) and count."""
    now = _snapshot(ema)
    return (
        not mismatches(now["tensors"], snapshot["tensors"])
        and now["updates"] == snapshot["updates"]
    )


# ------------------------------------------------------------------------- the bodies
def _saves(run: Run, tmp: Path) -> dict[str, Any]:
    """``A`` at 3 updates, ``M`` (a ``MultiModelEMA``) at 3, ``B`` at 8; each rank's pieces
    of ``A`` and ``B``, and the full tensors (for loads at another W)."""
    out: dict[str, Any] = {"pieces": {}, "full": {}}
    for name, steps in (("A", STEPS_A), ("B", STEPS)):
        run.advance(steps)
        save_checkpoint(run.state(), tmp / name)
        if name == "A":
            save_checkpoint({"emas": run.multi, "model": run.model.state_dict()}, tmp / "M")
        out["pieces"][name] = _loaded(run.emas)
        out["full"][name] = {
            k: {"updates": e.updates, "tensors": e.get_ema_state_dict()}
            for k, e in run.emas.items()
        }
    return out


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or what it raised (so that each test reports its own case)."""
    try:
        return fn()
    except Exception as e:
        return {"crashed": f"{type(e).__name__}: {e}"}


def _scenarios(folder: Path, pieces: dict[str, Any], async_folder: Path) -> dict[str, Any]:
    def run_async() -> dict[str, Any]:
        run = Run()
        run.advance(STEPS)
        return async_scenarios(run, async_folder)

    return {
        "failures": _guarded(lambda: failure_scenarios(folder)),
        "concurrent": _guarded(lambda: concurrent_scenarios(folder, pieces)),
        "async": _guarded(run_async),
    }


def body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    folder = Path(tmp)
    saved = _saves(Run(), folder)
    if rank == 0:
        _craft(folder)
    _barrier()
    return {"full": saved["full"], **_scenarios(folder, saved["pieces"], folder / "w2")}


def kill_body(rank: int, world_size: int, tmp: str) -> str:
    """Rank 1's background writer SIGKILLs its process after writing its data file."""
    path = Path(tmp) / "ckpt"
    run = Run()
    run.advance(2)
    save_checkpoint(run.state(), path)
    if rank == 0:
        torch.save({k: v.get_ema_state_dict() for k, v in run.emas.items()}, Path(tmp) / "kept.pt")
    else:
        for ema in run.emas.values():
            ema.get_ema_state_dict()
    run.advance(3)
    if rank == 1:
        original_write = checksums_module.RecordingWriter.write_data

        def dying_write(self: Any, plan: Any, planner: Any) -> Any:
            original_write(self, plan, planner)
            os.kill(os.getpid(), signal.SIGKILL)

        checksums_module.RecordingWriter.write_data = dying_write  # type: ignore[method-assign]
    future = save_checkpoint(run.state(), path, async_=True)
    outcome = _error(lambda: future.result(timeout=120)) or "saved"
    (Path(tmp) / f"outcome{rank}.json").write_text(json.dumps(outcome))
    return outcome


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nothing-lost")
    (tmp / "w2").mkdir()
    results = run_ranks(body, 2, tmp, str(tmp))
    full = {k: v["tensors"] for k, v in results[0]["full"]["A"].items()}
    torch.save(full, tmp / "full_a.pt")
    return tmp, results


@pytest.fixture(scope="module")
def w1(w2: tuple[Path, list[dict[str, Any]]]) -> dict[str, Any]:
    """The same scenarios in this process with no process group, on the spawn's files."""
    tmp, results = w2
    folder = tmp / "w1"
    folder.mkdir()
    for name in ("A", "B", "M", "refused", "counter", "corrupted", "mismatch", "retyped"):
        shutil.copytree(tmp / name, folder / name)
    full = results[0]["full"]
    saves = {
        s: {k: {"updates": v["updates"], "tensors": v["tensors"]} for k, v in full[s].items()}
        for s in ("A", "B")
    }
    (folder / "async").mkdir()
    return _scenarios(folder, saves, folder / "async")


def _each(w2: Any, w1: Any, part: str) -> list[tuple[str, Any]]:
    _, results = w2
    each = [(f"W=2 rank {r}", got[part]) for r, got in enumerate(results)] + [("W=1", w1[part])]
    for where, got in each:
        assert "crashed" not in got, (where, got["crashed"])
    return each


FAILURES = {
    "oserror": r"injected I/O error",
    "short": r"entry 'ema2?\.ema\.[^']+' .*is corrupted",
    "storage": r"the object store is unreachable",
    "refused": r"entry 'ema2\.ema\.[^']+' .*is not a tensor or plain value",
    "corrupted": r"ema2\.ema\.",
    "mismatch": r"'ema2\.ema\.[^']+' \(chunk at offsets [^)]+\)\) does not match the checksum",
    "retyped": r"entry 'ema2\.ema\.[^']+' .*holds torch\.float64 data, but \.metadata says "
    r"torch\.float32: refused",
    "counter": r"checkpoint 'updates' must fit an int64 \(at most 2\*\*63 - 1\), got an int of "
    r"1329 bits",
    "stateful": r"injected: the model refused its state on rank \d",
    "multi": r"injected I/O error",
    "load_state_dict": r"checkpoint 'updates' must fit an int64",
    "multi_load_state_dict": r"EMA 'slow': checkpoint 'updates' must fit an int64",
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failed_load_changes_no_ema(w2: Any, w1: Any, case: str) -> None:
    for where, got in _each(w2, w1, "failures"):
        outcome = got[case]
        assert outcome["error"] is not None, (where, case)
        assert re.search(FAILURES[case], outcome["error"]), (where, outcome["error"])
        assert outcome["changed"] == {k: [] for k in outcome["changed"]}, (where, outcome)
    if case == "counter":  # refused before anything is written: the model too
        assert not any(got["counter"]["model_changed"] for _, got in _each(w2, w1, "failures"))


@pytest.mark.parametrize("case", list(FAILURES))
def test_every_ema_keeps_updating_after_a_failed_load(w2: Any, w1: Any, case: str) -> None:
    for where, got in _each(w2, w1, "failures"):
        after = got[case]["keeps_updating"]
        assert isinstance(after, dict), (where, after)  # not the error of update()
        for name, outcome in after.items():
            assert outcome == {"tensors": [], "updates": (STEPS + 1, STEPS + 1)}, (where, name)


CONCURRENT = ["between_passes", "before_reads", "before_reads_unverified"]


@pytest.mark.parametrize("case", CONCURRENT)
def test_a_concurrent_commit_gives_one_save_or_names_it(w2: Any, w1: Any, case: str) -> None:
    for where, got in _each(w2, w1, "concurrent"):
        outcome = got[case]
        if outcome["error"] is None:
            assert outcome["loaded"] == "A", (where, outcome)  # the files it verified
        else:
            assert "CheckpointChangedError" in outcome["error"], (where, outcome["error"])
            assert "corrupted" not in outcome["error"], (where, outcome["error"])
            assert outcome["changed"] == {k: [] for k in STATE_KEYS}, (where, outcome)
    # Verified loads hold every file they verified: they read the save they began with.
    assert all(got[case]["loaded"] == "A" for _, got in _each(w2, w1, "concurrent")) or (
        case == "before_reads_unverified"
    )


def test_ranks_that_open_different_saves_all_raise_naming_both(w2: Any) -> None:
    _, results = w2
    for rank, got in enumerate(results):
        assert "crashed" not in got["concurrent"], got["concurrent"]
        outcome = got["concurrent"]["ranks_open_different_saves"]
        error = outcome["error"]
        assert error is not None and error.startswith("CheckpointChangedError"), (rank, error)
        assert "changed while the ranks opened it" in error, (rank, error)
        for save_id in outcome["save_ids"]:
            assert save_id in error, (rank, error)
        assert outcome["changed"] == {k: [] for k in STATE_KEYS}, (rank, outcome)
    assert len({got["concurrent"]["ranks_open_different_saves"]["error"] for got in results}) == 1


def test_a_file_changed_between_the_passes_is_reported_as_changed(w2: Any, w1: Any) -> None:
    for where, got in _each(w2, w1, "concurrent"):
        outcome = got["rewritten_in_place"]
        error = outcome["error"]
        assert error is not None and error.startswith("CheckpointChangedError"), (where, error)
        assert "__0_0.distcp was modified" in error and "corrupted" not in error, (where, error)
        assert outcome["changed"] == {k: [] for k in STATE_KEYS}, (where, outcome)


def test_background_saves_keep_every_promise(w2: Any, w1: Any) -> None:
    for where, got in _each(w2, w1, "async"):
        assert got["future"] == "Future" and got["pending"], (where, got)
        assert got["path_meanwhile"], where  # nothing committed while a rank still wrote
        assert got["result"] is None, where
        assert got["one_save_id"] and got["sidecars"] == (2 if where.startswith("W=2") else 1)
        assert got["saved_at_call"] == dict.fromkeys(STATE_KEYS, True), (where, got)
        assert got["after_blocking"] and got["blocking_wins"], (where, got)
        assert got["failed"] is not None and "no space left on device" in got["failed"], where
        assert got["previous_kept"], where
        assert got["bucket_view"], where


def test_a_rank_killed_during_a_background_write_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    _, failures = spawn_ranks(kill_body, 2, tmp_path, str(tmp_path))
    assert any("rank 1: exited with code -9" in f for f in failures), failures
    outcome = json.loads((tmp_path / "outcome0.json").read_text())
    assert outcome != "saved"  # rank 0's future saw its peer die and did not commit
    assert not (tmp_path / "outcome1.json").exists()  # rank 1 really died mid-write
    assert (tmp_path / "ckpt.partial").is_dir()
    kept = torch.load(tmp_path / "kept.pt", weights_only=True)
    fresh = _fresh_emas()
    load_checkpoint(dict(fresh), tmp_path / "ckpt", verify="require")
    for name, ema in fresh.items():
        assert ema.updates == 2
        assert mismatches({k: _local(v) for k, v in ema.ema_tensors().items()}, kept[name]) == []


def _loads_a(tmp: Path) -> bool:
    """Fresh EMAs load ``A`` whole: its counters and every row."""
    emas = _fresh_emas()
    load_checkpoint(dict(emas), tmp / "A")
    saves = {"A": {k: {"updates": STEPS_A, "tensors": v} for k, v in _full_a(tmp).items()}}
    return _which_save(_loaded(emas), saves) == "A"


def _full_a(tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    return torch.load(tmp / "full_a.pt", weights_only=True)


def test_files_beyond_the_held_limit_are_opened_again_and_checked(
    w2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that reads more files than it may hold open reopens them, and a file replaced
    meanwhile is reported as changed (one process, the W=2 checkpoint: two data files)."""
    from dtensor_ema.checkpoint import files as checkpoint_files

    tmp, _ = w2
    monkeypatch.setattr(checkpoint_files, "HELD_FILES", 1)
    assert _loads_a(tmp)

    copy = Path(shutil.copytree(tmp / "A", tmp / "replaced"))
    checkpoint = reader_module.open_checkpoint(copy)
    try:
        files = checkpoint.opened()
        with files.opened("__0_0.distcp") as f:
            first = f.read(16)
        with files.opened("__1_0.distcp"):  # the first one is closed: one held at most
            pass
        shutil.copy(copy / "__0_0.distcp", copy / "new")
        os.replace(copy / "new", copy / "__0_0.distcp")  # same bytes, another file
        with pytest.raises(reader_module.CheckpointChangedError, match="is another file now"):
            files.opened("__0_0.distcp").__enter__()
    finally:
        checkpoint.close()
    assert first

    # Beyond the directories it may hold open, a load opens files by path, and a save
    # committed over that path meanwhile is seen.
    monkeypatch.setattr(checkpoint_files, "HELD_DIRECTORIES", 0)
    assert _loads_a(tmp)
    path = Path(shutil.copytree(tmp / "A", tmp / "by-path"))
    checkpoint = reader_module.open_checkpoint(path)
    try:
        _commit_over(path, Path(shutil.copytree(tmp / "B", tmp / "by-path.partial")))
        with pytest.raises(reader_module.CheckpointChangedError, match="another directory now"):
            checkpoint.opened().opened("__1_0.distcp").__enter__()
    finally:
        checkpoint.close()
