"""dtensor_ema.integrations.torchtitan: torchtitan's own trainer and its EMA interface.

torchtitan's own ``Trainer`` (``--module dtensor_ema.integrations.torchtitan``): every run
builds its trainer from this package's ``config_registry`` (torchtitan's
``llama3_debugmodel`` / ``deepseek_v3_debugmodel`` with the ``ema`` section) and calls
torchtitan's ``train()``; no training loop is written for it here. The CPU switches
torchtitan needs live in ``titan_models`` (test setup, never the library).

* W=4 (one spawn): llama3 HSDP 2x2 (an ``async_mode="async"`` checkpoint at step 2, the
  final one at step 3 model-only), llama3 FSDP2 2 x TP 2 (HF export of the EMA and of the raw
  weights; the final checkpoint model-only in HF format), llama3 PP 2 x FSDP2 2 (one EMA
  per stage over the stage's mesh; HF export: each stage's part gathered, one file from
  rank 0), deepseek_v3 (MoE, ``expert_bias_E`` averaged through ``buffer_patterns``) HSDP
  2x2 with EP 2, FSDP2 2 x TP 2 with EP 2 (the experts' EMA on the ``ep`` mesh) and PP 2 x
  FSDP2 2, each with a full checkpoint at step 2.
* W=2 (one spawn): llama3 FSDP2 resumed from the W=4 HSDP step-2 checkpoint, then a
  model-only load and a load of a checkpoint without EMA; deepseek_v3 FSDP2 resumed from
  the W=4 FSDP2 x TP x EP step-2 checkpoint (each resume logged once, on rank 0); llama3
  FSDP2 (one block) with ``--compile.enable`` and with float8 (torchao ``Float8Linear``,
  emulate), the EMA checked after every step, each step-2 checkpoint resumed in one
  process into a plain model's EMA; and
  ``TorchtitanEMA`` in a hand-written loop under DDP and FSDP2 (each rank holds half of the
  EMA bytes, torchtitan's clone all of them under DDP; DCP ``save``/``load`` under the key
  ``ema`` into a fresh object resumes bit for bit).
* One process: the W=4 checkpoints' EMAs into a plain model's EMA (no process group:
  llama3 HSDP, deepseek_v3 HSDP x EP and PP x FSDP2), the EMA written beside the model-only
  final checkpoint, the HF exports (into ``transformers``' Llama; under PP against
  ``to_hf`` of the reference); ``TorchtitanEMA.step(current_step)`` against torchtitan's
  development EMA math; ``buffer_patterns``; ``load_state_dict(common_subset=True)``;
  pipeline stages.
* The command line (``torchtitan.train`` forked as ``python -m`` runs it, and its
  ``ConfigManager``): ``--help``, the ``--ema`` list flags, the warnings, and the
  refusals (a name that is no config, a config whose family did not import, torchtitan's
  own EMA on as well).

Context parallelism does not run on torchtitan's CPU path: with SDPA (FlexAttention has no
CPU backward) its default ``spmd_types`` backend refuses at build ("spmd_types + CP is not
supported with ScaledDotProductAttention or VarlenAttention. Use FlexAttention + CP or
disable CP.", ``full_dtensor`` alike), and on ``partial_dtensor`` the first forward fails
in its CP wrapper of SDPA ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered.").

Checks: every EMA equals, bit for bit, a reference written here (torchtitan's EMA rule,
``lerp`` on full tensors) fed the trained weights (by an optimizer post-hook of the test's
own for the trainer); every EMA element sits on exactly one rank; the validator's EMA loss
(logged under its own key) equals the loss of an unsharded model holding the EMA (and the
raw loss that of one holding the raw weights); checkpoints resume the EMA bit for bit at
W=2 and in one process; the HF export gives ``transformers``' logits close to torchtitan's.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_harness import require_extra, run_ranks
from titan_models import build_cpu_trainer, cpu_trainer_config, llama3_debugmodel
from torch import nn

require_extra("torchtitan", "zoo")

from dtensor_ema import load_checkpoint, save_checkpoint  # noqa: E402
from dtensor_ema.integrations.torchtitan import TorchtitanEMA  # noqa: E402
from dtensor_ema.model_keys import canonical_fqn, live_tensors  # noqa: E402

DEADLINE_S = 900.0
HSDP_DECAYS = [0.9, 0.5]
MOE_BUFFERS = ["*.expert_bias_E"]


def _titan() -> nn.Module:
    return llama3_debugmodel(layers=2, seed=0)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)  # the same batch on every rank
    tokens = torch.randint(0, 2048, (2, 8))
    logits = model(tokens).float()
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))  # fmt: skip
    loss.backward()
    opt.step()
    opt.zero_grad()


class TitanReference:
    """torchtitan's development EMA math, on full clones (written here, not imported)."""

    def __init__(self, model: nn.Module, config: TorchtitanEMA.Config, names: list[str]):
        self.c = config
        tensors = live_tensors(model)
        self.keys = [
            k
            for k, t in tensors.items()
            if (isinstance(t, nn.Parameter) and t.requires_grad)
            or any(fnmatch.fnmatch(k, p) for p in config.buffer_patterns)
        ]
        self.emas = {n: {k: _full(tensors[k]) for k in self.keys} for n in names}

    def decay(self, name: str, num_updates: int) -> float:
        if self.c.decays:
            return self.c.decays[list(self.emas).index(name)]
        fraction = self.c.half_life_fractions[list(self.emas).index(name)]
        return 2.0 ** (-1.0 / (fraction * num_updates))

    def step(self, model: nn.Module, current_step: int) -> None:
        if current_step < self.c.start_step:
            return
        elapsed = current_step - self.c.start_step
        if elapsed % self.c.update_every_n_steps != 0:
            return
        num_updates = max((elapsed + self.c.step_bias) // self.c.update_every_n_steps, 1)
        tensors = live_tensors(model)
        for name, ema in self.emas.items():
            decay = self.decay(name, num_updates)
            torch._foreach_lerp_(
                [ema[k] for k in self.keys], [_full(tensors[k]) for k in self.keys], 1.0 - decay
            )


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.clone()


def _ema_full(ema: TorchtitanEMA, name: str, keys: list[str]) -> dict[str, torch.Tensor]:
    tensors = ema[name].ema_tensors()
    return {k: _full(tensors[k]) for k in keys}


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])]


CONFIGS = {
    "half_life": TorchtitanEMA.Config(
        enable=True,
        half_life_fractions=[0.05, 0.5],
        start_step=2,
        step_bias=1,
        update_every_n_steps=2,
    ),
    "decays": TorchtitanEMA.Config(enable=True, decays=[0.5, 0.9]),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_torchtitan_ema_matches_torchtitan_math(case: str) -> None:
    config = CONFIGS[case]
    model = _titan()
    ema = TorchtitanEMA(config, model_parts=[model])
    names = list(ema)
    assert names == (["hlf_0_05", "hlf_0_5"] if case == "half_life" else ["decay_0_5", "decay_0_9"])
    reference = TitanReference(model, config, names)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 7):
        _train_step(model, opt, step)
        ema.step(step)
        reference.step(model, step)
    for name in names:
        want = reference.emas[name]
        assert all(torch.isfinite(v).all() for v in want.values())
        assert _differ(_ema_full(ema, name, reference.keys), want) == [], name
    # torchtitan's num_updates: steps 2, 4, 6 fire with num_updates 1 (clamped), 1, 2.
    assert [ema.num_updates(s) for s in range(1, 7)] == (
        [None, 1, None, 1, None, 2] if case == "half_life" else [1, 2, 3, 4, 5, 6]
    )
    # Evaluation through the first EMA: the model holds it, then its own weights again.
    raw = {k: v.detach().clone() for k, v in live_tensors(model).items()}
    with ema.average_parameters() as swapped:
        assert swapped == [model]
        inside = live_tensors(model)
        assert _differ(dict(inside), reference.emas[names[0]]) == []
    assert _differ(dict(live_tensors(model)), raw) == []


def test_torchtitan_ema_buffer_patterns_and_disabled() -> None:
    model = _titan()
    buffers = [k for k, t in live_tensors(model).items() if not isinstance(t, nn.Parameter)]
    model.register_buffer("running_bias", torch.zeros(4))  # an averaged buffer
    model.register_buffer("other_stat", torch.zeros(4))  # a buffer that follows the model
    config = TorchtitanEMA.Config(enable=True, decays=[0.5], buffer_patterns=["running_*"])
    ema = TorchtitanEMA(config, model_parts=model)
    reference = TitanReference(model, config, list(ema))
    assert "running_bias" in reference.keys and "other_stat" not in reference.keys
    for step in range(1, 3):
        with torch.no_grad():
            model.running_bias += 1.0
            model.other_stat += 1.0
        ema.step(step)
        reference.step(model, step)
    got = ema["decay_0_5"].ema_tensors()
    assert torch.equal(got["running_bias"], reference.emas["decay_0_5"]["running_bias"])
    assert torch.equal(got["running_bias"], torch.full((4,), 1.25))  # lerp of 1 then 2
    # Follows the model: neither stored nor averaged; whole state dicts read the model's.
    assert "other_stat" not in got and "other_stat" in ema["decay_0_5"].untracked
    whole = ema["decay_0_5"].get_ema_state_dict(include_untracked=True)
    assert torch.equal(whole["other_stat"], model.other_stat)
    # TorchtitanEMA's own dict is whole by default (what export_hf writes).
    titan_whole = ema.get_ema_state_dict("decay_0_5")
    assert set(titan_whole) == set(model.state_dict())
    assert torch.equal(titan_whole["other_stat"], model.other_stat)
    del buffers

    off = TorchtitanEMA(TorchtitanEMA.Config(enable=False), model_parts=[model])
    off.step(5)
    assert len(off) == 0 and off.state_dict() == {}
    off.load_state_dict({})
    with pytest.raises(ValueError, match="decays must lie in"):
        TorchtitanEMA.Config(enable=True, decays=[1.5])
    with pytest.raises(ValueError, match="update_every_n_steps must be >= 1, got 0"):
        TorchtitanEMA.Config(enable=True, update_every_n_steps=0)
    with pytest.raises(ValueError, match="model parts 0 and 1 both hold"):
        TorchtitanEMA(config, model_parts=[model, model])
    with pytest.raises(ValueError, match="model_parts is empty"):
        TorchtitanEMA(config, model_parts=[])


