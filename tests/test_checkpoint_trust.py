"""A checkpoint from someone else runs no code (issue 27), reads no file outside its folder
and leaves no row of a tensor unread (issue 35).

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``, so a
crafted ``.metadata`` ran its code inside every reader of ours before any check. Here each
reader (``load_checkpoint``, ``convert_checkpoint``, ``synthesize``, ``merge_snapshots``, the
``python -m dtensor_ema.posthoc`` CLI, the Lightning callback's and drop-in's loads of
sharded checkpoints) gets checkpoints whose ``.metadata`` would create a marker file
(``os.system``): the marker is never created, each raises ``CheckpointError`` naming the
refused global and the file, and the clean checkpoints load bit for bit. The allow-list of
``dtensor_ema.checkpoint.reader`` is pinned to the globals of every kind of checkpoint we write. One
process, no spawn; the multi-rank loads are in ``test_checkpoint_integrity.py`` (W=2) and
every checkpoint test of the suite loads through the same reader.

Issue 35, one process: checkpoints built only from DCP's own classes whose ``.metadata``
(or checksum file) names data files outside the folder (``../``, absolute, a symbolic link
that leaves it), or whose chunks leave rows of a tensor uncovered or cover them twice, are
refused by every reader before any data file is opened, naming the entry; ``verify=True``
on a checkpoint without checksum files warns once, ``verify="require"`` refuses it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crafted import (
    REFUSED,
    craft,
    duplicate_chunk,
    metadata_globals,
    read_metadata,
    redirect,
    rewrite,
    shrink_chunk,
    sidecars,
)
from models import reader_model
from torch import nn

from dtensor_ema import (
    CheckpointError,
    ModelEMA,
    PostHocEMA,
    convert_checkpoint,
    load_checkpoint,
    merge_snapshots,
    save_checkpoint,
    synthesize,
)
from dtensor_ema.checkpoint.reader import ChecksumError, UnverifiedCheckpointWarning
from dtensor_ema.posthoc.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SIGMAS = (0.05, 0.10)
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None


def _model() -> nn.Module:
    return reader_model()


@torch.no_grad()
def _step(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for v in model.state_dict().values():
        if v.is_floating_point():
            v.add_(torch.randn(v.shape, generator=g) * 0.1)
        else:
            v.add_(1)


def _lightning_layouts(root: Path, ema: ModelEMA, model: nn.Module) -> dict[str, Any]:
    """The DCP part of the checkpoints Lightning's ``ModelParallelStrategy`` writes for the
    callback (EMA under ``_dtensor_ema.<fqn>``) and the drop-in (average keyed like the
    module, raw weights under ``current_model_state.<fqn>``), written by DCP as Lightning
    does (``state_dict`` entry)."""
    from dtensor_ema.compat.lightning import CURRENT_PREFIX
    from dtensor_ema.integrations.lightning import EMA_KEY_PREFIX

    averaged = {k: v.clone() for k, v in ema.ema_tensors().items()}
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    callback = {EMA_KEY_PREFIX + k: v for k, v in averaged.items()}
    dcp.save({"state_dict": callback}, checkpoint_id=str(root / "callback"), no_dist=True)
    drop_in = {CURRENT_PREFIX + k: v for k, v in raw.items()} | {
        k: averaged.get(k, v) for k, v in raw.items()
    }
    dcp.save({"state_dict": drop_in}, checkpoint_id=str(root / "drop_in"), no_dist=True)
    return {"averaged": averaged, "raw": raw}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every kind of checkpoint we write, in one process."""
    root = tmp_path_factory.mktemp("trust")
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = ModelEMA(model, decay=0.5, tau=None)
    posthoc = PostHocEMA(model, SIGMAS, snapshot_every=2, snapshot_dir=root / "snaps")
    for step in range(1, 5):
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
        _step(model, step)
        ema.update()
        posthoc.update()
    state = {"ema": ema, "model": model.state_dict(), "optim": optimizer.state_dict()}
    save_checkpoint(state, root / "ckpt")
    dcp.async_save({"ema": ema}, checkpoint_id=str(root / "async"), no_dist=True).result()
    async_posthoc = PostHocEMA(
        model, SIGMAS, snapshot_every=1, snapshot_dir=root / "async-snaps", async_save=True
    )
    async_posthoc.update()
    async_posthoc.wait()
    bf16 = ModelEMA(model, decay=0.5, tau=None, ema_dtype=torch.bfloat16)
    save_checkpoint({"ema": bf16}, root / "bf16")
    out: dict[str, Any] = {
        "root": root,
        "ema": {k: v.clone() for k, v in ema.ema_tensors().items()},
        "updates": ema.updates,
        "latest": {k: v.clone() for k, v in posthoc.emas["p0"].ema_tensors().items()},
    }
    if HAVE_LIGHTNING:
        out["lightning"] = _lightning_layouts(root / "lightning", ema, model)
    # Another save of the same layout, other values: what a crafted checkpoint reads.
    _step(model, 5)
    ema.update()
    save_checkpoint(state, root / "other")
    return out


