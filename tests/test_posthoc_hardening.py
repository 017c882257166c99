"""Post-hoc snapshots someone else wrote, or that changed on disk, in one process (issue 35):
every malformed or altered manifest, every DCP data that does not hold what its manifest
names, and every snapshot folder that leads outside the directory being read is refused
with one line naming the file, by the API and by the CLI (exit code 2), before any tensor
is read, and no ``torch.empty`` buffer reaches the caller. The crafted folders are built
here (``crafted_snapshots``) from a clean run. The same refusals at W=1 and W=2 are in
``test_posthoc_distributed.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crafted_snapshots import (
    copy_run,
    drop_last_chunk,
    edit_manifest,
    files_opened,
    foreign_data,
    link_outside,
    reseal,
    shrink_chunk,
    write_text,
)
from models import make_model
from torch import nn

from dtensor_ema import PostHocEMA, merge_snapshots, synthesize
from dtensor_ema.checkpoint.reader import CheckpointError
from dtensor_ema.posthoc.cli import main as cli_main

SIGMAS = (0.05, 0.10)
LAST = "step-000000000012"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def perturb_(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.is_floating_point():
                v.add_(torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype) * 0.1)
            else:
                v.add_(1)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Snapshots at steps 4, 8, 12 of the edge model; one of another model; the clean
    synthesis (read by plain ``dcp.load`` of whole snapshots, here)."""
    root = tmp_path_factory.mktemp("clean")
    ph = PostHocEMA(make_model("edge"), SIGMAS, snapshot_every=4, snapshot_dir=root / "snaps")
    for step in range(1, 13):
        perturb_(ph.emas.model, step)
        ph.update()
    other = PostHocEMA(nn.Linear(3, 2), SIGMAS, snapshot_dir=root / "other")
    for _ in range(12):
        other.update()
    return {"snaps": root / "snaps", "other": other.snapshot(), "root": root}


def _manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


# ------------------------------------------------------------------ manifests
def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.__setitem__(field, value)


def _replace(folder: Path, old: str, new: str) -> Path:
    text = (folder / "manifest.json").read_text()
    assert old in text
    return write_text(folder, text.replace(old, new))