def test_torchtitan_ema_load_state_dict_common_subset() -> None:
    """``load_state_dict(..., common_subset=True)`` as ``ModelEMA``'s: a state saved with
    another tracked set (other ``buffer_patterns``, a parameter frozen then and one frozen
    now) loads the tensors both hold bit for bit, leaves this EMA's others as they were,
    loads the counter; without it, refused naming the difference; EMA names must match
    and at least one tensor must be common. And the pairing of fused/unfused Q/K/V
    projections of the trainer's checkpoint load, on fqns."""
    model = _titan()
    model.register_buffer("running_bias", torch.zeros(4))
    model.norm.weight.requires_grad_(False)  # frozen when saved: not in the state
    saved_config = TorchtitanEMA.Config(enable=True, decays=[0.5], buffer_patterns=["running_*"])
    before = TorchtitanEMA(saved_config, model_parts=[model])
    with torch.no_grad():
        for t in [*model.parameters(), model.running_bias]:
            t.add_(1.0)
    before.step(1)
    saved = {
        name: {**state, "ema": {k: v.detach().clone() for k, v in state["ema"].items()}}
        for name, state in before.state_dict().items()
    }
    assert "running_bias" in saved["decay_0_5"]["ema"]
    assert "norm.weight" not in saved["decay_0_5"]["ema"]

    model.norm.weight.requires_grad_(True)
    model.tok_embeddings.weight.requires_grad_(False)  # frozen now: the saved one is ignored
    with torch.no_grad():
        for t in model.parameters():
            t.add_(1.0)
    now = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=[0.5]), model_parts=[model])
    mine = {k: v.detach().clone() for k, v in now["decay_0_5"].ema_tensors().items()}
    with pytest.raises(ValueError, match=r"resuming would not continue.*common_subset=True"):
        now.load_state_dict(saved)
    now.load_state_dict(saved, common_subset=True)
    got = {k: v.detach().clone() for k, v in now["decay_0_5"].ema_tensors().items()}
    common = set(got) & set(saved["decay_0_5"]["ema"])
    assert "norm.weight" not in common and "layers.0.attention.wo.weight" in common
    assert _differ(got, {k: saved["decay_0_5"]["ema"][k] for k in common}) == []
    assert _differ(got, {k: v for k, v in mine.items() if k not in common}) == []
    assert now["decay_0_5"].updates == 1

    other_config = TorchtitanEMA.Config(enable=True, decays=[0.9])
    other_names = TorchtitanEMA(other_config, model_parts=[model])
    with pytest.raises(ValueError, match="checkpoint EMAs"):
        other_names.load_state_dict(saved, common_subset=True)
    disjoint = {"decay_0_5": {**saved["decay_0_5"], "ema": {"elsewhere.weight": torch.zeros(2)}}}
    with pytest.raises(ValueError, match="share no tensor"):
        now.load_state_dict(disjoint, common_subset=True)
    assert _differ(now["decay_0_5"].ema_tensors(), got) == []  # refused: unchanged

    from dtensor_ema.integrations.torchtitan.qkv import find_conversions

    fused = {"layers.0.attention.qkv_linear.wqkv.weight", "layers.0.attention.wo.weight"}
    unfused = {f"layers.0.attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")}
    unfused.add("layers.0.attention.wo.weight")
    module = model.layers["0"].attention.qkv_linear  # fused: head_dim 16, 1 query head per KV
    modules = {"layers.0.attention.qkv_linear": module}
    (split,) = find_conversions(saved=fused, ours=unfused, modules=modules)
    assert split.saved == ("layers.0.attention.qkv_linear.wqkv.weight",) and not split.fuses
    assert (split.head_dim, split.heads_per_kv) == (16, 1)
    (fuse,) = find_conversions(saved=unfused, ours=fused, modules=modules)
    assert fuse.fuses and fuse.ours == split.saved
    assert find_conversions(fused, fused, modules) == []
    assert find_conversions(fused, {"x"}, {}) == []


def test_iter_state_dict_streams_bucket_by_bucket(tmp_path: Path) -> None:
    """What the streamed HF export reads: ``ModelEMA.iter_state_dict`` gives the EMA's
    whole state dict (the model's hooks applied: ``wq``/``wk``/``wv`` of the fused
    ``wqkv``) in pieces of at most ``bucket_bytes`` of full tensors, a larger tensor alone,
    a fused ``wqkv``'s three outputs in one piece; and ``stream_hf`` writes, with a
    bucket far below the model, the file ``export_hf`` writes from the whole dict."""
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import model_registry

    from dtensor_ema.integrations.torchtitan import export_hf
    from dtensor_ema.integrations.torchtitan.hf import stream_hf

    model = _titan()
    ema = _perturbed_ema(model, TorchtitanEMA.Config(enable=True, decays=[0.9]))
    whole = ema.get_ema_state_dict()
    bucket = 200_000
    pieces = list(ema["decay_0_9"].iter_state_dict(bucket_bytes=bucket))
    assert len(pieces) > 5
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        nbytes = sum(v.numel() * v.element_size() for v in piece.values())
        assert nbytes <= bucket or len({k.rsplit(".", 2)[0] for k in piece}) == 1, list(piece)
        assert not set(piece) & set(merged)
        merged.update(piece)
    assert list(merged) == list(whole) and _differ(merged, whole) == []
    wq = "layers.0.attention.qkv_linear.wq.weight"
    (with_q,) = [p for p in pieces if wq in p]
    assert {wq.replace("wq", w) for w in ("wk", "wv")} <= set(with_q)
    spec = model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    streamed = load_file(stream_hf(ema, [model], adapter, tmp_path / "s", bucket_bytes=bucket))
    written = load_file(export_hf(whole, adapter, tmp_path / "w"))
    assert streamed.keys() == written.keys() and _differ(streamed, written) == []


def _perturbed_ema(model: nn.Module, config: TorchtitanEMA.Config) -> TorchtitanEMA:
    """An EMA of ``model`` one step away from its weights (weights moved, then a step)."""
    ema = TorchtitanEMA(config, model_parts=[model])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    ema.step(1)
    return ema


def _load_converting(ema: TorchtitanEMA, path: Path) -> int:
    """DCP's load of ``path`` into ``ema`` as the trainer's checkpoint manager does it:
    through ``EMALoad``, then its conversion."""
    from dtensor_ema.checkpoint.reader import open_checkpoint
    from dtensor_ema.integrations.torchtitan.resume import EMALoad

    load = EMALoad(ema, open_checkpoint(path))
    dcp.load({"ema": load}, checkpoint_id=str(path))
    return load.convert(None)


def test_qkv_resume_converts_the_ema_both_ways(tmp_path: Path) -> None:
    """The EMA of torchtitan's fused qwen3 debugmodel (``wqkv``: 16 query heads over 8 KV
    heads, head_dim 128) saved with DCP and read into the EMA of its
    ``debugmodel_non_fused_qkv`` (``wq``/``wk``/``wv``), and the other way, as the trainer's
    checkpoint manager reads it: every converted projection equals, bit for bit, what
    torchtitan's own ``FusedQKVLinear`` hooks give for the same values (its
    ``state_dict()`` splits, its ``load_state_dict()`` fuses), every other tensor and the
    counter load as saved; a projection whose head layout the model does not tell is
    refused, naming the way out."""
    from titan_models import qwen3_debugmodel

    from dtensor_ema.checkpoint.reader import open_checkpoint
    from dtensor_ema.integrations.torchtitan.resume import EMALoad

    config = TorchtitanEMA.Config(enable=True, decays=[0.9])
    fused, unfused = qwen3_debugmodel(seed=0), qwen3_debugmodel(fused=False, seed=1)

    # fused -> unfused
    saved = _perturbed_ema(fused, config)
    dcp.save({"ema": saved}, checkpoint_id=str(tmp_path / "fused"))
    with torch.no_grad():  # torchtitan's own split of the EMA's values: the reference
        for name, p in fused.named_parameters():
            p.copy_(saved["decay_0_9"].ema_tensors()[canonical_fqn(name)])
    want = fused.state_dict()
    into = TorchtitanEMA(config, model_parts=[unfused])
    assert _load_converting(into, tmp_path / "fused") == 2  # the wqkv weight of 2 layers
    got = into["decay_0_9"].ema_tensors()
    assert "layers.1.attention.qkv_linear.wk.weight" in got
    assert _differ(got, {k: want[k] for k in got}) == [] and into["decay_0_9"].updates == 1

    # unfused -> fused
    saved = _perturbed_ema(unfused, config)
    dcp.save({"ema": saved}, checkpoint_id=str(tmp_path / "unfused"))
    with torch.no_grad():
        for name, p in unfused.named_parameters():
            p.copy_(saved["decay_0_9"].ema_tensors()[canonical_fqn(name)])
    reference = qwen3_debugmodel(seed=2)
    reference.load_state_dict(unfused.state_dict())  # torchtitan's fuse
    want = {canonical_fqn(k): v for k, v in reference.named_parameters()}
    into = TorchtitanEMA(config, model_parts=[qwen3_debugmodel(seed=3)])
    assert _load_converting(into, tmp_path / "unfused") == 2
    got = into["decay_0_9"].ema_tensors()
    assert "layers.0.attention.qkv_linear.wqkv.weight" in got
    assert _differ(got, {k: want[k].detach() for k in got}) == []

    # No head layout to read: refused before anything is read.
    for module in unfused.modules():
        if type(module).__name__ == "QKVLinear":
            del module.head_dim
    with pytest.raises(ValueError, match=r"wqkv.weight and this model .*wq.weight.*cannot be read"):
        EMALoad(TorchtitanEMA(config, model_parts=[unfused]), open_checkpoint(tmp_path / "fused"))