def _written_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob(".metadata") if "crafted" not in str(p))


def test_allow_list_is_exactly_what_our_checkpoints_need(written: dict[str, Any]) -> None:
    """Pinned both ways: every global of every kind of checkpoint we write is allowed, and
    every allowed global appears in one of them (``WindowsPath`` stands for ``PosixPath`` on
    Windows). Dtypes are allowed as a family: each seen is a torch dtype."""
    from dtensor_ema.checkpoint.reader import METADATA_GLOBALS, open_checkpoint

    dirs = _written_dirs(written["root"])
    kinds = {d.relative_to(written["root"]).parts[0] for d in dirs}
    assert kinds >= {"ckpt", "async", "snaps", "async-snaps", "bf16"}, kinds
    seen: set[tuple[str, str]] = set()
    for d in dirs:
        seen |= metadata_globals(d / ".metadata")
        open_checkpoint(d)  # loads under the restriction
    dtypes = {
        (m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)
    }
    assert {n for _, n in dtypes} >= {"float32", "bfloat16", "int64"}
    assert seen - dtypes == METADATA_GLOBALS - {("pathlib", "WindowsPath")}


def _refused(fn: Callable[[], Any], marker: Path, file: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    assert REFUSED in message and str(file / ".metadata") in message, message
    assert not marker.exists(), "the crafted .metadata ran its code"


@pytest.mark.parametrize("kind", ["inside", "whole", "no-data"])
def test_crafted_checkpoints_run_no_code_in_any_reader(
    written: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    root = written["root"]
    marker = tmp_path / "ran"
    crafted = craft(root / "ckpt", tmp_path / "crafted", marker, kind)
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    before = {k: v.clone() for k, v in fresh.ema_tensors().items()}
    _refused(lambda: load_checkpoint({"ema": fresh}, crafted), marker, crafted)
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in before.items())
    assert fresh.updates == 0
    _refused(lambda: convert_checkpoint(crafted, tmp_path / "ema.pt"), marker, crafted)
    assert not (tmp_path / "ema.pt").exists()

    snaps = tmp_path / "snaps"
    shutil.copytree(root / "snaps", snaps)
    latest = sorted(snaps.iterdir())[-1]
    shutil.rmtree(latest)
    craft(root / "snaps" / latest.name, latest, marker, kind)
    _refused(lambda: synthesize(snaps, 0.07), marker, latest)
    _refused(lambda: merge_snapshots(snaps, last=2), marker, latest)


def test_crafted_snapshots_in_the_cli(
    written: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    snaps = tmp_path / "snaps"
    shutil.copytree(written["root"] / "snaps", snaps)
    latest = sorted(snaps.iterdir())[-1]
    shutil.rmtree(latest)
    craft(written["root"] / "snaps" / latest.name, latest, marker, "inside")
    out = str(tmp_path / "out.pt")
    for argv in (
        ["synthesize", str(snaps), "--sigma-rel", "0.07", "--out", out, "--no-progress"],
        ["merge", str(snaps), "--last", "2", "--out", out, "--no-progress"],
    ):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and REFUSED in err and err.count("\n") == 1, err
        assert not marker.exists() and not Path(out).exists()


def test_clean_checkpoints_load_bit_for_bit(written: dict[str, Any], tmp_path: Path) -> None:
    root = written["root"]
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    load_checkpoint({"ema": fresh}, root / "ckpt")
    assert fresh.updates == written["updates"]
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in written["ema"].items())
    converted = convert_checkpoint(root / "ckpt", tmp_path / "ema.pt")
    assert all(torch.equal(converted[k], v) for k, v in written["ema"].items())
    assert converted.keys() == written["ema"].keys()
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    with pytest.warns(UnverifiedCheckpointWarning, match="has no checksum files"):
        load_checkpoint({"ema": fresh}, root / "async")  # dcp.async_save writes none
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in written["ema"].items())
    # a tracked sigma_rel returns the latest snapshot exactly; so does a merge of it alone
    latest = written["latest"]
    synthesized = synthesize(root / "snaps", SIGMAS[0])
    merged = merge_snapshots(root / "snaps", last=1, sigma_rel=SIGMAS[0])
    for got in (synthesized, merged):
        assert all(torch.equal(got[k], v) for k, v in latest.items())
    argv = ["merge", str(root / "snaps"), "--last", "1", "--out", str(tmp_path / "m.pt")]
    assert cli_main([*argv, "--no-progress", "--sigma-rel", str(SIGMAS[0])]) == 0
    from_cli = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(from_cli[k], v) for k, v in latest.items())


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="needs the lightning extra")
def test_lightning_loads_run_no_code(written: dict[str, Any], tmp_path: Path) -> None:
    from dtensor_ema.compat.lightning import EMAWeightAveraging
    from dtensor_ema.integrations.lightning import EMACallback

    root = written["root"] / "lightning"
    averaged, raw = written["lightning"]["averaged"], written["lightning"]["raw"]
    marker = tmp_path / "ran"

    def callback_reads(path: Path) -> dict[str, torch.Tensor]:
        callback = EMACallback(decay=0.5, tau=None)
        callback._ckpt_path = str(path)
        return callback._read_sharded(ModelEMA(_model(), decay=0.5, tau=None))

    got = callback_reads(root / "callback")
    assert all(torch.equal(got[k], v) for k, v in averaged.items())
    crafted = craft(root / "callback", tmp_path / "callback", marker, "inside")
    _refused(lambda: callback_reads(crafted), marker, crafted)

    def drop_in_reads(path: Path) -> tuple[nn.Module, Any]:
        module = _model()
        drop_in = EMAWeightAveraging(decay=0.5)
        drop_in.on_fit_start(None, module)  # type: ignore[arg-type]  # builds the average
        drop_in._load_sharded(module, str(path), 4)  # type: ignore[arg-type]
        return module, drop_in._average_model

    module, average = drop_in_reads(root / "drop_in")
    assert all(torch.equal(module.state_dict()[k], v) for k, v in raw.items())
    assert average is not None and average.n_averaged == 4
    ema = average.engine.ema_tensors()
    assert all(torch.equal(ema[k], averaged[k]) for k in ema)
    crafted = craft(root / "drop_in", tmp_path / "drop_in", marker, "inside")
    _refused(lambda: drop_in_reads(crafted), marker, crafted)


