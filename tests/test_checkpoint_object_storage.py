"""Checkpoints in an object store: every promise of the local path, against a real endpoint.

The store is moto's S3 server, started here on 127.0.0.1 (a free port) with a thin layer in
front that counts requests and misbehaves when asked (``tests/object_store.py``); the
library talks to it through ``s3fs``/``botocore`` exactly as for AWS (``AWS_ENDPOINT_URL``
and dummy credentials in the environment); nothing in the library is patched.

Spawns: W=2 (saves; a background save while the EMA keeps updating; a failure planted at
each step of a save's commit), W=3 (resharded loads), and W=2 once more, killed mid-save.
The rest runs in this process with no process group: the one-process load, the refused
paths, a stalled and a failing endpoint, a load racing a commit, tampered objects.

The model is ``tests/models.py``'s ``EdgeModel`` (a 0-dim parameter, empty shards, odd
sizes) on a seeded trajectory; the reference is ``models.ReferenceEMA`` (plain ``lerp_`` on
full tensors), compared bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import require_extra, run_ranks, spawn_ranks
from models import ReferenceEMA, make_model, mismatches, perturb_trainable_
from models import error_text as _error
from torch.distributed.tensor import DTensor

require_extra("s3fs", "test")
require_extra("moto", "test")

from object_store import Fault, LocalS3, clear, plant, serving_bucket  # noqa: E402

from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint  # noqa: E402

pytestmark = pytest.mark.distributed

BUCKET = "ckpts"
DECAY, TAU = 0.9, 2.0
K = 3  # updates before the first save
DEADLINE_S = 240.0
# The client's timeouts for the stalled and failing endpoints, set as a user sets them:
# botocore's through fsspec's configuration, and s3fs's own retries (a class attribute, 5 by
# default, around botocore's) (docs/checkpoints.md).
FAST_FAILING = {
    "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}
}
FAIL_WITHIN_S = 20.0
"""A stalled request fails after 3 attempts of ``read_timeout`` with the settings above
(measured 2.9 s): room for a busy machine."""

# One planted failure per step of a save: (step, request pattern, what the ranks raise).
STEPS = {
    "prepare": (r"^GET /ckpts/w2/ckpt/current\.json", r"preparing to save s3://ckpts/w2/ckpt"),
    "data": (
        r"^PUT /ckpts/w2/ckpt/save-[^/]+/__1_0\.distcp",
        r"saving s3://ckpts/w2/ckpt failed, the checkpoint there is unchanged: rank 1: ",
    ),
    "metadata": (
        r"^PUT /ckpts/w2/ckpt/save-[^/]+/\.metadata\.tmp",
        r"saving s3://ckpts/w2/ckpt failed, the checkpoint there is unchanged: rank 0: ",
    ),
    "checksums": (
        r"^PUT /ckpts/w2/ckpt/save-[^/]+/__1\.checksums\.json",
        r"writing the checksums of s3://ckpts/w2/ckpt/save-[^ ]+ failed on rank 1",
    ),
    "pointer": (
        r"^PUT /ckpts/w2/ckpt/current\.json",
        r"committing s3://ckpts/w2/ckpt/save-[^ ]+ to s3://ckpts/w2/ckpt failed on rank 0",
    ),
}


class Run:
    """A model (the same on every rank), its EMA (sharded over the default group, if any)
    and the reference EMA, moved along one seeded trajectory."""

    def __init__(self, seed: int = 0) -> None:
        self.model = make_model("edge", seed)
        self.ema = ModelEMA(self.model, decay=DECAY, tau=TAU)
        self.ref = ReferenceEMA(self.model.state_dict(), DECAY, TAU)
        self.step = 0

    def advance(self, n: int) -> None:
        for _ in range(n):
            self.step += 1
            with torch.no_grad():
                perturb_trainable_(self.model, self.step)
            self.ema.update()
            self.ref.update(self.model.state_dict())

    def expected(self) -> dict[str, Any]:
        return {"updates": self.step, "tensors": {k: v.clone() for k, v in self.ref.ema.items()}}


def full(ema: ModelEMA) -> dict[str, torch.Tensor]:
    """The EMA's tensors, gathered by torch's own ``full_tensor`` (collective)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in ema.ema_tensors().items()
    }


