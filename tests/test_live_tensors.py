"""The EMA binds to the model's live tensors (not ``state_dict()`` copies), keys them by
canonical fqn, gives outputs in the model's own state-dict keys, and refuses replicas that
differ across ranks.

* torchtitan's llama3 debugmodel (fused ``wqkv``, saved as ``wq``/``wk``/``wv`` by a
  state-dict hook): the EMA of the fused parameter moves, the swap writes into it, and
  ``get_model_state_dict``/``load_full_state_dict`` speak the model's keys. One process.
* activation checkpointing: canonical keys (no ``_checkpoint_wrapped_module``) in the DCP
  state and the outputs.
* the live-tensor guard and the replica check (W=3, one spawn).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_ranks
from titan_models import llama3_debugmodel
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dtensor_ema import ModelEMA
from dtensor_ema.model_keys import canonical_fqn, live_tensors, to_model_keys
from dtensor_ema.plan import check_live

DECAY = 0.75


def _sgd_steps(model: nn.Module, ema: ModelEMA, make_batch, steps: int, lr: float = 1e-2):
    """Train ``steps`` SGD steps, updating ``ema``; return the reference EMA written here:
    plain lerp on full clones of the live parameters and float buffers."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    reference = {
        n: t.detach().clone().float()
        for n, t in live_tensors(model).items()
        if t.is_floating_point()
    }
    for _ in range(steps):
        loss = make_batch(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()
        with torch.no_grad():
            for name, value in reference.items():
                value.lerp_(live_tensors(model)[name].detach().float(), 1 - DECAY)
    return reference


# --------------------------------------------------------------- torchtitan fused QKV
def _titan_model() -> nn.Module:
    pytest.importorskip("torchtitan")
    return llama3_debugmodel(layers=2, seed=0)


def _titan_loss(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 2048, (2, 8))
    return model(tokens).float().pow(2).mean()


def test_torchtitan_fused_qkv_ema_tracks_the_live_parameter() -> None:
    model = _titan_model()
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    split = [f"layers.0.attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")]
    assert fused not in model.state_dict() and all(k in model.state_dict() for k in split)

    ema = ModelEMA(model, decay=DECAY, tau=None)
    assert fused in ema.ema_tensors() and not any(k in ema.ema_tensors() for k in split)
    torch.manual_seed(1)
    reference = _sgd_steps(model, ema, _titan_loss, steps=3)
    assert all(torch.isfinite(v).all() for v in reference.values())
    got = ema.ema_tensors()
    assert got.keys() == reference.keys()
    for name, value in got.items():
        assert torch.equal(value, reference[name]), name
    assert not torch.equal(got[fused], copy.deepcopy(_titan_model()).state_dict()[split[0]])

    # Outputs keep the model's own keys: the model's hook splits the EMA's wqkv.
    ema_sd, model_sd = ema.get_model_state_dict()
    assert list(model_sd) == list(model.state_dict())
    assert list(ema_sd) == list(model.state_dict())
    expected = to_model_keys(model, {k: v.clone() for k, v in reference.items()})
    for key in split:
        assert torch.equal(ema_sd[key], expected[key]), key
        assert torch.equal(model_sd[key], model.state_dict()[key]), key

    # Loading a full state dict in the model's keys fuses it back (the model's own hook).
    twin = ModelEMA(model, decay=DECAY, tau=None)
    twin.load_full_state_dict(ema_sd)
    assert torch.equal(twin.ema_tensors()[fused], got[fused])

    # The swap writes into the live fused parameter; the raw weights come back exactly.
    raw = {k: v.detach().clone() for k, v in live_tensors(model).items()}
    tokens = torch.randint(0, 2048, (2, 8))
    evaluator = _titan_model()
    evaluator.load_state_dict(ema_sd)
    with torch.no_grad():
        want = evaluator(tokens)
        with ema.average_parameters() as swapped:
            assert torch.equal(live_tensors(swapped)[fused], got[fused])
            out = swapped(tokens)
    assert torch.equal(out, want)
    for name, tensor in live_tensors(model).items():
        assert torch.equal(tensor, raw[name]), name