# ---------------------------------------------------------------- issue 35: one process
WEIGHT = "ema.ema.0.weight"  # Linear(5, 6): shape (6, 5), one chunk at W=1


def _outside(root: Path, tmp_path: Path, how: str) -> Path:
    """A copy of ``ckpt`` whose first layer's EMA is read from ``other`` (same layout, other
    values): by ``.metadata`` naming ``../other/...`` or an absolute path, by its data file
    being a symbolic link there, or by its checksum file naming ``../other/...``. The
    checksum files are rewritten to match, as whoever crafts it would."""
    crafted = Path(shutil.copytree(root / "ckpt", tmp_path / f"outside-{how}"))
    other = root / "other"
    if how == "parent":
        redirect(crafted, WEIGHT, lambda f: f"../../{other.parent.name}/other/{f}")
    elif how == "absolute":
        redirect(crafted, WEIGHT, lambda f: str(other / f))
    elif how == "symlink":
        for f in crafted.glob("*.distcp"):
            f.unlink()
            f.symlink_to(other / f.name)
        rewrite(crafted, read_metadata(crafted))
    else:
        assert how == "checksum-file"
        for f, payload in sidecars(crafted).items():
            for key, entry in payload["items"].items():
                if key.startswith(WEIGHT + "@"):
                    entry["file"] = f"../other/{entry['file']}"
            f.write_text(json.dumps(payload))
    return crafted