def loaded_from(url: str, expected: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Load ``url`` into a fresh EMA of other weights: the error, or how it differs from
    ``expected`` (an empty list: bit for bit), and whether a refused load left it as it was."""
    fresh = Run(seed=1).ema
    before = full(fresh)
    error = _error(lambda: load_checkpoint({"ema": fresh}, url, **kwargs))
    got = full(fresh)
    if error is not None:
        return {"error": error, "unchanged": mismatches(got, before) == [] and fresh.updates == 0}
    want = {k: expected["tensors"][k] for k in got}
    return {"error": None, "differ": mismatches(got, want), "updates": fresh.updates}


def saves(url: str) -> list[str]:
    """The save prefixes under ``url``, and whether ``current.json`` is there."""
    import fsspec

    fs = fsspec.filesystem("s3")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, refresh=True))
    return [n if n == "current.json" else n[:5] for n in names]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------ W=2
def w2_body(rank: int, world: int, endpoint: str, tmp: str) -> dict[str, Any]:
    url, out = f"s3://{BUCKET}/w2/ckpt", {}
    run = Run()
    run.advance(K)
    save_checkpoint({"ema": run.ema}, url)
    good = run.expected()
    out["first"] = {"saves": saves(url), "loaded": loaded_from(url, good)}
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)  # the one it replaces is deleted
    good = run.expected()
    out["second"] = {"saves": saves(url), "loaded": loaded_from(url, good)}

    # A background save while the EMA keeps updating: rank 0's data upload is held by the
    # store until the updates are done, so the write really runs meanwhile.
    async_url = f"s3://{BUCKET}/w2/async"
    if rank == 0:
        plant(endpoint, pattern=r"^PUT /ckpts/w2/async/save-[^/]+/__0_0", action="hold")
    _barrier()
    at_call = run.expected()
    future = save_checkpoint({"ema": run.ema}, async_url, async_=True)
    run.advance(2)
    pending = not future.done()
    _barrier()
    if rank == 0:
        clear(endpoint)
    future.result()
    out["async"] = {"pending": pending, "loaded": loaded_from(async_url, at_call)}

    # A failure planted at each step: every rank raises one line; the last good checkpoint
    # still loads; what the failed save left is there until the next save deletes it.
    for step, (pattern, _) in STEPS.items():
        run.advance(1)
        if rank == 0:
            plant(endpoint, pattern=pattern)
        _barrier()
        error = _error(lambda: save_checkpoint({"ema": run.ema}, url))
        if rank == 0:
            clear(endpoint)
        _barrier()
        out[step] = {"error": error, "saves": saves(url), "loaded": loaded_from(url, good)}
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)  # deletes what the failed saves left
    out["cleaned"] = saves(url)
    # The commit succeeds but deleting the save it replaced fails (the store refuses rank
    # 0's second bulk delete: the first removes .metadata.tmp): a warning, the new save
    # loads, and the next save deletes the old one.
    run.advance(1)
    if rank == 0:
        plant(endpoint, pattern=r"^POST /ckpts\?delete", skip=1)
    _barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _error(lambda: save_checkpoint({"ema": run.ema}, url))
    if rank == 0:
        clear(endpoint)
    _barrier()
    good = run.expected()
    out["cleanup"] = {
        "error": error,
        "warned": [str(w.message) for w in caught
                   if "deleting the save it replaced failed" in str(w.message)],
        "saves": saves(url),
        "loaded": loaded_from(url, good),
    }  # fmt: skip
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)
    good = run.expected()
    out["final"] = {"saves": saves(url), "loaded": loaded_from(url, good)}
    if rank == 0:
        torch.save({"final": good, "async": at_call}, Path(tmp) / "w2_expected.pt")
    return out


def w3_body(rank: int, world: int, endpoint: str, tmp: str) -> dict[str, Any]:
    expected = torch.load(Path(tmp) / "w2_expected.pt", weights_only=True)
    return {
        "final": loaded_from(f"s3://{BUCKET}/w2/ckpt", expected["final"]),
        "async": loaded_from(f"s3://{BUCKET}/w2/async", expected["async"]),
    }


def kill_body(rank: int, world: int, endpoint: str, tmp: str) -> str:
    """Save once; then both ranks are SIGKILLed by the store when rank 1 uploads its checksum
    file of the second save: after every data file and ``.metadata``, before the commit."""
    url = f"s3://{BUCKET}/killed/ckpt"
    run = Run()
    run.advance(K)
    save_checkpoint({"ema": run.ema}, url)
    if rank == 0:
        torch.save(run.expected(), Path(tmp) / "kept.pt")
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    run.advance(1)
    if rank == 0:
        plant(endpoint, pattern=r"^PUT /ckpts/killed/ckpt/save-[^/]+/__1\.checksums",
              action="kill", pids=pids)  # fmt: skip
    _barrier()
    save_checkpoint({"ema": run.ema}, url)
    (Path(tmp) / f"survived{rank}").touch()
    return "survived"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def store() -> Any:
    with serving_bucket(BUCKET) as s3:
        yield s3


@pytest.fixture(scope="module")
def w2(store: LocalS3, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    tmp = tmp_path_factory.mktemp("objects")
    args = (store.endpoint, str(tmp))
    return tmp, run_ranks(w2_body, 2, tmp, *args, env=store.env, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def w3(store: LocalS3, w2: tuple[Path, list[Any]]) -> list[Any]:
    tmp, _ = w2
    args = (store.endpoint, str(tmp))
    return run_ranks(w3_body, 3, tmp, *args, env=store.env, deadline_s=DEADLINE_S)


def _bit_exact(loaded: dict[str, Any], updates: int | None = None) -> None:
    assert loaded["error"] is None, loaded["error"]
    assert loaded["differ"] == [], loaded["differ"]
    if updates is not None:
        assert loaded["updates"] == updates


# ------------------------------------------------------------------------- multi-rank
def test_w2_saves_load_at_w2_w3_and_in_one_process(
    store: LocalS3, w2: tuple[Path, list[Any]], w3: list[Any]
) -> None:
    """A save is one prefix plus ``current.json``; the save it replaces is deleted; W=2,
    W=3 and one process load it bit for bit, with its update count."""
    tmp, results = w2
    for out in results:
        assert out["first"]["saves"] == ["current.json", "save-"]
        assert out["second"]["saves"] == ["current.json", "save-"]
        _bit_exact(out["first"]["loaded"], K)
        _bit_exact(out["second"]["loaded"], K + 1)
        assert out["cleaned"] == ["current.json", "save-"]  # every leftover deleted
        assert out["final"]["saves"] == ["current.json", "save-"]
        _bit_exact(out["final"]["loaded"])
    expected = torch.load(tmp / "w2_expected.pt", weights_only=True)
    for out in w3:
        _bit_exact(out["final"], expected["final"]["updates"])
        _bit_exact(out["async"], expected["async"]["updates"])
    alone = loaded_from(f"s3://{BUCKET}/w2/ckpt", expected["final"])
    _bit_exact(alone, expected["final"]["updates"])


def test_a_background_save_holds_the_ema_at_the_call(w2: tuple[Path, list[Any]]) -> None:
    _, results = w2
    for out in results:
        assert out["async"]["pending"]  # the upload was still held after two updates
        _bit_exact(out["async"]["loaded"], K + 1)


@pytest.mark.parametrize("step", list(STEPS))
def test_a_failure_at_each_step_keeps_the_last_checkpoint(
    w2: tuple[Path, list[Any]], step: str
) -> None:
    """Every rank raises one line naming the step; the last committed save loads; what
    the failed save left stays until the next save (``final``: one save left)."""
    _, results = w2
    pattern = STEPS[step][1]
    for out in results:
        got = out[step]
        assert got["error"] is not None and "\n" not in got["error"], got["error"]
        assert re.search(pattern, got["error"]), (step, got["error"])
        _bit_exact(got["loaded"], K + 1)
        leftover = (
            ["current.json", "save-"] if step == "prepare" else ["current.json"] + ["save-"] * 2
        )
        assert got["saves"] == leftover, (step, got["saves"])


def test_a_commit_whose_cleanup_fails_is_a_saved_checkpoint(w2: tuple[Path, list[Any]]) -> None:
    _, results = w2
    for rank, out in enumerate(results):
        got = out["cleanup"]
        assert got["error"] is None, got["error"]
        assert bool(got["warned"]) == (rank == 0), got["warned"]
        assert got["saves"] == ["current.json", "save-", "save-"]  # the old one is left
        _bit_exact(got["loaded"])


def test_ranks_killed_mid_save_keep_the_previous_checkpoint(store: LocalS3, tmp_path: Path) -> None:
    try:
        _, failures = spawn_ranks(kill_body, 2, tmp_path, store.endpoint, str(tmp_path),
                                  env=store.env, deadline_s=DEADLINE_S)  # fmt: skip
    finally:
        store.clear()
    assert sorted(f.split(":")[0] for f in failures) == ["rank 0", "rank 1"], failures
    assert all("exited with code -9" in f for f in failures), failures
    assert not list(tmp_path.glob("survived*"))
    url = f"s3://{BUCKET}/killed/ckpt"
    assert saves(url) == ["current.json", "save-", "save-"]  # the second one never committed
    kept = torch.load(tmp_path / "kept.pt", weights_only=True)
    _bit_exact(loaded_from(url, kept), K)
    run = Run()
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)  # deletes what the killed save left
    assert saves(url) == ["current.json", "save-"]


# ---------------------------------------------------------------------- one process
def test_a_url_is_never_written_as_a_local_folder(
    store: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before object storage, ``save_checkpoint(..., "s3://bucket/ckpt")`` wrote the local
    folder ``./s3:/bucket/ckpt``. Now it goes to the store; a path that only looks like a
    URL, or a protocol with no implementation installed, is refused in one line naming
    what to do, and nothing is written locally."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    run = Run()
    run.advance(1)
    save_checkpoint({"ema": run.ema}, f"s3://{BUCKET}/plain/ckpt")
    assert list(tmp_path.iterdir()) == []
    assert saves(f"s3://{BUCKET}/plain/ckpt") == ["current.json", "save-"]
    fsspec.register_implementation(
        "nopkgproto", "dtensor_ema_no_such_package.FS", clobber=True,
        errtxt="Install dtensor-ema-no-such-package to access nopkgproto",
    )  # fmt: skip
    for path, match in (
        (f"s3:/{BUCKET}/x", r"looks like a URL with one slash .* pass the URL as a string"),
        (Path(f"s3://{BUCKET}/x"), r"'s3:/ckpts/x' looks like a URL with one slash"),
        ("nopkgproto://b/x", r"Install dtensor-ema-no-such-package to access nopkgproto"),
        ("weka://b/x", r"Protocol not known: weka: install the fsspec implementation"),
    ):
        for call in (save_checkpoint, load_checkpoint):
            error = _error(lambda: call({"ema": run.ema}, path))  # noqa: B023
            assert error is not None and "\n" not in error, error
            assert re.search(match, error), (path, error)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("endpoint", ["stalled", "failing"])
def test_a_stalled_or_failing_endpoint_gives_one_error_in_bounded_time(
    store: LocalS3, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the client's timeouts set through fsspec (``FAST_FAILING``), a store that holds
    every request (or answers 503 to each) makes a save and a load raise one line within
    ``FAIL_WITHIN_S``; nothing hangs."""
    import fsspec

    url = f"s3://{BUCKET}/{endpoint}/ckpt"
    run = Run()
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)
    import s3fs

    # A new client with these settings (copied: botocore rewrites its retries dict in place).
    monkeypatch.setitem(fsspec.config.conf, "s3", copy.deepcopy(FAST_FAILING))
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    action = {"action": "hold", "seconds": 30.0} if endpoint == "stalled" else {"status": 503}
    for call in (save_checkpoint, load_checkpoint):
        store.plant(Fault(pattern=".", times=10**6, **action))
        start = time.monotonic()
        try:
            error = _error(lambda: call({"ema": run.ema}, url))  # noqa: B023
        finally:
            store.clear()
        took = time.monotonic() - start
        assert error is not None and "\n" not in error, error
        assert took < FAIL_WITHIN_S, (call.__name__, took, error)
        assert url in error, error
    assert run.ema.updates == 1


