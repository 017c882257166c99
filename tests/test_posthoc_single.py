"""PostHocEMA and synthesize in one process (no process group): tracking bit for bit against
a power-function EMA written here, snapshots, synthesize/merge against sums written here,
the CLI, crash safety, async saves, and every bad input.

The model trajectory: step ``s`` adds a seeded random delta to every float tensor (and 1 to
integer buffers), so the reference can follow it without training.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_script
from models import make_model
from torch import nn

from dtensor_ema import ModelEMA, PostHocEMA, merge_snapshots, synthesize
from dtensor_ema.posthoc import list_snapshots, plan_synthesis
from dtensor_ema.posthoc.cli import main as cli_main

SIGMAS = (0.05, 0.10)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
ROOT = Path(__file__).resolve().parents[1]


def ref_gamma(sigma_rel: float) -> float:
    k = sigma_rel**-2
    return float(np.roots([1.0, 7.0, 16.0 - k, 12.0 - k]).real.max())


def perturb_(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.is_floating_point():
                delta = torch.randn(v.shape, generator=g, dtype=torch.float64) * 0.1
                v.add_(delta.to(device=v.device, dtype=v.dtype))
            else:
                v.add_(1)


class RefPowerEMA:
    """ema <- ema.lerp(model, 1 - beta), beta = (1 - delta/t) ** (gamma + 1), full tensors."""

    def __init__(self, gamma: float) -> None:
        self.gamma, self.t, self.ema = gamma, 0, {}

    def update(self, model: nn.Module, delta: int = 1) -> None:
        self.t += delta
        beta = (1 - delta / self.t) ** (self.gamma + 1)
        for k, v in model.state_dict().items():
            if not v.is_floating_point():
                continue
            if k not in self.ema:
                self.ema[k] = v.detach().clone()
            self.ema[k].lerp_(v.detach().to(self.ema[k].dtype), 1 - beta)


def ref_combine(snapshot_dir: Path, key_weights: list[tuple[int, str, float]]) -> dict:
    """sum_i w_i * snapshot_i[key_i], float64, by plain dcp.load of whole snapshots."""
    out: dict[str, torch.Tensor] = {}
    for step, key, w in key_weights:
        path = snapshot_dir / f"step-{step:012d}"
        manifest = json.loads((path / "manifest.json").read_text())
        sd = {
            key: {
                k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"].split(".")[1]))
                for k, v in manifest["tensors"].items()
            }
        }
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
        for k, v in sd[key].items():
            out[k] = out.get(k, torch.zeros(v.shape, dtype=torch.float64)) + w * v.double()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tracked run: 24 updates of the edge model, snapshots every 4 (6 snapshots)."""
    tmp = tmp_path_factory.mktemp("phema")
    model = make_model("edge")
    ph = PostHocEMA(model, SIGMAS, snapshot_every=4, snapshot_dir=tmp / "snaps")
    refs = [RefPowerEMA(g) for g in ph.gammas]
    for step in range(1, 25):
        perturb_(model, step)
        ph.update()
        for r in refs:
            r.update(model)
    return {"dir": tmp / "snaps", "ph": ph, "refs": refs, "model": model, "tmp": tmp}


def test_tracking_is_bit_exact_at_w1(run: dict) -> None:
    ph, refs = run["ph"], run["refs"]
    for g, s in zip(ph.gammas, SIGMAS, strict=True):
        assert g == pytest.approx(ref_gamma(s), rel=1e-12)
    for sigma, ref in zip(SIGMAS, refs, strict=True):
        ema = ph.profile(sigma).ema_tensors()
        assert set(ema) == set(ref.ema)
        bad = [k for k in ref.ema if not torch.equal(ema[k], ref.ema[k])]
        assert not bad, f"sigma_rel={sigma}: {bad}"
    assert ph.steps == ph.t == 24 and ph.time_unit == "steps"


def test_snapshots_and_manifest(run: dict) -> None:
    snaps = list_snapshots(run["dir"])
    assert [s.step for s in snaps] == [4, 8, 12, 16, 20, 24]
    m = snaps[-1].manifest
    assert m["t"] == 24 and m["time"] == "steps"
    assert [p["sigma_rel"] for p in m["profiles"]] == list(SIGMAS)
    assert m["tensors"]["odd"] == {
        "shape": [13, 7],
        "dtype": "torch.float32",
        "ema_dtype": "torch.float32",
        "model_dtype": "torch.float32",
    }
    assert m["followed"] == {"int_buf": {"shape": [], "dtype": "torch.int64"}}