def test_torchtitan_ema_pipeline_stages_save_one_layout(tmp_path: Path) -> None:
    """Two pipeline stages (torchtitan's own ``_split_module``) in one process, trained as a
    chain: each stage's EMAs equal the reference; the saved state does not depend on the
    split (a checkpoint of the two stages loads bit for bit into the whole model's EMA);
    ``average_parameters`` swaps every stage; ``reset`` restarts from the weights; a resume
    with other ``buffer_patterns`` is refused."""
    from torchtitan.distributed.pipeline_parallel import _split_module

    whole = _titan()
    stages = [
        _split_module(whole, ["tok_embeddings", "layers.0"]),
        _split_module(whole, ["layers.1", "norm", "lm_head"]),
    ]
    config = TorchtitanEMA.Config(enable=True, decays=[0.5, 0.9])
    ema = TorchtitanEMA(config, model_parts=stages)
    assert len(ema.parts) == 2 and list(ema) == ["decay_0_5", "decay_0_9"]
    with pytest.raises(ValueError, match="tracks 2 model parts"):
        ema["decay_0_5"]
    references = [TitanReference(stage, config, list(ema)) for stage in stages]
    opt = torch.optim.AdamW([p for stage in stages for p in stage.parameters()], lr=1e-2)
    for step in range(1, 4):
        torch.manual_seed(100 + step)
        tokens = torch.randint(0, 2048, (2, 8))
        logits = stages[1](stages[0](tokens)).float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           tokens[:, 1:].reshape(-1))  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.step(step)
        for stage, reference in zip(stages, references, strict=True):
            reference.step(stage, step)
    want = {n: {k: v for r in references for k, v in r.emas[n].items()} for n in ema}
    keys = sorted(want["decay_0_5"])
    assert set(keys) == {k for k, p in whole.named_parameters()}
    for part, reference in zip(ema.parts, references, strict=True):
        for name in ema:
            assert _differ(part[name].ema_tensors(), reference.emas[name]) == [], name

    dcp.save({"ema": ema}, checkpoint_id=str(tmp_path / "stages"))
    single = TorchtitanEMA(config, model_parts=[whole])
    dcp.load({"ema": single}, checkpoint_id=str(tmp_path / "stages"))
    for name in single:
        assert _differ(_ema_full(single, name, keys), want[name]) == [], name
        merged = ema.get_ema_state_dict(name)
        assert merged.keys() == single.get_ema_state_dict(name).keys()
    assert single["decay_0_5"].updates == 3

    raw = {k: v.detach().clone() for stage in stages for k, v in live_tensors(stage).items()}
    with ema.average_parameters("decay_0_9") as parts:
        assert parts == stages
        inside = {k: v for stage in stages for k, v in live_tensors(stage).items()}
        assert _differ(inside, want["decay_0_9"]) == []
    after = {k: v for stage in stages for k, v in live_tensors(stage).items()}
    assert _differ(after, raw) == []

    other = TorchtitanEMA(
        TorchtitanEMA.Config(enable=True, decays=[0.5, 0.9], buffer_patterns=["*.bias_E"]),
        model_parts=[whole],
    )
    with pytest.raises(ValueError, match="resuming would not continue"):
        other.load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="checkpoint EMAs"):
        TorchtitanEMA(TorchtitanEMA.Config(enable=True), model_parts=[whole]).load_state_dict(
            ema.state_dict()
        )
    ema.reset()
    for name in ema:
        assert _differ({k: v for p in ema.parts for k, v in p[name].ema_tensors().items()},
                       raw) == []  # fmt: skip


def test_the_package_imports_without_torchtitan() -> None:
    """``TorchtitanEMA`` and ``export_hf`` are torchtitan-free: importing the package
    imports no torchtitan (its ``config_registry`` and ``trainer`` submodules do)."""
    import subprocess
    import sys

    code = (
        "import sys, dtensor_ema.integrations.torchtitan as t; "
        "assert t.TorchtitanEMA and t.export_hf; "
        "assert not [m for m in sys.modules if m.startswith('torchtitan')], 'torchtitan'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _no_addresses(value: Any) -> str:
    import re

    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def test_config_registry_wraps_torchtitans_configs() -> None:
    """Every config function of the registry returns its torchtitan namesake's config
    unchanged (``to_dict()``) plus an enabled ``ema`` section, refuses a config that is not
    torchtitan's plain ``Trainer.Config`` (flux, kimi) with a ``TypeError`` naming it, and
    lets torchtitan's own errors (a missing torchao) through as they are."""
    import importlib

    from torchtitan.trainer import Trainer

    from dtensor_ema.integrations.torchtitan import config_registry
    from dtensor_ema.integrations.torchtitan.trainer import (
        EMACheckpointManager,
        EMATrainer,
        EMAValidator,
    )

    accepted, refused = [], []
    for name, source in config_registry.SOURCES.items():
        module, _, function = source.rpartition(".")
        try:
            theirs = getattr(importlib.import_module(module), function)()
        except Exception as error:  # torchtitan's own refusal: ours must be the same
            with pytest.raises(type(error)):
                getattr(config_registry, name)()
            continue
        if type(theirs) is not Trainer.Config:
            with pytest.raises(TypeError, match=f"{function} is a .*{type(theirs).__name__}"):
                getattr(config_registry, name)()
            refused.append(name)
            continue
        ours = getattr(config_registry, name)()
        assert type(ours) is EMATrainer.Config, name
        assert isinstance(ours.validator, EMAValidator.Config), name
        assert isinstance(ours.checkpoint, EMACheckpointManager.Config), name
        assert ours.ema == TorchtitanEMA.Config(enable=True), name
        mine = ours.to_dict()
        assert mine.pop("ema")["enable"] is True
        # to_dict() writes callables as their repr: closures built per call differ by address
        assert _no_addresses(mine) == _no_addresses(theirs.to_dict()), name
        accepted.append(name)
    assert {"llama3_debugmodel", "llama3_8b", "qwen3_0_6b", "deepseek_v3_16b"} <= set(accepted)
    assert {"gpt_oss_20b", "gpt_oss_debugmodel"} <= set(accepted)
    assert {"flux_debugmodel", "kimi_k2_5_debugmodel"} <= set(refused)
    assert "enable_fused_swiglu" not in config_registry.SOURCES  # takes an argument


def test_export_hf_refuses_what_to_hf_would_drop(tmp_path: Path) -> None:
    """``export_hf`` through torchtitan's Llama adapter: the EMA's own canonical fqns (the
    fused ``wqkv``, which ``to_hf`` skips silently) are refused before anything is written;
    the model's keys (``get_ema_state_dict()``) are written, cast, and map back whole."""
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import model_registry

    from dtensor_ema.integrations.torchtitan import export_hf

    model = _titan()
    ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=[0.9]), model_parts=[model])
    spec = model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    internal = {k: v.detach() for k, v in ema["decay_0_9"].ema_tensors().items()}
    with pytest.raises(ValueError, match=r"to_hf drops 2 of \d+ keys.*qkv_linear\.wqkv"):
        export_hf(internal, adapter, tmp_path / "internal")
    assert not (tmp_path / "internal").exists()
    full = ema.get_ema_state_dict()
    path = export_hf(full, adapter, tmp_path / "hf", dtype=torch.bfloat16)
    written = load_file(path)
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    back = adapter.from_hf(dict(written))
    assert back.keys() == full.keys()
    wv = "layers.1.attention.qkv_linear.wv.weight"  # not permuted: the cast values
    assert torch.equal(back[wv], full[wv].to(torch.bfloat16))


# ------------------------------------------------------------------ the command line
TESTS = Path(__file__).resolve().parent
OURS = ["--module", "dtensor_ema.integrations.torchtitan"]
NO_EFFECT = "initial_load_model_only=True has no effect"

