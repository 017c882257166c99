"""Post-hoc EMA of what you train (issue 34, item 4), in one process (no process group):
``PostHocEMA(model, track="trainable")`` on a peft LoRA model and ``track=<predicate>``.
Snapshots hold the tracked tensors only (the manifest lists the others), ``synthesize``,
``merge_snapshots`` and the CLI carry the tracked set, and the synthesized EMA of a LoRA
run exports as a PEFT adapter that ``PeftModel.from_pretrained`` loads. References (a
power-function EMA with plain ``lerp_``; float64 sums of snapshots read by plain
``dcp.load``) are written here. W=1 and W=3 are in ``test_posthoc_distributed.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import require_extra
from models import make_model, perturb_trainable_
from torch import nn

from dtensor_ema import PostHocEMA, merge_snapshots, synthesize
from dtensor_ema.posthoc import list_snapshots, plan_synthesis
from dtensor_ema.posthoc.cli import main as cli_main

SIGMAS = (0.05, 0.10)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class RefPowerEMA:
    """ema <- ema.lerp(w, 1 - beta), beta = (1 - 1/t) ** (gamma + 1), on the given names."""

    def __init__(self, gamma: float, names: list[str]) -> None:
        self.gamma, self.t, self.names, self.ema = gamma, 0, names, {}

    def update(self, model: nn.Module) -> None:
        self.t += 1
        beta = (1 - 1 / self.t) ** (self.gamma + 1)
        sd = model.state_dict()
        for k in self.names:
            self.ema.setdefault(k, sd[k].detach().clone()).lerp_(sd[k].detach(), 1 - beta)


def untracked_floats(model: nn.Module, tracked: list[str]) -> list[str]:
    """The model's float tensors outside ``tracked``, tied duplicates once (first name)."""
    seen: set[int] = set()
    names = []
    for k, v in model.state_dict(keep_vars=True).items():
        if v.is_floating_point() and id(v) not in seen and k not in tracked:
            names.append(k)
        seen.add(id(v))
    return names


def ref_combine(snapshot_dir: Path, terms: list[tuple[int, str, float]]) -> dict:
    """sum_i w_i * snapshot_i[key_i] in float64, by plain dcp.load of whole snapshots."""
    out: dict[str, torch.Tensor] = {}
    for step, key, w in terms:
        path = snapshot_dir / f"step-{step:012d}"
        manifest = json.loads((path / "manifest.json").read_text())
        sd = {key: {k: torch.zeros(v["shape"]) for k, v in manifest["tensors"].items()}}
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
        for k, v in sd[key].items():
            out[k] = out.get(k, torch.zeros(v.shape, dtype=torch.float64)) + w * v.double()
    return out


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """12 updates of a GPT-2 LoRA (peft), snapshots every 4, ``track="trainable"``."""
    require_extra("peft", "transformers")
    from models import peft_lora

    tmp = tmp_path_factory.mktemp("phema_lora")
    model = peft_lora("gpt2")
    adapter = [k for k, p in model.named_parameters() if p.requires_grad]
    ph = PostHocEMA(model, SIGMAS, snapshot_every=4, snapshot_dir=tmp / "snaps", track="trainable")
    refs = [RefPowerEMA(g, adapter) for g in ph.gammas]
    for step in range(1, 13):
        perturb_trainable_(model, step)
        ph.update()
        for r in refs:
            r.update(model)
    return {"dir": tmp / "snaps", "ph": ph, "refs": refs, "model": model, "tmp": tmp,
            "adapter": adapter}  # fmt: skip


def test_lora_profiles_are_the_adapters_bit_exact(lora: dict[str, Any]) -> None:
    ph = lora["ph"]
    assert ph.untracked == untracked_floats(lora["model"], lora["adapter"])
    for sigma, ref in zip(SIGMAS, lora["refs"], strict=True):
        ema = ph.profile(sigma).ema_tensors()
        assert list(ema) == lora["adapter"]
        assert all(torch.equal(ema[k], ref.ema[k]) for k in ref.ema), sigma


def test_lora_snapshots_hold_only_the_adapters(lora: dict[str, Any]) -> None:
    snaps = list_snapshots(lora["dir"])
    assert [s.step for s in snaps] == [4, 8, 12]
    model = lora["model"]
    adapter_bytes = sum(model.state_dict()[k].numel() * 4 for k in lora["adapter"])
    base_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    for s in snaps:
        m = s.manifest
        assert list(m["tensors"]) == lora["adapter"]
        assert m["track"] == "trainable" and m["untracked"] == lora["ph"].untracked
        assert m["followed"] == {} and m["aliases"] == {}
        metadata = dcp.FileSystemReader(str(s.path)).read_metadata()  # our own file
        assert set(metadata.state_dict_metadata) == {
            f"p{i}.{k}" for i in range(2) for k in lora["adapter"]
        }
        stored = sum(
            md.size.numel() * md.properties.dtype.itemsize
            for md in metadata.state_dict_metadata.values()
        )
        assert stored == 2 * adapter_bytes
        files = sum(f.stat().st_size for f in s.path.glob("*.distcp"))
        assert stored <= files < stored + 2048 * len(metadata.state_dict_metadata)
        assert files < base_bytes / 4  # a whole-model snapshot: 2 * base_bytes