OUTSIDE = {
    "parent": r"\.metadata \(entry 'ema\.ema\.0\.weight'\) names '\.\./\.\./.*/other/__0_0"
    r"\.distcp', which is not a plain file name inside .*: refused before any file was opened",
    "absolute": r"\.metadata \(entry 'ema\.ema\.0\.weight'\) names '/.*/other/__0_0\.distcp', "
    r"which is not a plain file name inside",
    "symlink": r".*outside-symlink/\.metadata \(entry '.*'\) names '__0_0\.distcp', a "
    r"symbolic link that leaves .*outside-symlink: refused before any file was opened",
    "checksum-file": r"/__0\.checksums\.json names '\.\./other/__0_0\.distcp', which is not a "
    r"plain file name inside",
}


def _refused_with(fn: Callable[[], Any], pattern: str, kind: type[Exception]) -> None:
    with pytest.raises(kind) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)


@pytest.mark.parametrize("how", list(OUTSIDE))
def test_files_outside_the_checkpoint_are_refused(
    written: dict[str, Any], tmp_path: Path, how: str
) -> None:
    """``load_checkpoint`` and ``convert_checkpoint`` refuse a checkpoint that reads data
    from another folder (before: its values loaded without a word), the EMA untouched, no
    file written; the same folder, plainly, loads."""
    crafted = _outside(written["root"], tmp_path, how)
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    before = {k: v.clone() for k, v in fresh.ema_tensors().items()}
    _refused_with(lambda: load_checkpoint({"ema": fresh}, crafted), OUTSIDE[how], CheckpointError)
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in before.items())
    assert fresh.updates == 0
    out = tmp_path / "ema.pt"
    _refused_with(lambda: convert_checkpoint(crafted, out), OUTSIDE[how], CheckpointError)
    assert not out.exists()