_ENTRY = """
import runpy, sys
hidden = [m for m in sys.argv.pop(1).split(",") if m]
for name in [n for n in sys.modules if n.split(".")[0] in hidden]:
    del sys.modules[name]
for name in hidden:  # as if the package were not installed
    sys.modules[name] = None
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def _titan_cli(
    tmp_path: Path, entry: str, *args: str, hide: tuple[str, ...] = ()
) -> tuple[int, str]:
    """``python -m <entry> args`` (torchtitan's ``torchtitan.train`` or its
    ``torchtitan.config.manager``), forked from the rank server with this checkout and
    ``tests/`` on the path, the packages ``hide`` made unimportable; ``(exit code, output)``
    with the whitespace and ``--help``'s box borders collapsed."""
    import os

    from dist_harness import run_script

    script = tmp_path / "entry.py"
    script.write_text(_ENTRY)
    env = dict(os.environ, COLUMNS="200", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    code, out, _ = run_script(
        [str(script), ",".join(hide), entry, *args], tmp_path, env, merge_output=True
    )
    return code, " ".join(out.replace("│", " ").split())


def test_command_line_help_and_list_flags(tmp_path: Path) -> None:
    """``--help`` states the real default (one EMA ``hlf_0_05``) and the comma-separated
    list convention of torchtitan's own ``list[str]`` flags for every ``--ema`` list flag,
    and warns no more often than torchtitan's own ``--help``; torchtitan's config printer
    (``python -m torchtitan.config.manager``) parses those flags as documented too."""
    config = ["--config", "llama3_debugmodel"]
    code, ours = _titan_cli(tmp_path, "torchtitan.train", *OURS, *config, "--help")
    assert code == 0, ours[-3000:]
    assert "The sharded EMA, on by default: one EMA, ``hlf_0_05``" in ours, ours[-3000:]
    assert "--ema.decays 0.999 " not in ours.replace("--ema.decays 0.999,", "")
    for flag in ("decays", "half-life-fractions", "buffer-patterns"):
        assert f"--ema.{flag} A,B,C,..." in ours, (flag, ours[-3000:])
    assert "--checkpoint.exclude-from-loading A,B,C,..." in ours  # torchtitan's own rule
    code, theirs = _titan_cli(tmp_path, "torchtitan.train", "--module", "llama3", *config, "--help")
    assert code == 0, theirs[-3000:]
    counts = (ours.count(NO_EFFECT), theirs.count(NO_EFFECT))
    assert counts[0] == counts[1] >= 1, counts

    flags = ["--ema.decays", "0.9,0.5", "--ema.buffer_patterns", "*.a,*.b"]
    code, parsed = _titan_cli(tmp_path, "torchtitan.config.manager", *OURS, *config, *flags,
                              "--ema.half_life_fractions", "0.1,0.2")  # fmt: skip
    assert code == 0, parsed[-3000:]  # torchtitan's config printer parses them the same way
    assert "decays=[0.9, 0.5], half_life_fractions=[0.1, 0.2]" in parsed, parsed[-3000:]
    assert "buffer_patterns=['*.a', '*.b']" in parsed, parsed[-3000:]


def test_parsing_flags_and_warnings_as_torchtitan() -> None:
    """torchtitan's ``ConfigManager.parse_args`` (what ``torchtitan.train`` runs on the
    command line): the ``--ema`` list flags take one comma-separated value each, as
    documented; the space-separated form is refused as torchtitan refuses it for its own
    list flags; and the parse, with the copy ``config.build()`` makes, logs each of
    torchtitan's config warnings as often for our module as for torchtitan's own
    (``with_ema`` re-runs no config's checks)."""
    import logging
    from dataclasses import replace as dataclass_replace

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger as titan_logger

    config = ["--config", "llama3_debugmodel"]
    flags = ["--ema.decays", "0.9,0.5", "--ema.half_life_fractions", "0.1,0.2",
             "--ema.buffer_patterns", "*.a,*.b"]  # fmt: skip
    parsed = ConfigManager().parse_args([*OURS, *config, *flags])
    assert parsed.ema.decays == [0.9, 0.5] and parsed.ema.half_life_fractions == [0.1, 0.2]
    assert parsed.ema.buffer_patterns == ["*.a", "*.b"]
    assert ConfigManager().parse_args([*OURS, *config, "--ema.decays", ""]).ema.decays == []
    for spaced in (["--ema.decays", "0.9", "0.5"], ["--ema.buffer_patterns", "*.a", "*.b"]):
        with pytest.raises(SystemExit):
            ConfigManager().parse_args([*OURS, *config, *spaced])

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    def warnings(module: list[str]) -> list[str]:
        messages.clear()
        handler = Keep()
        titan_logger.addHandler(handler)
        try:
            config = ConfigManager().parse_args([*module, "--config", "llama3_debugmodel"])
            dataclass_replace(config)  # what Configurable.build() does before building
        finally:
            titan_logger.removeHandler(handler)
        return sorted(messages)

    ours, theirs = warnings(OURS), warnings(["--module", "llama3"])
    assert any(NO_EFFECT in m for m in theirs), theirs
    assert ours == theirs


def test_command_line_refusals(tmp_path: Path) -> None:
    """What ``torchtitan.train`` says to a config name that is not a config
    (``with_ema``: torchtitan's list of available configs holds the configs only), to a
    config whose family's registry did not import (``flux_debugmodel`` without
    ``transformers``: which import failed), and to a config with torchtitan's own EMA on
    as well (``ema_weights``, refused before anything is built)."""
    from dtensor_ema.integrations.torchtitan import config_registry

    code, out = _titan_cli(tmp_path, "torchtitan.train", *OURS, "--config", "with_ema")
    assert code != 0 and "Config function 'with_ema' not found" in out, out[-3000:]
    listed = out.split("Available config functions: ", 1)[1]
    names = set(re.findall(r"'(\w+)'", listed[: listed.index("]")]))
    assert names == set(config_registry.SOURCES), sorted(names ^ set(config_registry.SOURCES))

    code, out = _titan_cli(tmp_path, "torchtitan.train", *OURS, "--config", "flux_debugmodel",
                           hide=("transformers",))  # fmt: skip
    assert code != 0, out[-3000:]
    assert "ImportError: config 'flux_debugmodel' is unavailable: " in out, out[-3000:]
    assert "torchtitan.models.flux.config_registry" in out and "transformers" in out
    assert "not found" not in out

    both = ["--module", "titan_their_ema", "--config", "llama3_debugmodel"]
    code, out = _titan_cli(tmp_path, "torchtitan.train", *both)
    assert code != 0, out[-3000:]
    refusal = "ValueError: two EMAs are enabled: torchtitan's own (ema_weights.enable"
    assert refusal in out, out[-3000:]
    assert "--ema_weights.no-enable keeps dtensor_ema's, --ema.no-enable keeps" in out
    assert "init_distributed" not in out.split("Traceback", 1)[-1]  # before anything is built


def test_two_emas_refused_by_the_config_alone() -> None:
    """The refusal is the trainer's first act (no process group needed); either EMA alone
    is accepted by the check (torchtitan's own with ``ema.enable`` off)."""
    from titan_their_ema import llama3_debugmodel

    config = llama3_debugmodel()
    with pytest.raises(ValueError, match="two EMAs are enabled"):
        config.build()
    from dtensor_ema.integrations.torchtitan.trainer import _refuse_two_emas

    config.ema.enable = False
    _refuse_two_emas(config)
    config.ema.enable, config.ema_weights.enable = True, False
    _refuse_two_emas(config)


# ------------------------------------------------------------------ hand-written loop, W=2
def _hand_loop(world_size: int, root: str) -> dict[str, Any]:
    """TorchtitanEMA in a hand-written loop under DDP and FSDP2, saved and resumed by DCP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = TorchtitanEMA.Config(enable=True, half_life_fractions=[0.05, 0.5])
    out: dict[str, Any] = {}
    for wrapper in ("ddp", "fsdp"):
        model = _titan()
        if wrapper == "fsdp":
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            trained: nn.Module = model
        else:
            trained = DDP(model)
        ema = TorchtitanEMA(config, model_parts=[model])
        reference = TitanReference(model, config, list(ema))
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        for step in range(1, 3):
            _train_step(trained, opt, step)
            ema.step(step)
            reference.step(model, step)
        total = sum(v.numel() * v.element_size() for v in reference.emas["hlf_0_05"].values())
        # torchtitan's clone: every parameter's local tensor, per EMA.
        clone = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            for p in model.parameters()
        )
        path = Path(root) / wrapper
        dcp.save({"ema": ema}, checkpoint_id=str(path))
        fresh = TorchtitanEMA(config, model_parts=[model])
        dcp.load({"ema": fresh}, checkpoint_id=str(path))
        for step in range(3, 5):
            _train_step(trained, opt, step)
            for e in (ema, fresh):
                e.step(step)
            reference.step(model, step)
        out[wrapper] = {
            "bytes": ema["hlf_0_05"].local_nbytes(),
            "total": total,
            "clone": clone,
            "ema": [_differ(_ema_full(ema, n, reference.keys), reference.emas[n]) for n in ema],
            "resumed": [
                _differ(_ema_full(fresh, n, reference.keys), reference.emas[n]) for n in fresh
            ],
            "checkpoint_keys": sorted(ema.state_dict()),
        }
    dist.barrier()
    return out


# ------------------------------------------------------------------ the reference (ours)
class TrainerReference:
    """torchtitan's EMA rule on full tensors, written here: after every optimizer step (a
    post-hook registered after the trainer's), the trained weights are gathered and each EMA
    is ``lerp_``-ed towards them on the steps the rule fires. Collective (gathers)."""

    def __init__(self, trainer: Any) -> None:
        import fnmatch

        self.trainer = trainer
        self.c = trainer.config.ema
        self.names = list(trainer.ema.names)
        self.keys: list[str] = []
        for part in trainer.model_parts:
            for name, p in part.named_parameters():
                if p.requires_grad:
                    self.keys.append(canonical_fqn(name))
            for name, _ in part.named_buffers():
                fqn = canonical_fqn(name)
                if any(fnmatch.fnmatch(fqn, pattern) for pattern in self.c.buffer_patterns):
                    self.keys.append(fqn)
        start = self.weights()
        self.emas = {n: {k: v.clone() for k, v in start.items()} for n in self.names}
        self.snapshots: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self.weights_at: dict[int, dict[str, torch.Tensor]] = {}
        self.fired: list[int] = []
        trainer.optimizers.register_step_post_hook(lambda *args, **kwargs: self.step())

    def weights(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for part in self.trainer.model_parts:
            for name, t in [*part.named_parameters(), *part.named_buffers()]:
                if canonical_fqn(name) in self.keys:
                    tensors[canonical_fqn(name)] = t
        return {k: _full(tensors[k]) for k in self.keys}

    def decay(self, index: int, num_updates: int) -> float:
        if self.c.decays:
            return self.c.decays[index]
        return 2.0 ** (-1.0 / (self.c.half_life_fractions[index] * num_updates))

    @torch.no_grad()
    def step(self) -> None:
        step = self.trainer.step
        weights = self.weights()
        elapsed = step - self.c.start_step
        if step >= self.c.start_step and elapsed % self.c.update_every_n_steps == 0:
            self.fired.append(step)
            num_updates = max((elapsed + self.c.step_bias) // self.c.update_every_n_steps, 1)
            for i, name in enumerate(self.names):
                weight = 1.0 - self.decay(i, num_updates)
                for k in self.keys:
                    self.emas[name][k].lerp_(weights[k], weight)
        self.snapshots[step] = {
            n: {k: v.clone() for k, v in e.items()} for n, e in self.emas.items()
        }
        self.weights_at[step] = weights


def _trainer_ema_full(trainer: Any, name: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """EMA ``name`` of every local part as full tensors (collective over each EMA's mesh)."""
    out: dict[str, torch.Tensor] = {}
    for emas in trainer.ema.parts:
        for k, t in emas[name].ema_tensors().items():
            if k in keys:
                out[k] = _full(t)
    return out


# ------------------------------------------------------------------ validation, unsharded
def _plain_model(trainer: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """An unsharded model of the trainer's config holding ``state`` (model keys)."""
    with torch.device("meta"):
        model = trainer.model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def _validation_loss(trainer: Any, model: nn.Module) -> float:
    """The validator's loss recomputed in one process: each data-parallel rank's first
    validation batch (torchtitan's validation dataloader, rebuilt per rank), summed
    next-token cross-entropy over the valid tokens of all of them."""
    v = trainer.config.validator
    dims = trainer.parallel_dims
    dp = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    loader = replace(v.dataloader, infinite=v.steps != -1)
    total, tokens = 0.0, 0
    for rank in range(dp):
        batches = loader.build(
            dp_world_size=dp,
            dp_rank=rank,
            tokenizer=trainer.tokenizer,
            seq_len=trainer.config.training.seq_len,
            local_batch_size=trainer.config.training.local_batch_size,
        )
        input_dict, labels = next(iter(batches))
        extra = {k: t for k, t in input_dict.items() if k != "input"}
        logits = model(input_dict["input"], **extra).float()
        total += float(
            F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
            )
        )
        tokens += int((labels != -100).sum())
    return total / tokens


def _check_validation(trainer: Any) -> dict[str, Any]:
    """The validator's last losses and the unsharded ones (computed on rank 0; every rank
    takes part in the gathers)."""
    raw_state = {k: _full(v) for k, v in trainer.model_parts[0].state_dict().items()}
    ema_states = {n: trainer.ema.get_ema_state_dict(n, cpu_offload=True) for n in trainer.ema}
    out: dict[str, Any] = {"logged": dict(trainer.validator.last_losses)}
    if dist.get_rank() == 0:
        model = _plain_model(trainer, raw_state)
        out["unsharded"] = {"raw": _validation_loss(trainer, model)}
        for name, state in ema_states.items():
            model.load_state_dict(state)
            out["unsharded"][name] = _validation_loss(trainer, model)
    return out


# ------------------------------------------------------------------ one run
def _config(root: Path, model: str, **kw: Any) -> Any:
    from dtensor_ema.integrations.torchtitan import config_registry

    config = getattr(config_registry, f"{model}_debugmodel")()
    return cpu_trainer_config(config, root, **kw)


def _logged(trainer: Any) -> list[tuple[int, dict[str, float]]]:
    """Record what the trainer's metrics logger receives (rank 0's is torchtitan's)."""
    calls: list[tuple[int, dict[str, float]]] = []
    logger = trainer.metrics_processor.logger
    original = logger.log

    def log(metrics: dict[str, Any], step: int) -> None:
        calls.append((step, {k: v for k, v in metrics.items() if "loss" in k}))
        original(metrics, step)

    logger.log = log
    return calls


def _train(trainer: Any) -> dict[str, Any]:
    """torchtitan's ``train()``; the checks every run shares."""
    reference = TrainerReference(trainer)
    calls = _logged(trainer)
    trainer.train()
    names = trainer.ema.names
    parts = trainer.ema.parts
    return {
        "differ": {
            n: _differ(_trainer_ema_full(trainer, n, reference.keys), reference.emas[n])
            for n in names
        },
        "moved": {
            n: _differ(reference.snapshots[min(reference.snapshots)][n], reference.emas[n]) != []
            for n in names
        },
        "fired": reference.fired,
        "local_numel": sum(e.local_numel() for emas in parts for e in emas.values()) // len(names),
        "model_numel": sum(v.numel() for v in reference.emas[names[0]].values()),
        "stage": trainer.parallel_dims.get_mesh("pp").get_local_rank()
        if trainer.parallel_dims.pp_enabled
        else 0,
        "parts": len(parts),
        "keys": sorted(reference.keys),
        "validation_logs": [(s, m) for s, m in calls if any("ema_loss" in k for k in m)],
        "reference": reference,
    }


def _no_sleep() -> None:
    """torchtitan's ``train()`` ends with rank 0 sleeping 2 s; not here (test speed)."""
    import time

    import torchtitan.trainer as titan_trainer

    class _Time:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            pass

    titan_trainer.time = _Time()  # type: ignore[assignment]


# ------------------------------------------------------------------ W=4
def _w4_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    _no_sleep()
    base = Path(root)
    out: dict[str, Any] = {}

    # llama3 HSDP 2x2: an async checkpoint at step 2, a model-only one at 3, validation at 3.
    config = _config(base / "hsdp", "llama3", replicate=2, shard=2, steps=3,
                     validate_every=3, checkpoint_every=2)  # fmt: skip
    config.ema.decays = list(HSDP_DECAYS)
    config.checkpoint.async_mode = "async"
    config.checkpoint.last_save_model_only = True
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run["validation"] = _check_validation(trainer)
    reference = run.pop("reference")
    if rank == 0:
        saved = {"ema": reference.snapshots, "weights": reference.weights_at}
        torch.save(saved, base / "hsdp" / "reference.pt")
    run["ema_folder"] = trainer.checkpointer.ema_checkpoint_id(3, "decay_0_9")
    trainer.close()
    out["llama_hsdp"] = run

    # llama3 FSDP2 2 x TP 2: half-life EMA from step 2; HF export of the EMA and raw weights,
    # and a final model-only checkpoint in HF format (the EMA beside it, the same way).
    config = _config(base / "tp", "llama3", shard=2, tp=2, steps=3, validate_every=3,
                     checkpoint_every=10)  # fmt: skip
    config.checkpoint.last_save_model_only = True
    config.checkpoint.last_save_in_hf = True
    config.ema.decays = []
    config.ema.half_life_fractions = [0.5]
    config.ema.start_step = 2
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run["validation"] = _check_validation(trainer)
    run.pop("reference")
    trainer.export_hf(base / "tp" / "hf_ema", name="hlf_0_5")
    trainer.export_hf(base / "tp" / "hf_raw", raw=True)
    ema_state = trainer.ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
    raw_state = {k: _full(v) for k, v in trainer.model_parts[0].state_dict().items()}
    if rank == 0:
        torch.save({"ema": ema_state, "raw": raw_state}, base / "tp" / "states.pt")
    trainer.close()
    out["llama_tp"] = run

    # llama3 PP 2 x FSDP2 2: one EMA per stage, over the stage's own 2-rank mesh; the HF
    # export gathers each stage's part, rank 0 writes one file.
    config = _config(base / "pp", "llama3", pp=2, shard=2, steps=2, checkpoint_every=2)
    config.ema.decays = [0.9]
    config.checkpoint.last_save_model_only = False  # a full one at step 2, with the EMA
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    reference = run.pop("reference")
    run["ema_mesh"] = [e.mesh.size() for emas in trainer.ema.parts for e in emas.values()]
    run["hf_file"] = str(trainer.export_hf(base / "pp" / "hf_ema", bucket_bytes=100_000))
    torch.save(reference.emas["decay_0_9"], base / "pp" / f"reference{rank}.pt")
    # Stage checkpoints back into the stages, at the same layout: each rank's stage EMA
    # through save_checkpoint/load_checkpoint, and the trainer's own step-2 checkpoint.
    save_checkpoint({"ema": trainer.ema.parts[0]}, base / "pp" / "stages")
    trainer.ema.reset()
    load_checkpoint({"ema": trainer.ema.parts[0]}, base / "pp" / "stages")
    want = reference.emas["decay_0_9"]
    run["stages_loaded"] = _differ(_trainer_ema_full(trainer, "decay_0_9", reference.keys), want)
    trainer.ema.reset()
    trainer.checkpointer.load(step=2)
    run["trainer_loaded"] = _differ(_trainer_ema_full(trainer, "decay_0_9", reference.keys), want)
    trainer.close()
    out["llama_pp"] = run

    # deepseek_v3 (MoE), the expert bias averaged: HSDP 2x2 with EP 2 and FSDP2 2 x TP 2 with
    # EP 2 (the experts on torchtitan's efsdp x ep meshes, all-to-all token dispatch), and
    # PP 2 x FSDP2 2; each saves a full checkpoint at step 2 (resumed at W=2 and in one
    # process).
    moe_layouts: dict[str, dict[str, int]] = {
        "hsdp_ep": {"replicate": 2, "shard": 2, "ep": 2},
        "tp_ep": {"shard": 2, "tp": 2, "ep": 2},
        "pp": {"pp": 2, "shard": 2},
    }
    for layout, degrees in moe_layouts.items():
        out[f"moe_{layout}"] = _moe_run(
            base / f"moe_{layout}", steps=2, validate=layout != "pp", checkpoint=True, **degrees
        )
    dist.barrier()
    return out


def _moe_run(
    root: Path, steps: int, validate: bool = True, checkpoint: bool = False, **degrees: int
) -> dict[str, Any]:
    """deepseek_v3 (MoE) on torchtitan's trainer: one EMA (decay 0.9) with the expert bias
    averaged, validated at the last step (``validate``); the shared checks, the validation
    and the mesh dims of the experts' EMA. With ``checkpoint``, a full checkpoint at the
    last step and each rank's reference EMA in ``root/reference<rank>.pt``."""
    config = _config(root, "deepseek_v3", steps=steps, validate_every=steps if validate else None,
                     checkpoint_every=steps if checkpoint else None, **degrees)  # fmt: skip
    config.ema.decays = [0.9]
    config.ema.buffer_patterns = list(MOE_BUFFERS)
    config.checkpoint.last_save_model_only = False
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    if validate:
        run["validation"] = _check_validation(trainer)
    reference = run.pop("reference")
    if checkpoint:
        torch.save(reference.emas["decay_0_9"], root / f"reference{dist.get_rank()}.pt")
    run["expert_meshes"] = sorted(
        {
            str(e.device_mesh.mesh_dim_names)
            for emas in trainer.ema.parts
            for k, e in emas["decay_0_9"].ema_tensors().items()
            if ".routed_experts." in k  # not the shared experts (dense, no EP)
        }
    )
    trainer.close()
    return run


class _Restored(logging.Handler):
    """Keeps the trainer module's "EMA restored" log lines."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "EMA restored" in record.getMessage():
            self.lines.append(record.getMessage())


def _load_logged(trainer: Any) -> list[str]:
    """``trainer.checkpointer.load()`` (what ``train()`` does first); the "EMA restored"
    lines this rank logged."""
    handler = _Restored()
    titan_log = logging.getLogger("dtensor_ema.integrations.torchtitan.trainer")
    level = titan_log.level
    titan_log.addHandler(handler)
    titan_log.setLevel(logging.INFO)  # torchtitan's init_logger sets it in torchtitan.train
    try:
        trainer.checkpointer.load()
    finally:
        titan_log.removeHandler(handler)
        titan_log.setLevel(level)
    return handler.lines


# ------------------------------------------------------------------ W=2
def _w2_body(rank: int, world_size: int, root: str, w4_root: str) -> dict[str, Any]:
    _no_sleep()
    base = Path(root)
    step2 = Path(w4_root) / "hsdp" / "outputs" / "checkpoint" / "step-2"
    out: dict[str, Any] = {}

    # llama3 FSDP2: resume the W=4 HSDP run's async step-2 checkpoint, train step 3.
    config = _config(base / "resume", "llama3", shard=2, steps=3, validate_every=3,
                     checkpoint_every=10)  # fmt: skip
    config.ema.decays = list(HSDP_DECAYS)
    config.checkpoint.initial_load_path = str(step2)
    config.checkpoint.initial_load_model_only = False
    config.checkpoint.exclude_from_loading = ["dataloader"]  # torchtitan reshards no dataloader
    config.checkpoint.last_save_model_only = False
    trainer = build_cpu_trainer(config)
    reference = TrainerReference(trainer)
    saved = torch.load(Path(w4_root) / "hsdp" / "reference.pt")
    restored = _load_logged(trainer)  # checked before training on
    keys = reference.keys
    run: dict[str, Any] = {
        "restored_log": restored,
        "loaded_step": trainer.step,
        "loaded": {
            n: _differ(_trainer_ema_full(trainer, n, keys), saved["ema"][2][n]) for n in trainer.ema
        },
    }
    reference.emas = {
        n: {k: v.clone() for k, v in saved["ema"][2][n].items()} for n in reference.names
    }
    calls = _logged(trainer)
    trainer.train()
    run["differ"] = {
        n: _differ(_trainer_ema_full(trainer, n, keys), reference.emas[n]) for n in trainer.ema
    }
    run["fired"] = reference.fired
    run["validation"] = _check_validation(trainer)
    run["validation_logs"] = [(s, m) for s, m in calls if any("ema_loss" in k for k in m)]
    # A model-only load (initial_load_model_only) restarts the EMA from the loaded weights.
    checkpointer = trainer.checkpointer
    checkpointer.folder = str(base / "resume" / "no-checkpoints-here")
    checkpointer.initial_load_model_only = True
    checkpointer.load()
    weights = reference.weights()
    run["reseeded"] = {
        n: _differ(_trainer_ema_full(trainer, n, keys), weights) for n in trainer.ema
    }
    run["reseeded_to_step2"] = _differ(weights, saved["weights"][2])
    # A checkpoint without EMA (the W=4 run's model-only final one, loaded as a full one):
    # a warning, then the EMA restarts from the weights it loaded.
    final = Path(w4_root) / "hsdp" / "outputs" / "checkpoint" / "step-3"
    states = {**checkpointer.states["model"].state_dict(), "ema": trainer.ema}
    checkpointer.dcp_load(states, str(final), from_hf=False, from_quantized=False)
    weights = reference.weights()
    run["no_ema"] = {n: _differ(_trainer_ema_full(trainer, n, keys), weights) for n in trainer.ema}
    run["no_ema_to_step3"] = _differ(weights, saved["weights"][3])
    # common_subset through the checkpoint manager: a checkpoint of an EMA that left
    # norm.weight out (frozen when it was built) is refused by this EMA (it tracks it)
    # before anything is read, naming --ema.load_common_subset; with it, the tensors both
    # hold load, norm.weight keeps its value.
    norm = trainer.model_parts[0].norm.weight
    norm.requires_grad_(False)
    narrow = TorchtitanEMA(trainer.config.ema, model_parts=trainer.model_parts)
    norm.requires_grad_(True)
    with torch.no_grad():
        for emas in narrow.parts:
            for e in emas.values():
                for t in e.ema_tensors().values():
                    t.to_local().add_(1.0)
    dcp.save({"ema": narrow}, checkpoint_id=str(base / "narrow"))
    narrow_full = {
        n: {k: _full(t) for e in narrow.parts for k, t in e[n].ema_tensors().items()}
        for n in narrow
    }
    before = {n: _trainer_ema_full(trainer, n, keys) for n in trainer.ema}
    states = {"ema": trainer.ema}
    try:
        checkpointer.dcp_load(dict(states), str(base / "narrow"), False, False)
        run["subset_refused"] = ""
    except ValueError as error:
        run["subset_refused"] = str(error)
    run["subset_unchanged"] = {
        n: _differ(_trainer_ema_full(trainer, n, keys), before[n]) for n in trainer.ema
    }
    trainer.ema.config.load_common_subset = True
    checkpointer.dcp_load(dict(states), str(base / "narrow"), False, False)
    trainer.ema.config.load_common_subset = False
    after = {n: _trainer_ema_full(trainer, n, keys) for n in trainer.ema}
    run["subset_loaded"] = {
        n: (_differ({k: v for k, v in after[n].items() if k != "norm.weight"}, narrow_full[n]),
            torch.equal(after[n]["norm.weight"], before[n]["norm.weight"]))
        for n in trainer.ema
    }  # fmt: skip
    # An HF export that fails on rank 0 (its folder's path is a file) raises on every rank
    # with rank 0's message; before the fix the other ranks waited in a barrier that rank 0
    # never reached (here: rank 0 went on to the next collective with them still in it).
    blocked = base / "resume" / "blocked"
    if rank == 0:
        blocked.write_text("a file where the export folder's parent should be")
    dist.barrier()
    try:
        trainer.export_hf(blocked / "hf")
        run["export_refused"] = ""
    except OSError as error:
        run["export_refused"] = f"{type(error).__name__}: {error}"
    trainer.close()
    out["llama_resume"] = run

    # deepseek_v3 (MoE) FSDP2: resume the W=4 FSDP2 x TP x EP run's step-2 checkpoint.
    w4_moe = Path(w4_root) / "moe_tp_ep"
    config = _config(base / "moe", "deepseek_v3", shard=2, steps=3, validate_every=3,
                     checkpoint_every=10)  # fmt: skip
    config.ema.decays = [0.9]
    config.ema.buffer_patterns = list(MOE_BUFFERS)
    config.checkpoint.initial_load_path = str(w4_moe / "outputs" / "checkpoint" / "step-2")
    config.checkpoint.initial_load_model_only = False
    config.checkpoint.exclude_from_loading = ["dataloader"]
    trainer = build_cpu_trainer(config)
    reference = TrainerReference(trainer)
    saved = torch.load(w4_moe / "reference0.pt")
    run = {"restored_log": _load_logged(trainer), "loaded_step": trainer.step}
    run["loaded"] = _differ(_trainer_ema_full(trainer, "decay_0_9", reference.keys), saved)
    reference.emas = {"decay_0_9": {k: v.clone() for k, v in saved.items()}}
    calls = _logged(trainer)
    trainer.train()
    full = _trainer_ema_full(trainer, "decay_0_9", reference.keys)
    run["differ"] = {"decay_0_9": _differ(full, reference.emas["decay_0_9"])}
    run["moved"] = {"decay_0_9": _differ(full, saved) != []}
    run["fired"] = reference.fired
    run["local_numel"] = sum(e["decay_0_9"].local_numel() for e in trainer.ema.parts)
    run["model_numel"] = sum(v.numel() for v in saved.values())
    run["stage"] = 0
    run["validation"] = _check_validation(trainer)
    run["validation_logs"] = [(s, m) for s, m in calls if any("ema_loss" in k for k in m)]
    trainer.close()
    out["moe_resume"] = run

    out["compiled_and_float8"] = _compiled_and_float8(rank, base / "variants")
    out["pp_resume"] = _pp_resume(base, Path(w4_root) / "pp")
    out["hand_loop"] = _hand_loop(world_size, str(base / "hand"))
    return out


def _pp_resume(base: Path, w4_pp: Path) -> dict[str, Any]:
    """llama3 PP 2 (FSDP2 1) at W=2, resumed from the W=4 PP 2 x FSDP2 2 run's step-2
    checkpoint (another layout); the W=4 stages' ``save_checkpoint`` folder loaded into
    these stages by ``load_checkpoint``; one more step against the reference."""
    config = _config(base / "pp", "llama3", pp=2, shard=1, steps=3, checkpoint_every=10)
    config.ema.decays = [0.9]
    config.checkpoint.initial_load_path = str(w4_pp / "outputs" / "checkpoint" / "step-2")
    config.checkpoint.initial_load_model_only = False
    config.checkpoint.exclude_from_loading = ["dataloader"]
    trainer = build_cpu_trainer(config)
    reference = TrainerReference(trainer)
    keys = reference.keys
    saved = {k: v for k, v in _merged_references(w4_pp).items() if k in keys}
    run: dict[str, Any] = {"restored_log": _load_logged(trainer), "loaded_step": trainer.step}
    run["loaded"] = _differ(_trainer_ema_full(trainer, "decay_0_9", keys), saved)
    trainer.ema.reset()
    load_checkpoint({"ema": trainer.ema.parts[0]}, w4_pp / "stages")
    run["stages_loaded"] = _differ(_trainer_ema_full(trainer, "decay_0_9", keys), saved)
    reference.emas = {"decay_0_9": {k: v.clone() for k, v in saved.items()}}
    trainer.train()
    full = _trainer_ema_full(trainer, "decay_0_9", keys)
    run["differ"] = {"decay_0_9": _differ(full, reference.emas["decay_0_9"])}
    run["moved"] = {"decay_0_9": _differ(full, saved) != []}
    run["fired"] = reference.fired
    run["stage"] = trainer.parallel_dims.get_mesh("pp").get_local_rank()
    run["local_numel"] = sum(e["decay_0_9"].local_numel() for e in trainer.ema.parts)
    run["model_numel"] = sum(v.numel() for v in saved.values())
    trainer.close()
    return run


def _compiled_and_float8(rank: int, base: Path) -> dict[str, Any]:
    """llama3 FSDP2 at W=2 through torchtitan's trainer with ``--compile.enable`` (each block
    compiled by torchtitan, the loss too), and with float8 (torchao's ``Float8Linear`` in
    every block and the head; emulate, set here: torchtitan 0.3.0's converter refuses a
    CPU, and emulate with compile): the EMA equals the reference after every step; a full
    checkpoint at step 2, resumed in one process by the tests."""
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.models.llama3 import model_registry

    from dtensor_ema.integrations.torchtitan import config_registry

    out: dict[str, Any] = {}
    for variant in ("compile", "float8"):
        config = config_registry.llama3_debugmodel()
        if variant == "float8":
            converter = Float8LinearConverter.Config(emulate=True)
            config.model_spec = model_registry("debugmodel", converters=[converter])
        config.compile.enable = variant == "compile"
        # partial_dtensor: torchtitan 0.3.0 builds no second spmd_types trainer of a layout
        # one process already built (its FSDP mesh check fails), and llama_resume has.
        config.parallelism.spmd_backend = "partial_dtensor"
        cpu_trainer_config(config, base / variant, layers=1, shard=2, steps=2,
                           checkpoint_every=2)  # fmt: skip
        config.ema.decays = [0.9]
        config.checkpoint.last_save_model_only = False
        trainer = build_cpu_trainer(config)
        reference = TrainerReference(trainer)
        per_step: list[list[str]] = []

        def check(*_: Any, trainer: Any = trainer, ref: Any = reference, log: Any = per_step,
                  **__: Any) -> None:  # fmt: skip
            log.append(_differ(_trainer_ema_full(trainer, "decay_0_9", ref.keys),
                               ref.emas["decay_0_9"]))  # fmt: skip

        trainer.optimizers.register_step_post_hook(check)  # after the EMA's and the reference's
        trainer.train()
        modules = list(trainer.model_parts[0].modules())
        out[variant] = {
            "per_step": per_step,
            "fired": reference.fired,
            "float8": sum(type(m).__name__ == "Float8Linear" for m in modules),
            "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
        }
        if rank == 0:
            torch.save(reference.emas["decay_0_9"], base / variant / "reference.pt")
        trainer.close()
    out["root"] = str(base)
    return out


# ------------------------------------------------------------------ fixtures
def _env(root: Path) -> dict[str, str]:
    return {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("titan-w4")
    return root, run_ranks(_w4_body, 4, root, str(root), env=_env(root), deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def w2(
    w4: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("titan-w2")
    return run_ranks(
        _w2_body, 2, root, str(root), str(w4[0]), env=_env(root), deadline_s=DEADLINE_S
    )


# ------------------------------------------------------------------ assertions
def _assert_run(results: list[dict[str, Any]], key: str, fired: list[int]) -> None:
    for rank, result in enumerate(results):
        run = result[key]
        assert run["fired"] == fired, (key, rank, run["fired"])
        for name, differ in run["differ"].items():
            assert differ == [], (key, rank, name, differ[:5])
            assert run["moved"][name], (key, rank, name, "the EMA never moved")
    # Every EMA element on exactly one rank (per stage with pipeline parallelism).
    stages: dict[int, int] = {}
    for result in results:
        stages[result[key]["stage"]] = result[key]["model_numel"]
    assert sum(r[key]["local_numel"] for r in results) == sum(stages.values()), key


def _assert_validation(results: list[dict[str, Any]], key: str, step: int) -> None:
    logged = results[0][key]["validation"]["logged"]
    unsharded = results[0][key]["validation"]["unsharded"]
    assert set(logged) == set(unsharded) and len(logged) >= 2, (logged, unsharded)
    for name, loss in unsharded.items():
        assert math.isclose(logged[name], loss, rel_tol=2e-5), (key, name, logged, unsharded)
    for result in results:  # every rank logged the same losses
        assert result[key]["validation"]["logged"] == logged
    ema_names = [n for n in logged if n != "raw"]
    assert all(abs(logged[n] - logged["raw"]) > 1e-3 for n in ema_names), logged
    logs = dict(results[0][key]["validation_logs"])
    assert step in logs, results[0][key]["validation_logs"]
    assert logs[step]["validation_metrics/loss"] == logged["raw"]
    for name in ema_names:
        assert logs[step][f"validation_metrics/ema_loss/{name}"] == logged[name]


@pytest.mark.distributed
def test_w4_ema_bit_exact_on_every_layout(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = w4
    _assert_run(results, "llama_hsdp", [1, 2, 3])
    _assert_run(results, "llama_tp", [2, 3])
    _assert_run(results, "llama_pp", [1, 2])
    _assert_run(results, "moe_hsdp_ep", [1, 2])
    _assert_run(results, "moe_tp_ep", [1, 2])
    _assert_run(results, "moe_pp", [1, 2])
    for key in ("moe_hsdp_ep", "moe_tp_ep"):
        meshes = [r[key]["expert_meshes"] for r in results]  # an ep dim (the EMA's own name)
        has_ep = [m and all(re.search(r"'(ema_)?ep(_\d+)?'", dims) for dims in m) for m in meshes]
        assert all(has_ep), (key, meshes)
    assert [r["moe_pp"]["stage"] for r in results] == [0, 0, 1, 1]
    assert [r["llama_pp"]["stage"] for r in results] == [0, 0, 1, 1]
    for r in results:  # stage checkpoints back into the stages, same layout
        assert r["llama_pp"]["stages_loaded"] == [] and r["llama_pp"]["trainer_loaded"] == []
    assert all(r["llama_pp"]["ema_mesh"] == [2] for r in results)  # the stage's 2 ranks
    assert any(k.endswith("expert_bias_E") for k in results[0]["moe_hsdp_ep"]["keys"])


@pytest.mark.distributed
def test_w4_validator_logs_the_ema_loss(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = w4
    _assert_validation(results, "llama_hsdp", 3)
    _assert_validation(results, "llama_tp", 3)
    _assert_validation(results, "moe_hsdp_ep", 2)
    _assert_validation(results, "moe_tp_ep", 2)


@pytest.mark.distributed
def test_w2_resumes_the_w4_checkpoint(w2: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(w2):
        run = result["llama_resume"]
        assert run["loaded_step"] == 2
        assert run["loaded"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["fired"] == [3]
        assert run["differ"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["reseeded"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["reseeded_to_step2"] == [], rank
        assert run["no_ema"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["no_ema_to_step3"] == [], rank
    for rank, result in enumerate(w2):
        run = result["llama_resume"]
        assert "lacks ['norm.weight'], which this EMA tracks" in run["subset_refused"], rank
        assert "--ema.load_common_subset" in run["subset_refused"]
        assert run["subset_unchanged"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["subset_loaded"] == {"decay_0_9": ([], True), "decay_0_5": ([], True)}, rank
    refused = [result["llama_resume"]["export_refused"] for result in w2]
    assert refused[0] and refused == [refused[0]] * len(w2), refused
    assert "Hugging Face format failed on rank 0: " in refused[0], refused[0]
    _assert_validation(w2, "llama_resume", 3)
    for run_key in ("llama_resume", "moe_resume"):  # logged once, on rank 0, per load
        logs = [result[run_key]["restored_log"] for result in w2]
        assert logs[1:] == [[]] * (len(w2) - 1), logs
        assert len(logs[0]) == 1 and "(step 2): " in logs[0][0], logs
    assert w2[0]["llama_resume"]["restored_log"][0].endswith(
        "(step 2): decay_0_9 2 updates, decay_0_5 2 updates"
    )
    assert w2[0]["moe_resume"]["restored_log"][0].endswith("(step 2): decay_0_9 2 updates")
    # deepseek_v3 saved at W=4 on FSDP2 x TP x EP, resumed at W=2 on FSDP2.
    for result in w2:
        assert result["moe_resume"]["loaded_step"] == 2 and result["moe_resume"]["loaded"] == []
    _assert_run(w2, "moe_resume", [3])
    _assert_validation(w2, "moe_resume", 3)


@pytest.mark.distributed
def test_w2_pipeline_stages_resume_the_w4_stages(w2: list[dict[str, Any]]) -> None:
    """PP 2 x FSDP2 2 at W=4 -> PP 2 at W=2: the trainer's checkpoint and the stages'
    ``save_checkpoint`` folder load into the new stages bit for bit (other stages' tensors
    are theirs, not unexpected), and the EMA goes on exactly."""
    assert [r["pp_resume"]["stage"] for r in w2] == [0, 1]
    for rank, result in enumerate(w2):
        run = result["pp_resume"]
        assert run["loaded_step"] == 2 and run["loaded"] == [], (rank, run["loaded"][:5])
        assert run["stages_loaded"] == [], (rank, run["stages_loaded"][:5])
    assert w2[0]["pp_resume"]["restored_log"][0].endswith("(step 2): decay_0_9 2 updates")
    _assert_run(w2, "pp_resume", [3])


@pytest.mark.distributed
def test_w2_trainer_compiled_and_float8_exact_and_resumed_in_one_process(
    w2: list[dict[str, Any]],
) -> None:
    """torchtitan's trainer with ``--compile.enable`` and with float8 (emulate): the EMA
    equals the reference after both steps on every rank; the step-2 checkpoint's EMA loads
    in one process (no process group) into a plain model's EMA bit for bit."""
    for rank, result in enumerate(w2):
        runs = result["compiled_and_float8"]
        assert runs["compile"]["compiled"] == 1 and runs["float8"]["float8"] == 5, rank
        for variant in ("compile", "float8"):
            assert runs[variant]["per_step"] == [[], []], (rank, variant)
            assert runs[variant]["fired"] == [1, 2], (rank, variant)
    assert not dist.is_initialized()
    root = Path(w2[0]["compiled_and_float8"]["root"])
    for variant in ("compile", "float8"):
        model = llama3_debugmodel(layers=1, seed=0)
        ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=[0.9]), model_parts=[model])
        step2 = root / variant / "outputs" / "checkpoint" / "step-2"
        dcp.load({"ema": ema}, checkpoint_id=str(step2))
        want = torch.load(root / variant / "reference.pt")
        assert _differ(ema["decay_0_9"].ema_tensors(), want) == [], variant
        assert ema["decay_0_9"].updates == 2