def _first_tensor(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda m: change(m["tensors"]["odd"])


MALFORMED: dict[str, tuple[Callable[[Path], Path], str]] = {
    # name -> (crafter of step-12's manifest, what the one line must say)
    "invalid JSON": (lambda f: write_text(f, '{"format": '), "not a valid JSON manifest"),
    "a list": (lambda f: write_text(f, "[1, 2]"), "expected a JSON object, got a list"),
    "no profiles": (
        lambda f: edit_manifest(f, lambda m: m.pop("profiles")),
        r"missing fields \['profiles'\]",
    ),
    "no model_keys": (
        lambda f: edit_manifest(f, lambda m: m.pop("model_keys")),
        r"missing fields \['model_keys'\]",
    ),
    "profiles a string": (
        lambda f: edit_manifest(f, _set("profiles", "p0")),
        "'profiles' must be a non-empty list, got a string",
    ),
    "t a string": (
        lambda f: edit_manifest(f, _set("t", "12")),
        r"'t' must be an int in \[1, 2\*\*63\), got '12'",
    ),
    "unknown dtype": (
        lambda f: edit_manifest(f, _first_tensor(lambda s: s.__setitem__("dtype", "torch.nope"))),
        r"tensors\['odd'\]\['dtype'\] is not a torch dtype: 'torch.nope'",
    ),
    "negative shape": (
        lambda f: edit_manifest(f, _first_tensor(lambda s: s.__setitem__("shape", [-13, 7]))),
        r"tensors\['odd'\]\['shape'\] must be a list of ints >= 0",
    ),
    "profile key naming another entry": (
        lambda f: edit_manifest(f, lambda m: m["profiles"][1].__setitem__("key", "followed")),
        r"profiles\[1\]\['key'\] must be 'p1'",
    ),
    "unknown field": (
        lambda f: edit_manifest(f, _set("written_by", "someone")),
        r"unknown fields \['written_by'\]",
    ),
    "another format": (
        lambda f: edit_manifest(f, _set("format", "dtensor_ema.posthoc/2")),
        "format 'dtensor_ema.posthoc/2', expected 'dtensor_ema.posthoc/3'",
    ),
    "duplicate keys": (
        lambda f: _replace(f, '"t": 12', '"t": 12, "t": 4'),
        r"duplicate keys \['t'\]",
    ),
    "NaN": (
        lambda f: _replace(f, '"t": 12', '"t": NaN'),
        "NaN is not a number",
    ),
    # altered values that still parse: the checksum catches them
    "altered t": (
        lambda f: edit_manifest(f, _set("t", 13), sealed=False),
        "its checksum does not match its content",
    ),
    "altered gamma": (
        lambda f: edit_manifest(
            f,
            lambda m: m["profiles"][1].__setitem__("gamma", m["profiles"][1]["gamma"] * 1.01),
            sealed=False,
        ),
        "its checksum does not match its content",
    ),
    "another step's manifest": (
        lambda f: write_text(f, (f.parent / "step-000000000004" / "manifest.json").read_text()),
        "'step' is 4 but the folder is step-000000000012",
    ),
}


def test_clean_manifests_carry_the_checksum_of_their_content(clean: dict[str, Any]) -> None:
    for folder in sorted(clean["snaps"].glob("step-*")):
        manifest = _manifest(folder)
        assert manifest["checksum"] == reseal(manifest)["checksum"]
        assert manifest["format"] == "dtensor_ema.posthoc/3"
        assert (manifest["track"], manifest["untracked"]) == ("all", [])


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_is_one_line_naming_the_file(
    clean: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    craft, what = MALFORMED[case]
    run = copy_run(clean["snaps"], tmp_path / "run")
    file = craft(run / LAST)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=what) as info:
        synthesize(run, 0.08, out=out)
    assert str(info.value).startswith(f"{file}: "), str(info.value)
    assert type(info.value).__name__ == "SnapshotError"
    assert not out.exists()
    for command in (["synthesize", str(run), "--sigma-rel", "0.08"], ["list", str(run)]):
        assert cli_main([*command, "--no-progress"] if command[0] != "list" else command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {file}: ") and err.count("\n") == 1, err
        assert "Traceback" not in err


# ------------------------------------------------------------------ DCP data vs manifest
DATA: dict[str, tuple[Callable[[Path, Path], Any], str]] = {
    "another run's data": (  # its .metadata names another save than the manifest (issue 42)
        lambda f, other: foreign_data(f, other),
        r"written by save '[0-9a-f-]+', but the snapshot's manifest names save '[0-9a-f-]+': "
        r"the folder holds another snapshot's \(or run's\) data",
    ),
    "a followed entry the data lacks": (
        lambda f, _: edit_manifest(
            f,
            lambda m: (
                m["followed"].__setitem__("count", m["followed"].pop("int_buf")),
                m["model_keys"].append("count"),
            ),
        ),
        r"its data has no entry 'followed\.count'",
    ),
    "another dtype in the data": (  # in every manifest, so that they agree with each other
        lambda f, _: [
            edit_manifest(g, _first_tensor(lambda s: s.__setitem__("dtype", "torch.bfloat16")))
            for g in f.parent.glob("step-*")
        ],
        r"entry 'p0\.odd' is \(13, 7\) torch.float32 in its data but \(13, 7\) torch.bfloat16",
    ),
    "rows 8-12 in no chunk": (
        lambda f, _: shrink_chunk(f, "p0.odd", 8),
        r"'p0\.odd'.* rows 8-12",
    ),
    "no chunk at all": (
        lambda f, _: drop_last_chunk(f, "p1.conv.weight"),
        r"'p1\.conv\.weight'.* rows 0-4",
    ),
    "overlapping chunks": (
        lambda f, _: drop_last_chunk(f, "p0.vec", duplicate=True),
        r"'p0\.vec'.*(overlap|covered more than once)",
    ),
}


# (Coverage: synthesize checks the entries it reads; ``reader.open_checkpoint`` may refuse
# a gap or overlap in any tensor first, naming ``.metadata``: either message passes.)
@pytest.mark.parametrize("case", list(DATA))
def test_data_that_does_not_match_its_manifest_is_refused_before_reading(
    clean: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """The issue's ``-1.3e+25``: ``synthesize`` used to load into ``torch.empty`` buffers
    with ``partial=True``, so an entry the data lacks, or rows no chunk holds, stayed
    uninitialized and the call returned them."""
    craft, what = DATA[case]
    run = copy_run(clean["snaps"], tmp_path / "run")
    craft(run / LAST, clean["other"])
    with pytest.raises(CheckpointError, match=what) as info:
        synthesize(run, 0.08)
    assert re.match(rf"{re.escape(str(run / LAST))}(/\.metadata)?: ", str(info.value))
    key = re.search(r"'p(\d)", what)
    with pytest.raises(CheckpointError, match=what):  # the profile the case broke
        merge_snapshots(run, last=1, sigma_rel=SIGMAS[int(key.group(1)) if key else 0])
    assert cli_main(["synthesize", str(run), "--sigma-rel", "0.08", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"error: {re.escape(str(run / LAST))}(/\.metadata)?: ", err), err
    assert err.count("\n") == 1, err
    if case != "another dtype in the data":  # the earlier snapshots are still readable
        got = synthesize(run, 0.10, step=8)
        want = _plain_load(run / "step-000000000008", "p1")
        assert got.keys() >= want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _plain_load(folder: Path, key: str) -> dict[str, torch.Tensor]:
    """A snapshot's profile ``key`` read by plain ``dcp.load`` (our own clean files)."""
    manifest = _manifest(folder)
    state = {
        key: {
            k: torch.zeros(v["shape"], dtype=getattr(torch, v["dtype"].split(".")[1]))
            for k, v in manifest["tensors"].items()
        }
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state[key]


# ------------------------------------------------------------------ paths
def _nothing_opened_in(outside: Path, opened: list[str]) -> None:
    leaked = [p for p in opened if p.startswith(str(outside))]
    assert not leaked, f"opened outside the snapshot directory: {leaked}"


@pytest.mark.parametrize("what", ["folder", "manifest.json", ".metadata"])
def test_snapshot_paths_leading_outside_are_refused_before_opening(
    clean: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    run = copy_run(clean["snaps"], tmp_path / "run")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if what == "folder":
        link = link_outside(run, outside, LAST)
    else:
        link = link_outside(run / LAST, outside, what)
    with files_opened() as opened, pytest.raises(ValueError, match="outside") as info:
        synthesize(run, 0.08)
    assert str(info.value).startswith(f"{link}: "), str(info.value)
    assert "symlink" in str(info.value)
    _nothing_opened_in(outside, opened)
    with files_opened() as opened:
        assert cli_main(["list", str(run)]) == 2
    _nothing_opened_in(outside, opened)
    err = capsys.readouterr().err
    assert err.startswith(f"error: {link}: ") and err.count("\n") == 1, err


def test_symlinks_inside_the_directory_and_names(clean: dict[str, Any], tmp_path: Path) -> None:
    """A symlink that stays inside is read; a folder name that is not step- and 12 digits
    (which could duplicate a step) is refused."""
    want = synthesize(clean["snaps"], 0.08)
    run = copy_run(clean["snaps"], tmp_path / "run")
    (run / "archive").mkdir()
    shutil.move(str(run / LAST), str(run / "archive" / LAST))
    os.symlink(Path("archive") / LAST, run / LAST)
    got = synthesize(run, 0.08)
    assert all(torch.equal(got[k], want[k]) for k in want)
    shutil.copytree(run / "archive" / LAST, run / "step-12")
    with pytest.raises(
        ValueError, match=r"step-12: not a snapshot folder name: expected 'step-000000000012'"
    ):
        synthesize(run, 0.08)
