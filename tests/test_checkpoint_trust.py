"""A checkpoint from someone else runs no code (issue 27).

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``, so a
crafted ``.metadata`` ran its code inside every reader of ours before any check. Here each
reader (``load_checkpoint``, ``convert_checkpoint``, ``synthesize``, ``merge_snapshots``, the
``python -m dtensor_ema.posthoc`` CLI, the Lightning callback's and drop-in's loads of
sharded checkpoints) gets checkpoints whose ``.metadata`` would create a marker file
(``os.system``): the marker is never created, each raises ``CheckpointError`` naming the
refused global and the file, and the clean checkpoints load bit for bit. The allow-list of
``dtensor_ema.reader`` is pinned to the globals of every kind of checkpoint we write. One
process, no spawn; the multi-rank loads are in ``test_checkpoint_integrity.py`` (W=2) and
every checkpoint test of the suite loads through the same reader.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crafted import REFUSED, craft, metadata_globals
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
from dtensor_ema.posthoc.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SIGMAS = (0.05, 0.10)
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


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
    return out


def _written_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob(".metadata") if "crafted" not in str(p))


def test_allow_list_is_exactly_what_our_checkpoints_need(written: dict[str, Any]) -> None:
    """Pinned both ways: every global of every kind of checkpoint we write is allowed, and
    every allowed global appears in one of them (``WindowsPath`` stands for ``PosixPath`` on
    Windows). Dtypes are allowed as a family: each seen is a torch dtype."""
    from dtensor_ema.reader import METADATA_GLOBALS, open_checkpoint

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
    load_checkpoint({"ema": fresh}, root / "async")
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
