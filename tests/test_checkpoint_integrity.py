"""Checkpoints that detect corruption (issues 19, 27), crafted ones refused on every rank,
and exports that refuse bad paths; a load is one save's data or an error (issue 35).

``save_checkpoint`` records a CRC-32 per byte range it writes (and of ``.metadata``);
``load_checkpoint`` verifies, before anything changes, every saved item its load reads,
also when it reshards: saved at W=3, loaded at W=2 (one spawn each) and in this process with
no process group. A byte flipped inside a tensor's data in a ``.distcp`` file loaded
silently before; so did one in a non-tensor value or in ``.metadata``. At W=2 every rank
raises the same error naming the rank that saw it (``agree`` gathers the messages), and a
crafted ``.metadata`` runs no code on any rank.

Issue 35, at W=2 and in one process: a save is one unit (one save id in ``.metadata`` and
every checksum file; a rank's files copied in from another save are refused); ranks given
different paths raise before anything is written or read; chunks that leave rows uncovered,
data files outside the folder and values that are pickles of other objects are refused on
every rank, naming what is wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from crafted import (
    REFUSED,
    RunsCode,
    craft,
    drop_chunk,
    read_metadata,
    redirect,
    replace_value,
    sidecars,
)
from dist_harness import run_ranks
from models import mismatches
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh

from dtensor_ema import ModelEMA, convert_checkpoint, export_ema
from dtensor_ema._collectives import MESSAGE_BYTES, agree, mesh_agree
from dtensor_ema.checkpoint import checksums
from dtensor_ema.checkpoint.reader import ChecksumError, UnverifiedCheckpointWarning
from dtensor_ema.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint

CORRUPTED = "0.weight"  # the tensor whose first saved chunk gets a flipped byte


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 10), nn.ReLU(), nn.Linear(10, 3))  # 10 rows: 4, 4, 2


def _trained(model: nn.Module) -> ModelEMA:
    ema = ModelEMA(model, decay=0.5, tau=None)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    ema.update()
    return ema


def _local(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).clone()
        for k, v in ema.ema_tensors().items()
    }


def _flip_inside(directory: Path, fqn: str, values: torch.Tensor) -> str:
    """Flip one byte inside the raw data of the saved chunk of ``fqn`` at offsets 0 (whose
    values are ``values``); returns the data file's name."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    key = f"ema.ema.{fqn}"
    index = next(i for i in (metadata.storage_data or {}) if i.fqn == key and not any(i.offset))
    info = metadata.storage_data[index]
    path = directory / info.relative_path
    data = bytearray(path.read_bytes())
    raw = values.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw, info.offset, info.offset + info.length)
    assert at >= 0, "the chunk's raw bytes were not found in its data file"
    data[at + 5] ^= 0x10
    path.write_bytes(bytes(data))
    return info.relative_path


def _save_ids(directory: Path) -> dict[str, Any]:
    """The save id ``.metadata`` records, and each checksum file's."""
    return {
        ".metadata": read_metadata(directory).storage_meta.save_id,
        **{f.name: payload.get("save_id") for f, payload in sidecars(directory).items()},
    }


def save_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """W=3: save, then make a corrupted copy (rank 0 flips a byte in its own chunk); one
    more update and a second save of the same layout (``other``)."""
    model = _model()
    ema = _trained(model)
    good, bad, other = Path(tmp) / "good", Path(tmp) / "bad", Path(tmp) / "other"
    save_checkpoint({"ema": ema}, good)
    full = ema.get_ema_state_dict()
    out: dict[str, Any] = {"full": full, "sidecars": sorted(p.name for p in good.glob("*.json"))}
    if rank == 0:
        shutil.copytree(good, bad)
        out["file"] = _flip_inside(bad, CORRUPTED, _local(ema)[CORRUPTED])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    save_checkpoint({"ema": ema}, other)
    out["other_full"] = ema.get_ema_state_dict()
    dist.barrier()
    out["save_ids"] = {"good": _save_ids(good), "other": _save_ids(other)}
    return out