def test_files_outside_the_checkpoint_in_the_integrations(
    written: dict[str, Any], tmp_path: Path
) -> None:
    """The torchtitan trainer's check of a checkpoint (before torchtitan's own load reads
    it) and the Lightning loads refuse data files outside the folder too."""
    root = written["root"]
    crafted = _outside(root, tmp_path, "parent")
    if importlib.util.find_spec("torchtitan") is not None:
        from dtensor_ema.integrations.torchtitan.trainer import _saved_ema

        _refused_with(lambda: _saved_ema(str(crafted)), OUTSIDE["parent"], CheckpointError)
    if not HAVE_LIGHTNING:
        return
    from dtensor_ema.compat.lightning import EMAWeightAveraging
    from dtensor_ema.integrations.lightning import EMACallback

    layouts = root / "lightning"
    for kind, fqn in (("callback", "state_dict._dtensor_ema.0.weight"), ("drop_in", None)):
        copy = Path(shutil.copytree(layouts / kind, tmp_path / kind))
        name = fqn or "state_dict.0.weight"
        redirect(copy, name, lambda f: f"../../{layouts.parent.name}/lightning/{kind}/{f}")  # noqa: B023
        pattern = rf"entry '{re.escape(name)}'\) names '\.\./\.\./.*', which is not a plain"
        if kind == "callback":
            callback = EMACallback(decay=0.5, tau=None)
            callback._ckpt_path = str(copy)
            ema = ModelEMA(_model(), decay=0.5, tau=None)
            _refused_with(lambda: callback._read_sharded(ema), pattern, CheckpointError)  # noqa: B023
        else:
            module = _model()
            drop_in = EMAWeightAveraging(decay=0.5)
            drop_in.on_fit_start(None, module)  # type: ignore[arg-type]
            _refused_with(
                lambda: drop_in._load_sharded(module, str(copy), 4),  # type: ignore[arg-type]  # noqa: B023
                pattern,
                CheckpointError,
            )


COVERAGE = {
    "gap": (
        lambda d, **kw: shrink_chunk(d, WEIGHT, 3, **kw),
        r"rows 3-5 are not covered",
    ),
    "overlap": (
        lambda d, **kw: duplicate_chunk(d, WEIGHT, **kw),
        r"rows 0-5 are covered more than once",
    ),
}


@pytest.mark.parametrize("checksums", ["fix", "drop"])
@pytest.mark.parametrize("case", list(COVERAGE))
def test_chunks_that_do_not_cover_a_tensor_are_refused(
    written: dict[str, Any], tmp_path: Path, case: str, checksums: str
) -> None:
    """A ``.metadata`` whose chunks cover rows 0-2 of a 6-row tensor (with checksum files
    rewritten to match, or none: a plain ``dcp.save`` checkpoint) left rows 3-5 of the EMA
    as they were in ``load_checkpoint`` and as ``torch.empty`` memory in
    ``convert_checkpoint``; chunks listed twice are refused too. Every reader refuses them,
    naming the tensor and the rows, before anything is read."""
    root = written["root"]
    crafted = Path(shutil.copytree(root / "ckpt", tmp_path / case))
    edit, rows = COVERAGE[case]
    edit(crafted, checksums=checksums)
    pattern = (
        rf"{re.escape(str(crafted / '.metadata'))}: the saved chunks of tensor "
        rf"'{re.escape(WEIGHT)}' \(shape \(6, 5\)\) do not cover it exactly once: {rows}; "
        r"refused before anything was read$"
    )
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    before = {k: v.clone() for k, v in fresh.ema_tensors().items()}
    _refused_with(lambda: load_checkpoint({"ema": fresh}, crafted), pattern, CheckpointError)
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in before.items())
    out = tmp_path / "ema.pt"
    _refused_with(lambda: convert_checkpoint(crafted, out), pattern, CheckpointError)
    assert not out.exists()
    if HAVE_LIGHTNING and case == "gap":  # torch.empty_like buffers filled by the load
        from dtensor_ema.integrations.lightning import EMACallback

        layout = Path(shutil.copytree(root / "lightning" / "callback", tmp_path / "callback"))
        shrink_chunk(layout, "state_dict._dtensor_ema.0.weight", 3, checksums=checksums)
        callback = EMACallback(decay=0.5, tau=None)
        callback._ckpt_path = str(layout)
        ema = ModelEMA(_model(), decay=0.5, tau=None)
        _refused_with(lambda: callback._read_sharded(ema), rows, CheckpointError)