def test_a_load_racing_a_commit_never_mixes_two_saves(store: LocalS3) -> None:
    """A load reads ``current.json`` (save A) and lists it; the store holds its read of
    A's ``.metadata`` while another save commits B (and deletes A): the load raises
    ``CheckpointChangedError``, with the EMA unchanged; loaded again, it reads B whole."""
    from dtensor_ema.checkpoint import CheckpointChangedError

    url = f"s3://{BUCKET}/race/ckpt"
    run = Run()
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)
    fresh = Run(seed=1).ema
    before = full(fresh)
    store.plant(Fault(pattern=r"^GET /ckpts/race/ckpt/save-[^/]+/"
                                                 r"\.metadata", action="hold"))  # fmt: skip
    caught: list[BaseException] = []

    def load() -> None:
        try:
            load_checkpoint({"ema": fresh}, url)
        except BaseException as e:
            caught.append(e)

    reader = threading.Thread(target=load)
    reader.start()
    assert store.held.wait(30)
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)  # commits B, deletes A
    store.clear()
    reader.join(60)
    assert len(caught) == 1 and isinstance(caught[0], CheckpointChangedError), caught
    assert "was deleted after this load first saw it" in str(caught[0])
    assert mismatches(full(fresh), before) == [] and fresh.updates == 0
    _bit_exact(loaded_from(url, run.expected()), 2)