# ------------------------------------------------------------------ one process
def _plain_llama() -> nn.Module:
    """The trainers' llama3 debugmodel (2 blocks, SDPA), unsharded, in this process."""
    return _titan()


@pytest.mark.distributed
def test_one_process_loads_the_w4_checkpoints(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """No process group: the async step-2 checkpoint's EMA into a plain model's EMA, and the
    EMA written beside the model-only final checkpoint (model keys: ``wq``/``wk``/``wv``)."""
    root, results = w4
    assert not dist.is_initialized()
    saved = torch.load(root / "hsdp" / "reference.pt")
    folder = root / "hsdp" / "outputs" / "checkpoint"
    model = _plain_llama()
    ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=HSDP_DECAYS), model_parts=[model])
    dcp.load({"ema": ema}, checkpoint_id=str(folder / "step-2"))
    for name in ema:
        assert _differ(ema[name].ema_tensors(), saved["ema"][2][name]) == [], name

    final = dcp.FileSystemReader(str(folder / "step-3")).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in final and not any(k.startswith("ema") for k in final)
    from dtensor_ema.integrations.torchtitan.trainer import _saved_ema

    saved_emas = _saved_ema(str(folder / "step-2"))
    assert saved_emas is not None and sorted(saved_emas) == ["decay_0_5", "decay_0_9"]
    assert saved_emas["decay_0_9"] == set(saved["ema"][2]["decay_0_9"])  # the EMA's own fqns
    assert "layers.0.attention.qkv_linear.wqkv.weight" in saved_emas["decay_0_9"]
    assert _saved_ema(str(folder / "step-3")) == {}  # model-only: no EMA
    assert _saved_ema(str(root / "not-a-checkpoint")) is None  # no local folder: the load decides
    assert results[0]["llama_hsdp"]["ema_folder"] == str(folder / "step-3" / "ema" / "decay_0_9")
    for name in ("decay_0_9", "decay_0_5"):
        state = model.state_dict()  # torchtitan's hook: fresh wq/wk/wv tensors to load into
        dcp.load(state, checkpoint_id=str(folder / "step-3" / "ema" / name))
        model.load_state_dict(state)  # its pre-hook fuses them into wqkv
        weights = {canonical_fqn(n): p.detach() for n, p in model.named_parameters()}
        assert _differ(weights, saved["ema"][3][name]) == [], name