def test_verify_warns_without_checksums_and_require_refuses(
    written: dict[str, Any], tmp_path: Path
) -> None:
    """``verify=True`` on a checkpoint without checksum files (``dcp.async_save``) loads it
    with one ``UnverifiedCheckpointWarning``; ``verify="require"`` refuses it, the EMA
    untouched; ``verify=False`` is quiet; a checkpoint with checksums loads under
    ``"require"`` without a warning. ``convert_checkpoint`` alike."""
    import warnings

    root = written["root"]
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    before = {k: v.clone() for k, v in fresh.ema_tensors().items()}
    require = r"checkpoint .*async has no checksum files .*: nothing can be verified, and " + (
        r"verify='require' refuses it$"
    )
    _refused_with(
        lambda: load_checkpoint({"ema": fresh}, root / "async", verify="require"),
        require,
        ChecksumError,
    )
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in before.items())
    _refused_with(
        lambda: convert_checkpoint(root / "async", tmp_path / "a.pt", verify="require"),
        require,
        ChecksumError,
    )
    assert not (tmp_path / "a.pt").exists()
    for reader in (
        lambda verify: load_checkpoint({"ema": fresh}, root / "async", verify=verify),
        lambda verify: convert_checkpoint(root / "async", tmp_path / "a.pt", verify=verify),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader(True)
        unverified = [w for w in caught if w.category is UnverifiedCheckpointWarning]
        assert len(unverified) == 1, [str(w.message) for w in caught]
        assert "nothing was verified" in str(unverified[0].message)
        assert unverified[0].filename == __file__  # points at the caller
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader(False)
        assert not [w for w in caught if w.category is UnverifiedCheckpointWarning]
    assert all(torch.equal(fresh.ema_tensors()[k], v) for k, v in written["ema"].items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint({"ema": fresh}, root / "ckpt", verify="require")
        convert_checkpoint(root / "ckpt", tmp_path / "c.pt", verify="require")
    assert not [w for w in caught if w.category is UnverifiedCheckpointWarning]
    with pytest.raises(ValueError, match=r"verify must be True, False or 'require', got 'yes'"):
        load_checkpoint({"ema": fresh}, root / "ckpt", verify="yes")  # type: ignore[arg-type]


LAYOUTS = {  # shape, chunks (offsets, sizes), the problem named (None: covered exactly once)
    "row shards": ((10, 7), [((0, 0), (4, 7)), ((4, 0), (4, 7)), ((8, 0), (2, 7))], None),
    "uneven, an empty shard": ((3, 4), [((0, 0), (3, 4)), ((3, 0), (0, 4))], None),
    "2-D grid": ((4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)], None),
    "not a grid, covered": (
        (4, 4),
        [((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3))],
        None,
    ),
    "0-dim": ((), [((), ())], None),
    "empty tensor": ((0, 5), [], None),
    "rows missing": ((16, 7), [((0, 0), (8, 7))], "rows 8-15 are not covered"),
    "a column missing": (
        (4, 4),
        [((0, 0), (4, 3))],
        "rows 0-3 are not covered",
    ),
    "one row twice": (
        (10, 7),
        [((0, 0), (5, 7)), ((4, 0), (6, 7))],
        "row 4 is covered more than once",
    ),
    "a gap hidden by an overlap": (
        (4, 4),
        [((0, 0), (4, 2)), ((0, 2), (2, 2)), ((0, 2), (2, 2))],
        "rows 2-3 are not covered and rows 0-1 are covered more than once",
    ),
    "0-dim, none": ((), [], "its one element is not covered"),
    "outside": ((4,), [((0,), (5,))], "a chunk at offsets (0,) of sizes (5,) lies outside"),
    "negative": ((4,), [((-1,), (5,))], "a chunk at offsets (-1,) of sizes (5,) lies outside"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_coverage_of_chunk_layouts(layout: str) -> None:
    """``reader.coverage_problem``: exact for grids and other boxes, naming the rows."""
    from dtensor_ema.checkpoint.reader import coverage_problem

    shape, chunks, expected = LAYOUTS[layout]
    problem = coverage_problem(shape, chunks)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem
