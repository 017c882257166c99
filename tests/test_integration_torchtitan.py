"""dtensor_ema.integrations.torchtitan: torchtitan's EMA interface and math, sharded.

* One process: torchtitan's llama3 debugmodel (2 layers) trained with AdamW;
  ``TorchtitanEMA.step(current_step)`` against a reference of torchtitan's development EMA
  math written here (``num_updates`` from ``start_step``/``step_bias``/
  ``update_every_n_steps``, fixed decays or ``2 ** (-1 / (fraction * num_updates))``,
  ``torch.lerp`` on clones of the parameters), bit for bit; ``buffer_patterns``; disabled.
* W=2 (one spawn): DDP and FSDP2 copies of the model; each rank holds half of the EMA bytes
  (torchtitan's clone holds all of them under DDP); DCP ``save``/``load`` under the key
  ``ema`` into a fresh object resumes bit for bit.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import require_extra, run_ranks
from titan_models import llama3_debugmodel
from torch import nn

require_extra("torchtitan", "zoo")

from dtensor_ema.integrations.torchtitan import TorchtitanEMA  # noqa: E402
from dtensor_ema.model_keys import live_tensors  # noqa: E402


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
    assert torch.equal(got["other_stat"], model.other_stat)  # copied, never averaged
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


# ------------------------------------------------------------------ W=2, DCP
def _dist_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
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


@pytest.mark.distributed
def test_torchtitan_ema_sharded_and_dcp(tmp_path: Path) -> None:
    results = run_ranks(_dist_body, 2, tmp_path, str(tmp_path))
    for rank, result in enumerate(results):
        for wrapper, cell in result.items():
            assert cell["ema"] == [[], []], (rank, wrapper)
            assert cell["resumed"] == [[], []], (rank, wrapper)
            assert cell["checkpoint_keys"] == ["hlf_0_05", "hlf_0_5"]
            # one EMA element on exactly one rank: about half the bytes per rank
            assert cell["bytes"] <= cell["total"] / 2 + 4096, (rank, wrapper, cell)
    assert sum(r["ddp"]["bytes"] for r in results) <= results[0]["ddp"]["total"] + 4096
    assert results[0]["ddp"]["clone"] == results[0]["ddp"]["total"]  # a full copy per rank