def test_a_load_reads_objects_by_byte_range(store: LocalS3) -> None:
    """Every read of an object asks for a byte range (``current.json`` within its bound, the
    data items, their archives' tails): never a whole-object download."""
    url = f"s3://{BUCKET}/ranges/ckpt"
    run = Run()
    run.advance(1)
    save_checkpoint({"ema": run.ema}, url)
    before = len(store.requests)
    _bit_exact(loaded_from(url, run.expected()), 1)
    reads = [r for r in store.requests[before:] if r.startswith("GET") and "list-type" not in r]
    assert any(".distcp" in r for r in reads) and any("current.json" in r for r in reads)
    assert all(r.endswith(" range") for r in reads), reads


def _tampered(name: str, tamper: Any) -> str:
    """A fresh one-process save at ``tamper/<name>``, then ``tamper(fs, save prefix)``."""
    import fsspec

    url = f"s3://{BUCKET}/tamper/{name}"
    run = Run()
    run.advance(2)
    save_checkpoint({"ema": run.ema}, url)
    fs = fsspec.filesystem("s3")
    current = json.loads(fs.cat_file(f"{url}/current.json"))["save_id"]
    tamper(fs, f"{url}/save-{current}")
    return url


class _Sneaky:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this ran",))


def test_objects_are_read_and_checked_as_local_files(store: LocalS3) -> None:
    """Sizes, ``.metadata``'s globals, checksums and save ids are checked on objects as on
    files; each refused load names the object and leaves the EMA unchanged."""

    def corrupt(fs: Any, prefix: str) -> None:
        data = bytearray(fs.cat_file(f"{prefix}/__0_0.distcp"))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(f"{prefix}/__0_0.distcp", bytes(data))

    def truncate(fs: Any, prefix: str) -> None:
        fs.pipe_file(f"{prefix}/__0_0.distcp", fs.cat_file(f"{prefix}/__0_0.distcp")[:-100])

    def crafted(fs: Any, prefix: str) -> None:
        fs.pipe_file(f"{prefix}/.metadata", pickle.dumps(_Sneaky()))

    other = _tampered("other", lambda fs, prefix: None)
    other_prefix = (
        f"{other}/save-"
        + json.loads(__import__("fsspec").filesystem("s3").cat_file(f"{other}/current.json"))[
            "save_id"
        ]
    )

    def foreign_metadata(fs: Any, prefix: str) -> None:
        fs.pipe_file(f"{prefix}/.metadata", fs.cat_file(f"{other_prefix}/.metadata"))

    def foreign_checksums(fs: Any, prefix: str) -> None:
        fs.pipe_file(f"{prefix}/__0.checksums.json",
                     fs.cat_file(f"{other_prefix}/__0.checksums.json"))  # fmt: skip

    def bad_pointer(fs: Any, prefix: str) -> None:
        fs.pipe_file(f"{prefix.rsplit('/', 1)[0]}/current.json", b'{"save_id": "../x"}')

    cases = {
        "corrupted": (corrupt, {}, r"ChecksumError: .*__0_0\.distcp: .* does not match"),
        "truncated": (truncate, {"verify": False}, r"incomplete: truncated data files"),
        "crafted": (crafted, {}, r"refers to the global builtins\.print, .* refused"),
        "foreign_metadata": (foreign_metadata, {"verify": False},
                             r"\.metadata: written by save .* holds save"),
        "foreign_checksums": (foreign_checksums, {}, r"belongs to another save"),
        "bad_pointer": (bad_pointer, {}, r"current\.json: not a pointer dtensor_ema writes"),
    }  # fmt: skip
    for name, (tamper, kwargs, match) in cases.items():
        url = _tampered(name, tamper)
        with io.StringIO() as printed, contextlib.redirect_stdout(printed):
            got = loaded_from(url, {}, **kwargs)
            assert "this ran" not in printed.getvalue()
        assert got["error"] is not None and got["unchanged"], (name, got)
        assert re.search(match, got["error"]), (name, got["error"])
        assert url in got["error"] or name == "bad_pointer", (name, got["error"])