class _NotOurs(Exception):
    """An exception type ``agree`` cannot name on other ranks: they raise RuntimeError."""


def _raised(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def load_body(rank: int, world_size: int, tmp: str, full: dict[str, Any]) -> dict[str, Any]:
    """W=2: a verified resharding load; the corrupted and the crafted copies refused on every
    rank with the same message, nothing written, nothing run; ``verify=False`` and plain
    ``dcp.load`` still load the corrupted one; ``agree`` with different errors per rank."""
    good, bad, crafted = Path(tmp) / "good", Path(tmp) / "bad", Path(tmp) / "crafted"
    model = _model()
    out: dict[str, Any] = {}
    ema = ModelEMA(model, decay=0.5, tau=None)
    load_checkpoint({"ema": ema}, good)
    out["good_mismatch"] = mismatches(ema.get_ema_state_dict(), full)
    fresh = ModelEMA(model, decay=0.5, tau=None)
    before = _local(fresh)
    out["bad_error"] = _raised(lambda: load_checkpoint({"ema": fresh}, bad))
    out["crafted_error"] = _raised(lambda: load_checkpoint({"ema": fresh}, crafted))
    out["bad_untouched"] = mismatches(_local(fresh), before) == [] and fresh.updates == 0
    load_checkpoint({"ema": fresh}, bad, verify=False)
    out["unverified_updates"] = fresh.updates
    plain = ModelEMA(model, decay=0.5, tau=None)
    dcp.load({"ema": plain}, checkpoint_id=str(good))
    out["dcp_mismatch"] = mismatches(plain.get_ema_state_dict(), full)
    world = dist.group.WORLD
    out["agree_distinct"] = _raised(
        lambda: agree(
            world,
            FileNotFoundError("no file here") if rank == 0 else ValueError("bad value there"),
            "a test step",
        )
    )
    out["agree_unknown_type"] = _raised(
        lambda: agree(world, _NotOurs("mine") if rank == 1 else None, "another step")
    )
    out["agree_long"] = _raised(
        lambda: agree(world, ValueError("x" * 5000) if rank == 0 else None, "a long one")
    )
    out["agree_none"] = _raised(lambda: agree(world, None, "a step that worked"))
    mesh_2d = init_device_mesh("cpu", (2, 1))  # two dims: the flags and rows reduce per dim
    out["mesh_agree_distinct"] = _raised(
        lambda: mesh_agree(
            mesh_2d,
            FileNotFoundError("no file here") if rank == 0 else ValueError("bad value there"),
            "a mesh step",
        )
    )
    out["mesh_agree_one"] = _raised(
        lambda: mesh_agree(mesh_2d, KeyError("k") if rank == 1 else None, "one rank")
    )
    out["mesh_agree_none"] = _raised(lambda: mesh_agree(mesh_2d, None, "worked"))
    alone = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pair", "alone"))["alone"]
    out["mesh_agree_alone"] = _raised(  # a one-rank mesh: the rank's own error, as agree
        lambda: mesh_agree(alone, _NotOurs("mine") if rank == 1 else None, "by itself")
    )
    out.update(one_save_scenarios(rank, Path(tmp), model))
    return out


def one_save_scenarios(rank: int, tmp: Path, model: nn.Module) -> dict[str, Any]:
    """Issue 35 at W=2: crafted copies of the W=3 checkpoint refused on every rank with the
    EMA untouched; ranks given different paths refused before anything is written or
    read; the same directory spelled differently per rank is one path."""
    out: dict[str, Any] = {}
    for name in CRAFTED_W2:
        fresh = ModelEMA(model, decay=0.5, tau=None)
        before = _local(fresh)
        out[name] = _raised(lambda: load_checkpoint({"ema": fresh}, tmp / name))  # noqa: B023
        out[f"{name}_untouched"] = mismatches(_local(fresh), before) == [] and fresh.updates == 0
    ema = _trained(_model())
    mine = tmp / f"per-rank-{rank}"
    out["save_paths"] = _raised(lambda: save_checkpoint({"ema": ema}, mine))
    dist.barrier()
    out["save_paths_wrote"] = sorted(p.name for p in tmp.iterdir() if "per-rank" in p.name)
    fresh = ModelEMA(model, decay=0.5, tau=None)
    before = _local(fresh)
    theirs = tmp / ("good" if rank == 0 else "other")
    out["load_paths"] = _raised(lambda: load_checkpoint({"ema": fresh}, theirs))
    out["load_paths_untouched"] = mismatches(_local(fresh), before) == [] and fresh.updates == 0
    # One directory, spelled relative on rank 0 and absolute on rank 1: the same path.
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        spelled = Path("good") if rank == 0 else tmp / "good"
        load_checkpoint({"ema": fresh}, spelled)
        save_checkpoint({"ema": ema}, Path("spelled") if rank == 0 else tmp / "spelled")
    finally:
        os.chdir(cwd)
    out["spelled_updates"] = fresh.updates
    out["spelled_saved"] = sorted(p.name for p in (tmp / "spelled").iterdir())
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("integrity")
    return tmp, run_ranks(save_body, 3, tmp, str(tmp))


@pytest.mark.distributed
def test_save_writes_one_checksum_file_per_rank(saved: Any) -> None:
    _, results = saved
    for r in results:
        assert r["sidecars"] == [f"__{i}.checksums.json" for i in range(3)]


def _copy(tmp: Path, name: str) -> Path:
    shutil.copytree(tmp / "good", tmp / name)
    return tmp / name


CRAFTED_W2 = ("mixed", "uncovered", "outside", "value")
"""Copies of the W=3 checkpoint ``good`` (built by :func:`_craft_one_save_cases`), each
refused at W=2 and in one process."""


def _craft_one_save_cases(tmp: Path, marker: Path) -> None:
    """``mixed``: rank 1's data and checksum file from the save ``other`` (same layout);
    ``uncovered``: rows 4-7 of ``0.weight`` (rank 1's chunk) in no chunk; ``outside``:
    ``0.weight``'s items read from ``../other/``; ``value``: the saved options a pickle
    that runs code. Checksum files rewritten to match, as whoever crafts them would."""
    mixed = _copy(tmp, "mixed")
    for name in ("__1_0.distcp", "__1.checksums.json"):
        shutil.copy(tmp / "other" / name, mixed / name)
    drop_chunk(_copy(tmp, "uncovered"), f"ema.ema.{CORRUPTED}", (4, 0))
    redirect(_copy(tmp, "outside"), f"ema.ema.{CORRUPTED}", lambda f: f"../other/{f}")
    replace_value(_copy(tmp, "value"), "ema.config", RunsCode(marker))
    # Save ids deleted from the checksum files (a text edit): the checkpoint alone; mixed
    # with a file without one, or with one of another save; and (issue 42) rank 1's files
    # of another save with every id deleted.
    legacy = _copy(tmp, "legacy")
    stripped_mixed = Path(shutil.copytree(mixed, tmp / "stripped-mixed"))
    for directory in (legacy, stripped_mixed):
        for f, payload in sidecars(directory).items():
            payload.pop("save_id", None)
            f.write_text(json.dumps(payload))
    legacy_mixed = Path(shutil.copytree(legacy, tmp / "legacy-mixed"))
    mixed_legacy = _copy(tmp, "mixed-legacy")
    for target, source in ((legacy_mixed, tmp / "other"), (mixed_legacy, legacy)):
        for file in ("__1_0.distcp", "__1.checksums.json"):
            shutil.copy(source / file, target / file)


@pytest.fixture(scope="module")
def loaded_w2(saved: Any) -> tuple[Path, list[dict[str, Any]]]:
    """One W=2 spawn: the loads of ``load_body``, with crafted copies of the checkpoint."""
    tmp, results = saved
    marker = tmp / "ran"
    craft(tmp / "good", tmp / "crafted", marker, "inside")
    _craft_one_save_cases(tmp, marker)
    return marker, run_ranks(load_body, 2, tmp, str(tmp), results[0]["full"])


@pytest.mark.distributed
def test_corruption_is_detected_when_resharding_to_two_ranks(saved: Any, loaded_w2: Any) -> None:
    _, results = saved
    file = results[0]["file"]
    marker, loaded = loaded_w2
    # Rank 0 reads the corrupted chunk (rows 0-4 of 0.weight), rank 1 does not: both raise
    # rank 0's error, with the same message naming rank 0.
    errors = [r["bad_error"] for r in loaded]
    assert errors[0] == errors[1] and errors[0] is not None, errors
    kind, message = errors[0]
    assert kind == "ChecksumError", errors
    assert message.startswith("verifying the checksums of ") and "failed on rank 0: " in message
    assert file in message and CORRUPTED in message and "corrupted" in message, message
    crafted = [r["crafted_error"] for r in loaded]
    assert (
        crafted[0] == crafted[1] and crafted[0] is not None and crafted[0][0] == "CheckpointError"
    )
    assert "failed on ranks [0, 1]: CheckpointError: " in crafted[0][1], crafted
    assert REFUSED in crafted[0][1] and "crafted/.metadata" in crafted[0][1], crafted
    assert not marker.exists()
    for r in loaded:
        assert r["good_mismatch"] == [] and r["dcp_mismatch"] == []
        assert r["bad_untouched"]
        assert r["unverified_updates"] == 1  # verify=False loads it anyway


@pytest.mark.distributed
def test_a_save_has_one_id_in_metadata_and_every_checksum_file(saved: Any) -> None:
    """All ranks of a save agree on one id when it starts (issue 35): ``.metadata`` and the
    three checksum files of each save record it, and two saves have two ids."""
    _, results = saved
    ids = results[0]["save_ids"]
    for name in ("good", "other"):
        assert set(ids[name]) == {".metadata", *(f"__{r}.checksums.json" for r in range(3))}
        assert len(set(ids[name].values())) == 1 and ids[name][".metadata"], ids
    assert ids["good"][".metadata"] != ids["other"][".metadata"]
    assert all(r["save_ids"] == ids for r in results)


def _one_save_errors(tmp: Path) -> dict[str, tuple[str, str]]:
    """``{crafted copy: (exception type, pattern of the message every reader raises)}``."""
    where = re.escape(str(tmp))
    return {
        "mixed": (
            "ChecksumError",
            rf"{where}/mixed/__1\.checksums\.json: belongs to another save \(save id "
            r"'[0-9a-f-]+', while \.metadata was written by save '[0-9a-f-]+'\): files of "
            r"different saves were mixed$",
        ),
        "uncovered": (
            "CheckpointError",
            rf"{where}/uncovered/\.metadata: the saved chunks of tensor 'ema\.ema\.0\.weight' "
            r"\(shape \(10, 7\)\) do not cover it exactly once: rows 4-7 are not covered; "
            r"refused before anything was read$",
        ),
        "outside": (
            "CheckpointError",
            rf"{where}/outside/\.metadata \(entry 'ema\.ema\.0\.weight'\) names "
            r"'\.\./other/__\d_0\.distcp', which is not a plain file name inside .*outside "
            r"\(no separator, no '\.\.', not absolute\): refused before any file was opened$",
        ),
        "value": (
            "CheckpointError",
            rf"{where}/value/__\d_0\.distcp: entry 'ema\.config' is not a tensor or plain "
            r"value: its pickle refers to other objects; refused \(nothing in it was run\)$",
        ),
        # Issue 42: no compatibility path for checksum files without save ids. Stripping
        # the ids (a text edit) used to let rank 1's files of another save load.
        **{
            name: (
                "ChecksumError",
                rf"{where}/{name}/__\d\.checksums\.json: records no save id: refused",
            )
            for name in ("legacy", "legacy-mixed", "mixed-legacy", "stripped-mixed")
        },
    }


@pytest.mark.distributed
def test_crafted_copies_are_refused_on_every_rank(saved: Any, loaded_w2: Any) -> None:
    """Issue 35 at W=2: a rank's files from another save, chunks that leave rows 4-7 of a
    tensor uncovered, data files read from outside the folder, and a value whose pickle runs
    code are refused on every rank with the same message, the EMA untouched."""
    tmp, _ = saved
    marker, loaded = loaded_w2
    steps = {
        "mixed": "verifying the checksums of",
        "uncovered": "checking the checkpoint at",
        "outside": "checking the checkpoint at",
        "value": "loading",
    }
    for name, (kind, pattern) in _one_save_errors(tmp).items():
        if name not in CRAFTED_W2:
            continue
        errors = [r[name] for r in loaded]
        assert errors[0] == errors[1] and errors[0] is not None, (name, errors)
        assert errors[0][0] == kind, (name, errors)
        head, sep, message = errors[0][1].partition(" failed on ranks [0, 1]: ")
        assert sep and head == f"{steps[name]} {tmp / name}", (name, errors)
        assert message.startswith(f"{kind}: ")
        assert re.search(pattern, message.removeprefix(f"{kind}: ")), (name, message)
        assert "weights_only" not in message and "Traceback" not in message, message
        assert all(r[f"{name}_untouched"] for r in loaded), name
    assert not marker.exists()


@pytest.mark.distributed
def test_crafted_copies_are_refused_in_one_process(saved: Any, loaded_w2: Any) -> None:
    """The same copies, and checksum files without save ids, with no process group:
    ``load_checkpoint`` and ``convert_checkpoint`` refuse the mixed and crafted ones, and
    every one without ids (no file written); ``verify=False`` still loads a checkpoint
    whose ids were stripped."""
    tmp, results = saved
    marker, _ = loaded_w2
    for name, (kind, pattern) in _one_save_errors(tmp).items():
        fresh = ModelEMA(_model(), decay=0.5, tau=None)
        before = _local(fresh)
        for reader in (
            lambda: load_checkpoint({"ema": fresh}, tmp / name),  # noqa: B023
            lambda: convert_checkpoint(tmp / name, tmp / f"{name}.pt"),  # noqa: B023
        ):
            error = _raised(reader)
            assert error is not None and error[0] == kind, (name, error)
            assert re.search(pattern, error[1]), (name, error)
        assert mismatches(_local(fresh), before) == [] and fresh.updates == 0
        assert not (tmp / f"{name}.pt").exists()
    assert not marker.exists()
    ema = ModelEMA(_model(), decay=0.5, tau=None)
    load_checkpoint({"ema": ema}, tmp / "legacy", verify=False)
    assert mismatches(ema.get_ema_state_dict(), results[0]["full"]) == []
    converted = convert_checkpoint(tmp / "legacy", tmp / "legacy.pt", verify=False)
    assert mismatches(converted, results[0]["full"]) == []


@pytest.mark.distributed
def test_ranks_given_different_paths_raise_before_writing_or_reading(loaded_w2: Any) -> None:
    """Issue 35 at W=2: ``save_checkpoint`` to a per-rank folder and ``load_checkpoint`` of
    ``good`` on rank 0 and ``other`` on rank 1 raise on every rank, naming both paths;
    nothing is written (no folder, no ``.partial``) and the EMA is untouched. One folder
    spelled differently per rank (relative, absolute) is one path."""
    _, loaded = loaded_w2
    for r in loaded:
        kind, message = r["save_paths"]
        assert kind == "ValueError", r["save_paths"]
        assert re.search(
            r"^save_checkpoint\(\) was given different paths on different ranks \(1 of 2 "
            r"ranks differ from rank 0\): rank 0: /.*/per-rank-0; rank 1: /.*/per-rank-1\. "
            r"Every rank must pass the same checkpoint path .*nothing was written or read$",
            message,
        ), message
        assert r["save_paths_wrote"] == []
        kind, message = r["load_paths"]
        assert kind == "ValueError" and re.search(
            r"^load_checkpoint\(\) was given different paths .*rank 0: /.*/good; rank 1: "
            r"/.*/other\. ",
            message,
        ), r["load_paths"]
        assert r["load_paths_untouched"]
        assert r["spelled_updates"] == 1
        assert r["spelled_saved"] == [
            ".metadata",
            "__0.checksums.json",
            "__0_0.distcp",
            "__1.checksums.json",
            "__1_0.distcp",
        ]
    assert loaded[0]["save_paths"] == loaded[1]["save_paths"]
    assert loaded[0]["load_paths"] == loaded[1]["load_paths"]


@pytest.mark.distributed
def test_every_rank_raises_every_failing_ranks_message(loaded_w2: Any) -> None:
    """``agree`` (and ``mesh_agree`` on a 2-D mesh) gathers the failing ranks' messages (a
    fixed-size byte tensor, no pickling): every rank raises the same text, of the first
    failing rank's type when that type is a builtin or ours."""
    for r in loaded_w2[1]:
        assert r["agree_distinct"] == (
            "FileNotFoundError",
            "a test step failed on ranks [0, 1]: rank 0: FileNotFoundError: no file here; "
            "rank 1: ValueError: bad value there",
        )
        assert r["agree_unknown_type"] == (
            "RuntimeError",
            "another step failed on rank 1: _NotOurs: mine",
        )
        kind, message = r["agree_long"]
        assert kind == "ValueError" and message.startswith("a long one failed on rank 0: Val")
        assert message.endswith("x...") and len(message) < MESSAGE_BYTES + 40
        assert r["agree_none"] is None
        assert r["mesh_agree_distinct"] == (
            "FileNotFoundError",
            "a mesh step failed on ranks [0, 1]: rank 0: FileNotFoundError: no file here; "
            "rank 1: ValueError: bad value there",
        )
        assert r["mesh_agree_one"] == ("KeyError", "\"one rank failed on rank 1: KeyError: 'k'\"")
        assert r["mesh_agree_none"] is None
    assert [r["mesh_agree_alone"] for r in loaded_w2[1]] == [None, ("_NotOurs", "mine")]


@pytest.mark.distributed
def test_corruption_is_detected_in_one_process(saved: Any) -> None:
    tmp, results = saved
    ema = ModelEMA(_model(), decay=0.5, tau=None)
    load_checkpoint({"ema": ema}, tmp / "good")
    assert mismatches(ema.get_ema_state_dict(), results[0]["full"]) == []
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    before = _local(fresh)
    with pytest.raises(CheckpointError, match=rf"{results[0]['file']}.*{CORRUPTED}.*corrupted"):
        load_checkpoint({"ema": fresh}, tmp / "bad")
    assert mismatches(_local(fresh), before) == [] and fresh.updates == 0


def _reveals_no_digest(message: str, directory: Path, fqn: str) -> None:
    """A checksum error names no digest computed over the bytes it read (issue 35): over a
    few bytes a CRC-32 can be inverted, so messages would leak what the files hold."""
    metadata = read_metadata(directory)
    info = metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == fqn)]
    raw = (directory / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    crc = zlib.crc32(raw)
    assert "0x" not in message and str(crc) not in message and f"{crc:x}" not in message
    assert "does not match" in message and fqn in message and info.relative_path in message


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


ALGORITHM_SETS = {
    "crc32": ["crc32"],  # without the optional xxhash package
    "crc32+xxh3_64": ["crc32", "xxh3_64"],
}


@pytest.mark.parametrize("algorithms", list(ALGORITHM_SETS))
def test_single_process_checksums_and_older_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithms: str
) -> None:
    """Flips in tensor data, in a value and in ``.metadata`` are refused, with CRC-32 alone
    (no ``xxhash``) and with XXH3-64 too; each reader checks the fastest digest it has."""
    names = ALGORITHM_SETS[algorithms]
    if "xxh3_64" in names:
        pytest.importorskip("xxhash")
    monkeypatch.setattr(checksums, "ALGORITHMS", {n: checksums.ALGORITHMS[n] for n in names})
    ema = _trained(_model())
    save_checkpoint({"ema": ema}, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.json")) == ["__0.checksums.json"]
    sidecar = json.loads((tmp_path / "ckpt" / "__0.checksums.json").read_text())
    assert sidecar["algorithms"] == names and sorted(sidecar["metadata"]) == sorted(names)
    for copy in ("clean", "value", "metadata", "torn-metadata"):
        shutil.copytree(tmp_path / "ckpt", tmp_path / copy)
    _flip_inside(tmp_path / "ckpt", CORRUPTED, _local(ema)[CORRUPTED])
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    used = names[-1]  # the fastest recorded one
    with pytest.raises(
        CheckpointError,
        match=rf"__0_0\.distcp: '.*0\.weight' \(chunk at offsets \(0, 0\)\) does not match "
        rf"the checksum \({used}\) recorded when it was saved: the file is corrupted$",
    ) as info:
        load_checkpoint({"ema": fresh}, tmp_path / "ckpt")
    _reveals_no_digest(str(info.value), tmp_path / "ckpt", f"ema.ema.{CORRUPTED}")
    # A flipped byte in a non-tensor value (the saved options) ...
    metadata = FileSystemReader(str(tmp_path / "value")).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == "ema.config")
    info = metadata.storage_data[index]
    _flip_byte(tmp_path / "value" / info.relative_path, info.offset + info.length // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: 'ema\.config'.*corrupted"):
        load_checkpoint({"ema": fresh}, tmp_path / "value")
    # ... and in .metadata itself (a tensor's name: still a valid pickle, a wrong checkpoint)
    raw = (tmp_path / "metadata" / ".metadata").read_bytes()
    _flip_byte(tmp_path / "metadata" / ".metadata", raw.index(b"ema.ema.2.weight") + 8)
    with pytest.raises(
        CheckpointError, match=rf"\.metadata: does not match the checksum \({used}\) .* corrupted"
    ) as info:
        load_checkpoint({"ema": fresh}, tmp_path / "metadata")
    assert "0x" not in str(info.value)
    # A torn .metadata is reported as corrupted where its checksum was recorded (issue 42),
    # as unreadable where none was.
    (tmp_path / "torn-metadata" / ".metadata").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ChecksumError, match=r"\.metadata: does not match the checksum .*corrupted"):
        load_checkpoint({"ema": fresh}, tmp_path / "torn-metadata")
    for f in (tmp_path / "torn-metadata").glob("*.json"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: not a readable DCP \.metadata"):
        load_checkpoint({"ema": fresh}, tmp_path / "torn-metadata")
    assert fresh.updates == 0
    if len(names) > 1:
        # A reader without xxhash checks the CRC-32 recorded beside it.
        monkeypatch.setattr(checksums, "ALGORITHMS", {"crc32": checksums.ALGORITHMS["crc32"]})
        with pytest.raises(CheckpointError, match=r"0\.weight.* does not match .*\(crc32\)"):
            load_checkpoint({"ema": fresh}, tmp_path / "ckpt")
        load_checkpoint({"ema": fresh}, tmp_path / "clean")
        assert fresh.updates == 1 and mismatches(_local(fresh), _local(ema)) == []
    # A checkpoint without checksum files (plain dcp.save) loads unverified, with a warning
    # (issue 35); verify="require" refuses it.
    dcp.save({"ema": ema}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"has no checksum files .*verify='require'"):
        load_checkpoint({"ema": fresh}, tmp_path / "plain", verify="require")
    with pytest.warns(UnverifiedCheckpointWarning, match="nothing was verified"):
        load_checkpoint({"ema": fresh}, tmp_path / "plain")
    assert mismatches(_local(fresh), _local(ema)) == []
    # checksums=False writes none.
    save_checkpoint({"ema": ema}, tmp_path / "unchecked", checksums=False)
    assert not list((tmp_path / "unchecked").glob("*.json"))


def test_export_refuses_unknown_suffixes_and_missing_directories(tmp_path: Path) -> None:
    ema = _trained(_model())
    with pytest.raises(ValueError, match=r"unknown suffix '\.bin'"):
        export_ema(ema, tmp_path / "ema.bin")
    assert not (tmp_path / "ema.bin").exists()
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        export_ema(ema, tmp_path / "missing" / "ema.pt")
    assert not (tmp_path / "missing").exists()
    export_ema(ema, tmp_path / "ema.pth")
    assert set(torch.load(tmp_path / "ema.pth", weights_only=True)) == set(_model().state_dict())