def _merged_references(folder: Path) -> dict[str, torch.Tensor]:
    """The reference EMA of every rank of a W=4 run (each stage's ranks saved theirs)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(4):
        merged.update(torch.load(folder / f"reference{rank}.pt"))
    return merged


@pytest.mark.distributed
def test_pp_export_hf_writes_one_file(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """``EMATrainer.export_hf`` under PP 2 x FSDP2 2: rank 0 alone returns a file, which
    holds both stages' EMA, equal bit for bit to ``to_hf`` of the reference EMA; and the
    run's step-2 checkpoint (each stage wrote its part) loads into one process's EMA."""
    from safetensors.torch import load_file
    from torchtitan.models.llama3 import model_registry

    root, results = w4
    files = [r["llama_pp"]["hf_file"] for r in results]
    assert files[1:] == ["None"] * 3 and files[0].endswith("model.safetensors"), files
    want = _merged_references(root / "pp")
    model = _plain_llama()
    assert {canonical_fqn(n) for n, _ in model.named_parameters()} == set(want)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(want[canonical_fqn(name)])
    spec = model_registry("debugmodel")
    expected = spec.state_dict_adapter(spec.model, None).to_hf(model.state_dict())
    written = load_file(files[0])
    assert written.keys() == expected.keys()
    assert [k for k in written if not torch.equal(written[k], expected[k])] == []

    ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=[0.9]), model_parts=[model])
    dcp.load({"ema": ema}, checkpoint_id=str(root / "pp" / "outputs" / "checkpoint" / "step-2"))
    assert _differ(ema["decay_0_9"].ema_tensors(), want) == [] and ema["decay_0_9"].updates == 2


@pytest.mark.distributed
def test_one_process_loads_the_moe_checkpoints(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """No process group: the deepseek_v3 EMA saved at W=4 on HSDP x EP and on PP x FSDP2
    (two stages, one layout in the checkpoint) loads bit for bit into a plain model's EMA."""
    from titan_models import deepseek_v3_debugmodel

    root, _ = w4
    config = TorchtitanEMA.Config(enable=True, decays=[0.9], buffer_patterns=MOE_BUFFERS)
    for layout in ("moe_hsdp_ep", "moe_pp"):
        ema = TorchtitanEMA(config, model_parts=[deepseek_v3_debugmodel(layers=2)])
        step2 = root / layout / "outputs" / "checkpoint" / "step-2"
        dcp.load({"ema": ema}, checkpoint_id=str(step2))
        want = _merged_references(root / layout)
        assert _differ(ema["decay_0_9"].ema_tensors(), want) == [], layout
        assert set(ema["decay_0_9"].ema_tensors()) == set(want), layout
        assert ema["decay_0_9"].updates == 2


