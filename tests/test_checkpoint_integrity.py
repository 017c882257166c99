"""Checkpoints that detect corruption (issue 19), and exports that refuse bad paths.

``save_checkpoint`` records a CRC-32 per written chunk; ``load_checkpoint`` verifies, before
anything changes, every saved chunk its load reads, also when it reshards: saved at W=3,
loaded at W=2 (one spawn each) and in this process with no process group. A byte flipped
inside a tensor's data in a ``.distcp`` file loaded silently before.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from models import mismatches
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from dtensor_ema import ModelEMA, export_ema
from dtensor_ema.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

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


def save_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """W=3: save, then make a corrupted copy (rank 0 flips a byte in its own chunk)."""
    ema = _trained(_model())
    good, bad = Path(tmp) / "good", Path(tmp) / "bad"
    save_checkpoint({"ema": ema}, good)
    full = ema.get_ema_state_dict()
    out: dict[str, Any] = {"full": full, "sidecars": sorted(p.name for p in good.glob("*.json"))}
    if rank == 0:
        shutil.copytree(good, bad)
        out["file"] = _flip_inside(bad, CORRUPTED, _local(ema)[CORRUPTED])
    dist.barrier()
    return out


def load_body(rank: int, world_size: int, tmp: str, full: dict[str, Any]) -> dict[str, Any]:
    """W=2: a verified resharding load; the corrupted copy refused on every rank, nothing
    written; ``verify=False`` and plain ``dcp.load`` still load."""
    good, bad = Path(tmp) / "good", Path(tmp) / "bad"
    model = _model()
    out: dict[str, Any] = {}
    ema = ModelEMA(model, decay=0.5, tau=None)
    load_checkpoint({"ema": ema}, good)
    out["good_mismatch"] = mismatches(ema.get_ema_state_dict(), full)
    fresh = ModelEMA(model, decay=0.5, tau=None)
    before = _local(fresh)
    try:
        load_checkpoint({"ema": fresh}, bad)
        out["bad_error"] = None
    except (CheckpointError, RuntimeError) as e:
        out["bad_error"] = (type(e).__name__, str(e))
    out["bad_untouched"] = mismatches(_local(fresh), before) == [] and fresh.updates == 0
    load_checkpoint({"ema": fresh}, bad, verify=False)
    out["unverified_updates"] = fresh.updates
    plain = ModelEMA(model, decay=0.5, tau=None)
    dcp.load({"ema": plain}, checkpoint_id=str(good))
    out["dcp_mismatch"] = mismatches(plain.get_ema_state_dict(), full)
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


@pytest.mark.distributed
def test_corruption_is_detected_when_resharding_to_two_ranks(saved: Any) -> None:
    tmp, results = saved
    full, file = results[0]["full"], results[0]["file"]
    loaded = run_ranks(load_body, 2, tmp, str(tmp), full)
    kinds = [r["bad_error"][0] if r["bad_error"] else None for r in loaded]
    assert None not in kinds, kinds  # every rank refused, none went on into DCP
    named = [msg for kind, msg in (r["bad_error"] for r in loaded) if kind == "CheckpointError"]
    assert named, kinds  # the rank(s) whose pieces overlap the chunk say what is wrong
    assert all(file in msg and CORRUPTED in msg and "corrupted" in msg for msg in named)
    for r in loaded:
        assert r["good_mismatch"] == [] and r["dcp_mismatch"] == []
        assert r["bad_untouched"]
        assert r["unverified_updates"] == 1  # verify=False loads it anyway


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


def test_single_process_checksums_and_older_checkpoints(tmp_path: Path) -> None:
    ema = _trained(_model())
    save_checkpoint({"ema": ema}, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "__0.checksums.json").is_file()
    _flip_inside(tmp_path / "ckpt", CORRUPTED, _local(ema)[CORRUPTED])
    fresh = ModelEMA(_model(), decay=0.5, tau=None)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*0\.weight"):
        load_checkpoint({"ema": fresh}, tmp_path / "ckpt")
    # A checkpoint without checksum files (plain dcp.save) loads unverified, as before.
    dcp.save({"ema": ema}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
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