def test_synthesize_tracked_sigma_returns_the_latest_snapshot(run: dict) -> None:
    ph, model = run["ph"], run["model"]
    for sigma in SIGMAS:
        sd = synthesize(run["dir"], sigma)
        assert list(sd) == list(model.state_dict())  # keyed and ordered like the model
        live = ph.profile(sigma).ema_tensors()
        bad = [k for k in live if not torch.equal(sd[k], live[k])]
        assert not bad
        assert torch.equal(sd["int_buf"], model.int_buf)
    # at an earlier step: that step's snapshot
    sd12 = synthesize(run["dir"], 0.10, step=12)
    want = ref_combine(run["dir"], [(12, "p1", 1.0)])
    assert all(torch.equal(sd12[k], want[k].float()) for k in want)


def test_synthesize_matches_the_weighted_sum(run: dict) -> None:
    terms, error = plan_synthesis(run["dir"], 0.08)
    assert len(terms) == 12 and 0 <= error < 0.1
    want = ref_combine(run["dir"], [(t.step, t.key, t.weight) for t in terms])
    for bucket_bytes in (1, 1 << 30):  # one tensor per bucket, and one bucket
        got = synthesize(run["dir"], 0.08, bucket_bytes=bucket_bytes)
        for k, v in want.items():
            assert got[k].dtype == torch.float32
            torch.testing.assert_close(got[k], v.float(), rtol=0, atol=0)
    many = synthesize(run["dir"], [0.08, 0.10], dtype=torch.float64)
    assert many[0]["odd"].dtype == torch.float64
    torch.testing.assert_close(many[0]["odd"], want["odd"], rtol=1e-12, atol=1e-12)


def test_merge(run: dict) -> None:
    got = merge_snapshots(run["dir"], last=3)
    want = ref_combine(run["dir"], [(s, "p0", 1 / 3) for s in (16, 20, 24)])
    assert all(torch.equal(got[k], want[k].float()) for k in want)
    got = merge_snapshots(run["dir"], weights={8: 0.25, 24: 0.75}, sigma_rel=0.10)
    want = ref_combine(run["dir"], [(8, "p1", 0.25), (24, "p1", 0.75)])
    assert all(torch.equal(got[k], want[k].float()) for k in want)
    with pytest.raises(ValueError, match="exactly one"):
        merge_snapshots(run["dir"])
    with pytest.raises(ValueError, match=r"no snapshot at step\(s\) \[5\]"):
        merge_snapshots(run["dir"], weights={5: 1.0})
    with pytest.raises(ValueError, match=r"sigma_rel=0\.07 is not a tracked"):
        merge_snapshots(run["dir"], last=2, sigma_rel=0.07)


def test_outputs_and_cli(run: dict) -> None:
    out = run["tmp"] / "out"
    paths = synthesize(run["dir"], [0.06, 0.08], out=out)
    assert [p.name for p in paths] == [
        "sigma_rel-0.0600.safetensors",
        "sigma_rel-0.0800.safetensors",
    ]
    from safetensors.torch import load_file

    ref = synthesize(run["dir"], 0.08)
    saved = load_file(str(paths[1]))
    assert all(torch.equal(saved[k], ref[k]) for k in saved)
    pt = synthesize(run["dir"], 0.08, out=out / "one.pt")
    loaded = torch.load(pt, weights_only=True)
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    model = make_model("edge")
    model.load_state_dict(loaded)  # strict: integer buffers and every name present
    dcp_out = synthesize(run["dir"], 0.08, out=out / "dcpdir", format="dcp")
    fresh = {k: torch.zeros_like(v) for k, v in ref.items()}
    dcp.load(fresh, checkpoint_id=str(dcp_out), no_dist=True)
    assert all(torch.equal(fresh[k], ref[k]) for k in ref)

    # CLI in this process (tqdm bar, matplotlib plot) ...
    assert (
        cli_main(
            [
                "synthesize",
                str(run["dir"]),
                "--sigma-rel",
                "0.08",
                "--out",
                str(out / "cli.safetensors"),
            ]
        )
        == 0
    )
    assert (out / "cli_profiles.png").stat().st_size > 0
    saved = load_file(str(out / "cli.safetensors"))
    assert all(torch.equal(saved[k], ref[k]) for k in saved)
    assert (
        cli_main(
            [
                "merge",
                str(run["dir"]),
                "--weights",
                "8=0.25",
                "24=0.75",
                "--sigma-rel",
                "0.1",
                "--out",
                str(out / "m.pt"),
                "--no-progress",
            ]
        )
        == 0
    )
    merged = torch.load(out / "m.pt", weights_only=True)
    want = merge_snapshots(run["dir"], weights={8: 0.25, 24: 0.75}, sigma_rel=0.10)
    assert all(torch.equal(merged[k], want[k]) for k in want)
    assert cli_main(["synthesize", str(run["dir"]), "--sigma-rel", "0.5"]) == 2
    # ... and through `python -m` once (forked from the preloaded server, as python runs it)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["-m", "dtensor_ema.posthoc", "list", str(run["dir"])]
    code, stdout, stderr = run_script(argv, ROOT, env, timeout_s=120)
    assert code == 0, stderr
    assert "step-000000000024  t=24 (steps)  sigma_rel=[0.05, 0.1]" in stdout