def test_synthesize_merge_and_cli_carry_the_tracked_set(
    lora: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    snaps, ph, refs = lora["dir"], lora["ph"], lora["refs"]
    for sigma, ref in zip(SIGMAS, refs, strict=True):
        sd = synthesize(snaps, sigma)  # a tracked profile: its latest snapshot, exactly
        assert list(sd) == lora["adapter"]
        assert all(torch.equal(sd[k], ref.ema[k]) for k in ref.ema)
    terms, _ = plan_synthesis(snaps, 0.08)
    want = ref_combine(snaps, [(t.step, t.key, t.weight) for t in terms])
    got = synthesize(snaps, 0.08)
    assert list(got) == lora["adapter"]
    assert all(torch.equal(got[k], want[k].float()) for k in want)
    merged = merge_snapshots(snaps, last=2)
    want_merged = ref_combine(snaps, [(8, "p0", 0.5), (12, "p0", 0.5)])
    assert all(torch.equal(merged[k], want_merged[k].float()) for k in want_merged)
    from safetensors import safe_open

    path = synthesize(snaps, 0.08, out=lora["tmp"] / "synth.safetensors")
    with safe_open(str(path), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert sorted(keys) == sorted(lora["adapter"])
    assert meta["dtensor_ema.track"] == "trainable"
    assert json.loads(meta["dtensor_ema.untracked"]) == ph.untracked
    assert cli_main(["list", str(snaps)]) == 0
    listed = capsys.readouterr().out
    assert f"4 tensors ({len(ph.untracked)} untracked)" in listed
    out = lora["tmp"] / "cli.pt"
    argv = ["synthesize", str(snaps), "--sigma-rel", "0.08", "--out", str(out), "--no-progress"]
    assert cli_main([*argv, "--plot", str(lora["tmp"] / "p.png")]) == 0
    printed = capsys.readouterr().out
    assert f"{len(ph.untracked)} untracked tensors" in printed and "strict=False" in printed
    cli = torch.load(out, weights_only=True)
    assert list(cli) == lora["adapter"] and all(torch.equal(cli[k], got[k]) for k in got)
    from models import peft_lora

    model = peft_lora("gpt2")
    missing, unexpected = model.load_state_dict(cli, strict=False)
    assert not unexpected and sorted(missing) == sorted(
        k for k in model.state_dict() if k not in cli
    )


def test_synthesized_lora_ema_exports_as_a_peft_adapter(lora: dict[str, Any]) -> None:
    import peft
    from models import peft_lora, transformers_base

    from dtensor_ema.export.peft import ADAPTER_FILES, save_peft_adapter

    sd = synthesize(lora["dir"], 0.08)
    target = lora["tmp"] / "adapter"
    written = save_peft_adapter(lora["model"], sd, target, metadata={"sigma_rel": "0.08"})
    assert sorted(p.name for p in target.iterdir()) == sorted(ADAPTER_FILES)
    assert len(written) == len(lora["adapter"])
    loaded = peft.PeftModel.from_pretrained(transformers_base("gpt2"), str(target))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], sd[k]) for k in lora["adapter"])
    base = transformers_base("gpt2").state_dict()
    for k, v in state.items():  # the base weights are the base model's own
        if k not in sd:
            name = k.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(v, base[name]), k
    # refusals: a missing adapter tensor, sharded values, a model that is not a PeftModel
    partial = {k: v for k, v in sd.items() if "lora_B" not in k}
    with pytest.raises(ValueError, match=r"state lacks 2 tensors of adapter 'default'.*lora_B"):
        save_peft_adapter(lora["model"], partial, lora["tmp"] / "nope")
    with pytest.raises(TypeError, match="needs the EMA of a peft PeftModel"):
        save_peft_adapter(make_model("edge"), sd, lora["tmp"] / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save_peft_adapter(peft_lora("gpt2"), sd, lora["tmp"] / "missing" / "adapter")
    assert not (lora["tmp"] / "nope").exists()


def test_predicate_track_and_a_change_of_the_tracked_set(tmp_path: Path) -> None:
    """``track=<predicate>``: only those tensors, no integer buffers; a snapshot after
    ``drop_tensors`` is not combined with the ones before it."""
    model = make_model("edge")
    ph = PostHocEMA(
        model, SIGMAS, snapshot_every=3, snapshot_dir=tmp_path, track=lambda f, t: f != "odd"
    )
    refs = [RefPowerEMA(g, [k for k in model.state_dict() if k not in ("odd", "int_buf")])
            for g in ph.gammas]  # fmt: skip
    for step in range(1, 7):
        perturb_trainable_(model, step)
        ph.update()
        for r in refs:
            r.update(model)
    first = list_snapshots(tmp_path)[0].manifest
    assert (first["track"], first["untracked"], first["followed"]) == ("predicate", ["odd"], {})
    sd = synthesize(tmp_path, 0.10)
    assert "odd" not in sd and "int_buf" not in sd
    assert all(torch.equal(sd[k], refs[1].ema[k]) for k in refs[1].ema)
    ph.emas.drop_tensors(["vec"])
    for step in range(7, 10):
        perturb_trainable_(model, step)
        ph.update()
    with pytest.raises(ValueError, match=r"track different tensors of the model .*\['vec'\]"):
        synthesize(tmp_path, 0.08)
    later = synthesize(tmp_path, 0.10, steps=[9])
    assert "vec" not in later and "odd" not in later