@pytest.mark.distributed
def test_hf_export_loads_into_transformers(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """``EMATrainer.export_hf`` (EMA and raw weights) at W=4 FSDP2+TP: ``transformers``'
    Llama loaded from the files gives torchtitan's logits (the adapter permutes Q/K for
    RoPE, so not bit for bit)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    root, _ = w4
    states = torch.load(root / "tp" / "states.pt")
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kind in ("ema", "raw"):
        titan = _plain_llama()
        titan.load_state_dict(states[kind])
        hf = transformers.LlamaForCausalLM(config).eval()
        hf.load_state_dict(load_file(root / "tp" / f"hf_{kind}" / "model.safetensors"), strict=True)
        with torch.no_grad():
            want, got = titan.eval()(tokens), hf(tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        logits[kind] = got
    assert not torch.allclose(logits["ema"], logits["raw"], atol=1e-3)

    # The final checkpoint in HF format (last_save_in_hf): torchtitan's own save of the raw
    # weights, and the EMA beside it, equal the exports bit for bit.
    final = root / "tp" / "outputs" / "checkpoint" / "step-3"
    for kind, folder in (("raw", final), ("ema", final / "ema" / "hlf_0_5")):
        files = sorted(folder.glob("*.safetensors"))
        assert files, sorted(folder.iterdir())
        saved = {k: v for f in files for k, v in load_file(f).items()}
        exported = load_file(root / "tp" / f"hf_{kind}" / "model.safetensors")
        assert saved.keys() == exported.keys(), kind
        assert all(torch.equal(saved[k], exported[k]) for k in exported), kind


@pytest.mark.distributed
def test_torchtitan_ema_sharded_and_dcp(w2: list[dict[str, Any]]) -> None:
    results = [r["hand_loop"] for r in w2]
    for rank, result in enumerate(results):
        for wrapper, cell in result.items():
            assert cell["ema"] == [[], []], (rank, wrapper)
            assert cell["resumed"] == [[], []], (rank, wrapper)
            assert cell["checkpoint_keys"] == ["hlf_0_05", "hlf_0_5"]
            # one EMA element on exactly one rank: about half the bytes per rank
            assert cell["bytes"] <= cell["total"] / 2 + 4096, (rank, wrapper, cell)
    assert sum(r["ddp"]["bytes"] for r in results) <= results[0]["ddp"]["total"] + 4096
    assert results[0]["ddp"]["clone"] == results[0]["ddp"]["total"]  # a full copy per rank