# --------------------------------------------------------------- activation checkpointing
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class Net(nn.Module):
    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        if wrap:
            self.blocks[1] = checkpoint_wrapper(self.blocks[1])
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(8, 6)).pow(2).mean()


def test_checkpoint_wrapper_keys_are_canonical() -> None:
    torch.manual_seed(0)
    plain = Net(wrap=False)
    wrapped = Net(wrap=True)
    wrapped.load_state_dict(plain.state_dict())
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    emas = [ModelEMA(m, decay=DECAY, tau=None) for m in (plain, wrapped)]
    references = []
    for model, ema in zip((plain, wrapped), emas, strict=True):
        torch.manual_seed(1)
        references.append(_sgd_steps(model, ema, _net_loss, steps=2))
    keys = list(plain.state_dict())
    assert list(emas[1].ema_tensors()) == [k for k in keys if "num_batches" not in k]
    assert list(emas[1].state_dict()["ema"]) == list(emas[0].state_dict()["ema"])
    ema_sd, _ = emas[1].get_model_state_dict()
    assert list(ema_sd) == keys == list(wrapped.state_dict())
    for key, value in references[1].items():  # keyed canonically by live_tensors
        # (the recomputed forward updates BatchNorm statistics again, so the two models'
        # buffers differ: each EMA is compared with its own model's reference)
        assert torch.equal(ema_sd[key].float(), value), key


def test_canonical_fqn() -> None:
    assert canonical_fqn("layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert canonical_fqn("_orig_mod.layers.0._orig_mod.fc.weight") == "layers.0.fc.weight"
    assert canonical_fqn("fc.weight") == "fc.weight"


def test_compiled_submodule_is_tracked_by_canonical_name() -> None:
    model = Net(wrap=False)
    model.head = torch.compile(model.head)  # an OptimizedModule: keys gain "_orig_mod."
    ema = ModelEMA(model, decay=DECAY, tau=None)
    assert "head.weight" in ema.ema_tensors()
    assert ema.ema_tensors()["head.weight"] is not model.head._orig_mod.weight


def test_guard_refuses_an_entry_that_is_not_live() -> None:
    model = Net(wrap=False)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    entries = list(ema.engine.plan)
    check_live(model, entries)  # the real plan passes
    stale = copy.copy(entries[0])
    stale.source = entries[0].source.detach().clone()  # a copy, as a state-dict hook returns
    with pytest.raises(ValueError, match=r"not live parameters or buffers of Net.*blocks\.0"):
        check_live(model, [stale, *entries[1:]])
    moved = copy.copy(entries[0])
    moved.source_piece = entries[0].source_piece.clone()  # a view of other storage
    with pytest.raises(ValueError, match="not live"):
        check_live(model, [moved])


# --------------------------------------------------------------- replicas differ (W=3)
def _replica_body(rank: int, world_size: int) -> dict[str, str]:
    out = {}
    torch.manual_seed(rank)  # a per-rank seed, as timm does before DDP wraps the model
    different = Net(wrap=False)
    try:
        ModelEMA(different)
        out["different"] = "accepted"
    except (ValueError, RuntimeError) as e:
        out["different"] = f"{type(e).__name__}: {e}"
    torch.manual_seed(0)
    same = Net(wrap=False)
    same.blocks[0].norm.running_mean += rank  # buffers may differ: not checked
    ema = ModelEMA(same)
    out["same"] = f"accepted {ema.local_numel()}"
    return out


@pytest.mark.distributed
def test_replicas_that_differ_are_refused(tmp_path) -> None:
    results = run_ranks(_replica_body, 3, tmp_path)
    for result in results:
        assert result["different"].startswith("ValueError"), result
        assert "replicated parameters differ across ranks [0, 1, 2]" in result["different"]
        assert "blocks.0.lin.weight" in result["different"]
        assert "after DDP wraps the model" in result["different"]
        assert result["same"].startswith("accepted")