@pytest.mark.parametrize("url", ["s3://bucket/snaps", Path("s3://bucket/snaps"), "gs://b/s"])
def test_snapshot_dir_url_is_refused_and_nothing_written(
    url: str | Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Snapshots go to a file system: an object-store URL (or ``Path`` of one, which
    keeps one slash) is refused at construction, naming it. Before the fix it was taken
    as a relative path and every snapshot went into a local folder ``./s3:/bucket/snaps``
    while the user believed them in the bucket; the readers looked for a local folder of
    that name. ``file://`` names a local directory."""
    monkeypatch.chdir(tmp_path)
    refused = r"snapshot_dir '(s3|gs):/.*' is an object-store URL"
    with pytest.raises(ValueError, match=refused):
        PostHocEMA(make_model("edge"), SIGMAS, snapshot_every=1, snapshot_dir=url)
    assert list(tmp_path.iterdir()) == []
    # the readers say the same (before: "snapshot directory s3:/bucket/snaps does not exist")
    for read in (
        list_snapshots,
        lambda d: synthesize(d, 0.08),
        lambda d: merge_snapshots(d, last=1),
    ):
        with pytest.raises(ValueError, match=refused):
            read(url)
    ph = PostHocEMA(nn.Linear(3, 2), SIGMAS, snapshot_every=1, snapshot_dir=f"file://{tmp_path}/s")
    ph.update()
    assert ph.snapshot_dir == tmp_path / "s" and len(list_snapshots(tmp_path / "s")) == 1


def test_bad_inputs(run: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"sigma_rel must lie in \(0, .*got 0.3"):
        synthesize(run["dir"], 0.3)
    with pytest.raises(ValueError, match=r"sigma_rels\[1\] must lie in .*got 0"):
        PostHocEMA(make_model("edge"), (0.05, 0))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        synthesize(tmp_path / "nope", 0.08)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no complete snapshot"):
        synthesize(tmp_path / "empty", 0.08)
    with pytest.raises(ValueError, match=r"no snapshot at step 13 .*available: \[4, 8"):
        synthesize(run["dir"], 0.08, step=13)
    with pytest.raises(ValueError, match="ill-conditioned"):
        synthesize(run["dir"], 0.08, max_condition=10.0)
    with pytest.raises(ValueError, match="one file but 2 outputs"):
        synthesize(run["dir"], [0.06, 0.08], out=tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError, match=r"the directory .*missing does not exist"):
        synthesize(run["dir"], 0.08, out=tmp_path / "missing" / "x.safetensors")
    # snapshots of another model in the same directory
    mixed = tmp_path / "mixed"
    shutil.copytree(run["dir"], mixed)
    other = PostHocEMA(nn.Linear(3, 2), SIGMAS, snapshot_dir=tmp_path / "other")
    for _ in range(30):
        other.update()
    shutil.copytree(other.snapshot(), mixed / "step-000000000030")
    with pytest.raises(ValueError, match="different models, shapes or dtypes"):
        synthesize(mixed, 0.08)
    synthesize(mixed, 0.08, step=24)  # the subset up to step 24 is consistent
    # the same model stored in another dtype
    mixed_dtype = tmp_path / "mixed_dtype"
    shutil.copytree(run["dir"], mixed_dtype)
    bf16 = PostHocEMA(
        make_model("edge"), SIGMAS, snapshot_dir=tmp_path / "bf16", snapshot_dtype=torch.bfloat16
    )
    for _ in range(30):
        bf16.update()
    shutil.copytree(bf16.snapshot(), mixed_dtype / "step-000000000030")
    with pytest.raises(
        ValueError,
        match=r"different \['conv.bias: \(5,\) torch.float32 vs \(5,\) torch.bfloat16 "
        r"\(EMA torch.float32\)'",
    ):
        synthesize(mixed_dtype, 0.08)
    ph = PostHocEMA(make_model("edge"), SIGMAS, snapshot_dir=tmp_path / "s")
    with pytest.raises(ValueError, match="before the first update"):
        ph.snapshot()
    with pytest.raises(ValueError, match="needs a snapshot_dir"):
        PostHocEMA(make_model("edge"), SIGMAS, snapshot_every=3)
    with pytest.raises(ValueError, match="duplicates"):
        PostHocEMA(make_model("edge"), (0.05, 0.05))
    with pytest.raises(ValueError, match="snapshot_dtype"):
        PostHocEMA(make_model("edge"), SIGMAS, snapshot_dtype=torch.int8)
    ph.update(samples=8)
    with pytest.raises(ValueError, match="counts time in samples"):
        ph.update()
    with pytest.raises(ValueError, match="samples must be an int >= 1, got 0"):
        ph.update(samples=0)
    assert ph.t == 8 and ph.steps == 1


def test_samples_time_low_precision_snapshots_and_resume(tmp_path: Path) -> None:
    """update(samples=n) follows (1 - n/t) ** (gamma + 1); bf16 snapshots; a resumed
    PostHocEMA continues the same trajectory."""
    model = make_model("edge")
    ph = PostHocEMA(model, SIGMAS, snapshot_dir=tmp_path / "s", snapshot_dtype=torch.bfloat16)
    refs = [RefPowerEMA(g) for g in ph.gammas]
    batches = [8, 8, 16, 4, 12, 8]
    for step, n in enumerate(batches[:3], 1):
        perturb_(model, step)
        ph.update(samples=n)
        for r in refs:
            r.update(model, n)
    dcp.save({"ph": ph}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    resumed = PostHocEMA(model, SIGMAS, snapshot_dir=tmp_path / "s", snapshot_dtype=torch.bfloat16)
    dcp.load({"ph": resumed}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert (resumed.t, resumed.steps, resumed.time_unit) == (32, 3, "samples")
    for step, n in enumerate(batches[3:], 4):
        perturb_(model, step)
        resumed.update(samples=n)
        for r in refs:
            r.update(model, n)
    for sigma, ref in zip(SIGMAS, refs, strict=True):
        ema = resumed.profile(sigma).ema_tensors()
        assert all(torch.equal(ema[k], ref.ema[k]) for k in ref.ema)
    path = resumed.snapshot()
    m = json.loads((path / "manifest.json").read_text())
    assert (
        m["t"] == 56 and m["time"] == "samples" and m["tensors"]["odd"]["dtype"] == "torch.bfloat16"
    )
    sd = synthesize(tmp_path / "s", 0.10)
    assert sd["odd"].dtype == torch.float32  # the EMA dtype, from bf16 storage
    assert torch.equal(sd["odd"], refs[1].ema["odd"].bfloat16().float())
    with pytest.raises(ValueError, match="sigma_rels"):
        PostHocEMA(model, (0.05, 0.2)).load_state_dict(resumed.state_dict())


def test_crash_mid_snapshot_keeps_earlier_snapshots(tmp_path: Path, monkeypatch) -> None:
    model = make_model("edge")
    ph = PostHocEMA(model, SIGMAS, snapshot_every=2, snapshot_dir=tmp_path / "s")
    for step in range(1, 5):
        perturb_(model, step)
        ph.update()
    before = synthesize(tmp_path / "s", 0.08)
    real_save = dcp.save

    def dying_save(state, *, storage_writer, **kw):  # writes, then dies before finishing
        real_save(state, storage_writer=storage_writer, **kw)
        (Path(storage_writer.path) / ".metadata").unlink()
        raise RuntimeError("killed mid-snapshot")

    monkeypatch.setattr(dcp, "save", dying_save)
    perturb_(model, 5)
    ph.update()
    with pytest.raises(RuntimeError, match="killed"):
        ph.update()
    monkeypatch.setattr(dcp, "save", real_save)
    assert (tmp_path / "s" / "step-000000000006.partial").is_dir()
    assert [s.step for s in list_snapshots(tmp_path / "s")] == [2, 4]
    after = synthesize(tmp_path / "s", 0.08)
    assert all(torch.equal(before[k], after[k]) for k in before)
    ph.snapshot()  # retries step 6, clearing the partial directory
    assert not (tmp_path / "s" / "step-000000000006.partial").exists()
    assert [s.step for s in list_snapshots(tmp_path / "s")] == [2, 4, 6]


def test_async_snapshot_holds_the_values_of_its_step(tmp_path: Path) -> None:
    model = make_model("edge")
    ph = PostHocEMA(model, SIGMAS, snapshot_dir=tmp_path / "s", async_save=True)
    for step in range(1, 4):
        perturb_(model, step)
        ph.update()
    at3 = {k: v.clone() for k, v in ph.profile(0.05).ema_tensors().items()}
    assert ph.snapshot() is None
    for step in range(4, 7):  # keep training while the snapshot is written
        perturb_(model, step)
        ph.update()
    assert ph.wait() == tmp_path / "s" / "step-000000000003"
    sd = synthesize(tmp_path / "s", 0.05)
    assert all(torch.equal(sd[k], at3[k]) for k in at3)


def test_reconstruction_error_shrinks_with_snapshot_spacing(tmp_path: Path) -> None:
    """Toy problem: a noisy drifting trajectory; synthesize(0.08) from 0.05/0.10 snapshots vs
    an online sigma_rel=0.08 EMA, for several snapshot spacings."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    drift = torch.randn(64, 64) * 0.02
    steps = 256
    ph = PostHocEMA(model, SIGMAS, snapshot_every=4, snapshot_dir=tmp_path / "s")
    online = PostHocEMA(model, (0.08, 0.05))
    for _ in range(steps):
        with torch.no_grad():
            model.weight.add_(drift + torch.randn(64, 64) * 0.05)
        ph.update()
        online.update()
    truth = online.profile(0.08).ema_tensors()["weight"]
    scale = (truth - online.profile(0.05).ema_tensors()["weight"]).norm()
    errors = {}
    for spacing in (4, 16, 64):
        subset = list(range(spacing, steps + 1, spacing))
        got = synthesize(tmp_path / "s", 0.08, steps=subset)["weight"]
        errors[spacing] = float((got - truth).norm() / scale)
    print("relative reconstruction error by snapshot spacing:", errors)
    assert errors[4] < 0.1
    assert errors[4] < errors[64]


def test_modelema_unaffected_and_profile_is_a_modelema(run: dict) -> None:
    assert isinstance(run["ph"].profile(0.05), ModelEMA)
    with pytest.raises(KeyError, match="not tracked"):
        run["ph"].profile(0.07)
    assert math.isclose(run["ph"].gammas[0], 16.97, abs_tol=0.01)


def test_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "posthoc_example", ROOT / "examples" / "posthoc_ema.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(
        [
            "--out-dir",
            str(tmp_path),
            "--steps",
            "60",
            "--snapshot-every",
            "20",
            "--hidden",
            "16",
            "--sigma-rels",
            "0.03",
            "0.05",
            "0.1",
        ]
    )
    assert set(losses) == {0.03, 0.05, 0.1} and all(math.isfinite(v) for v in losses.values())
    out = capsys.readouterr().out
    # the synthesized tracked lengths equal the online ones
    for line in out.splitlines():
        if line.startswith("tracked sigma_rel="):
            online, synthesized = (part.split()[-1] for part in line.split(","))
            assert online == synthesized, line
    assert (tmp_path / "sigma_rel_sweep.png").stat().st_size > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tracking_snapshot_and_synthesis(tmp_path: Path) -> None:
    """CUDA model and EMA: bit for bit against the reference on the device; bf16 and async
    snapshots written from device memory; synthesis (CPU) returns the tracked snapshot."""
    model = make_model("edge").cuda()
    ph = PostHocEMA(model, SIGMAS, snapshot_every=3, snapshot_dir=tmp_path / "s", async_save=True)
    refs = [RefPowerEMA(g) for g in ph.gammas]
    for step in range(1, 7):
        perturb_(model, step)
        ph.update(samples=16)
        for r in refs:
            r.update(model, 16)
    ph.wait()
    for sigma, ref in zip(SIGMAS, refs, strict=True):
        ema = ph.profile(sigma).ema_tensors()
        assert all(ema[k].is_cuda and torch.equal(ema[k], ref.ema[k]) for k in ref.ema)
        sd = synthesize(tmp_path / "s", sigma)
        assert all(torch.equal(sd[k], ref.ema[k].cpu()) for k in ref.ema)
    bf16 = PostHocEMA(model, SIGMAS, snapshot_dir=tmp_path / "b", snapshot_dtype=torch.bfloat16)
    bf16.update()
    bf16.snapshot()
    sd = synthesize(tmp_path / "b", 0.05)
    assert torch.equal(sd["odd"], model.odd.detach().bfloat16().float().cpu())
