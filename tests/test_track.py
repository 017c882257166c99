"""``ModelEMA(track=...)`` in one process (no process group): only the tracked tensors are
stored and averaged, bit for bit against a plain ``lerp_`` reference over them; whole-model
outputs take untracked tensors from the model; ``add_tensors``/``drop_tensors`` and the
trainable-set check; states of another tracked set refused unless ``common_subset=True``;
a peft LoRA model (GPT-2 and Llama from transformers) holds its adapter bytes and exports an
adapter ``PeftModel.from_pretrained`` loads with the swapped-in EMA's logits.

The multi-rank layouts (DDP, FSDP2, HSDP, TP) and DCP reshards: ``test_track_distributed.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import EdgeModel, ReferenceEMA, mismatches, peft_lora, transformers_base
from torch import nn

from dtensor_ema import ModelEMA, MultiModelEMA, export_ema, load_checkpoint, save_checkpoint

DECAY = 0.5


def _edge(seed: int = 0) -> EdgeModel:
    torch.manual_seed(seed)
    return EdgeModel()


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.no_grad()
def _step_(model: nn.Module, step: int) -> None:
    """A deterministic 'training step': every trainable parameter moves."""
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def test_track_option_is_validated() -> None:
    model = _edge()
    with pytest.raises(ValueError, match=r"track must be 'all', 'trainable' or a predicate"):
        ModelEMA(model, track="frozen")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must return a bool, got Tensor for 'scalar'"):
        ModelEMA(model, track=lambda fqn, t: t.sum())  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"track= selects none of EdgeModel's 10 floating"):
        ModelEMA(model, track=lambda fqn, t: False)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="is every parameter frozen"):
        ModelEMA(frozen, track="trainable")
    # exclude applies within the tracked set: an untracked name is named as such.
    with pytest.raises(ValueError, match=r"\['frozen'\] are not tracked with track='trainable'"):
        ModelEMA(model, track="trainable", exclude=["frozen"])


def test_trainable_only_matches_reference_and_stores_only_tracked() -> None:
    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable", exclude=["odd"])
    tracked = _trainable(model)
    assert list(ema.ema_tensors()) == list(tracked)
    assert ema.untracked == ["frozen", "float_buf"]
    assert ema.local_nbytes() == _bytes(tracked)  # untracked bytes are never stored
    full_ema = ModelEMA(model, decay=DECAY, tau=None)
    assert full_ema.local_nbytes() == ema.local_nbytes() + (6 * 2 + 7) * 4
    ref = ReferenceEMA({k: v for k, v in tracked.items() if k != "odd"}, DECAY, None)
    for step in range(4):
        _step_(model, step)
        model(torch.randn(2, 3, 8, 8))  # moves float_buf / int_buf (untracked, followed)
        ema.update()
        ref.update(dict(model.named_parameters()))
    got = {k: v.detach() for k, v in ema.ema_tensors().items()}
    expected = {**ref.ema, "odd": model.odd.detach()}  # exclude= copies, within the set
    assert mismatches(got, expected) == []
    state = ema.state_dict()
    assert list(state["ema"]) == list(tracked)
    config = json.loads(state["config"])
    assert config["track"] == "trainable" and config["untracked"] == ["float_buf", "frozen"]
    assert config["copied"] == ["odd"]
    assert "track" not in json.loads(full_ema.state_dict()["config"])  # default: unchanged
    # A predicate, on canonical fqns and live tensors.
    picked = ModelEMA(model, track=lambda fqn, t: fqn.startswith("conv."))
    assert list(picked.ema_tensors()) == ["conv.weight", "conv.bias"]
    assert "untracked=" in repr(picked)


def test_state_dicts_take_untracked_tensors_from_the_model() -> None:
    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    for step in range(2):
        _step_(model, step)
        ema.update()
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tracked_only = ema.get_ema_state_dict()
    assert list(tracked_only) == list(_trainable(model))  # no frozen, float_buf, int_buf
    whole = ema.get_ema_state_dict(include_untracked=True)
    ema_sd, original = ema.get_model_state_dict()
    assert list(whole) == list(ema_sd) == list(model_sd)
    assert mismatches(whole, ema_sd) == []
    assert mismatches(original, model_sd) == []
    for k in ("frozen", "float_buf", "int_buf"):
        assert (
            torch.equal(ema_sd[k], model_sd[k]) and ema_sd[k].data_ptr() != model_sd[k].data_ptr()
        )
    assert mismatches({k: ema_sd[k] for k in tracked_only}, tracked_only) == []
    fresh = _edge(seed=1)
    fresh.load_state_dict(ema_sd, strict=True)  # a plain model loads it strictly
    # Both shapes of full state dict load back; untracked entries are ignored.
    other = ModelEMA(_edge(seed=2), track="trainable")
    other.load_full_state_dict(tracked_only)
    assert mismatches(other.get_ema_state_dict(), tracked_only) == []
    other.load_full_state_dict({**ema_sd, "frozen": torch.zeros(6, 2)})
    assert mismatches(other.get_ema_state_dict(), tracked_only) == []
    with pytest.raises(ValueError, match=r"missing \['odd'\]"):
        other.load_full_state_dict({k: v for k, v in tracked_only.items() if k != "odd"})


def test_swap_and_module_use_the_models_own_untracked_tensors(tmp_path: Path) -> None:
    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    for step in range(3):
        _step_(model, step)
        ema.update()
    x = torch.randn(2, 3, 8, 8)
    frozen = model.frozen
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = {k: v.detach().clone() for k, v in ema.ema_tensors().items()}
    with ema.average_parameters() as m:
        inside = {k: v.detach().clone() for k, v in m.state_dict().items()}
        assert m.frozen is frozen  # the untracked parameter is untouched, not swapped
    assert mismatches({k: inside[k] for k in expected}, expected) == []
    untracked = ("frozen", "float_buf", "int_buf")
    assert mismatches({k: inside[k] for k in untracked}, {k: before[k] for k in untracked}) == []
    assert mismatches(model.state_dict(), before) == []  # the tracked ones are restored
    module = ema.module
    # Untracked tensors are shared with the model (same storage), tracked ones are the EMA.
    assert module.frozen.data_ptr() == model.frozen.data_ptr()
    assert module.float_buf.data_ptr() == model.float_buf.data_ptr()
    assert module.odd.data_ptr() == ema.ema_tensors()["odd"].data_ptr()

    def swapped(x: torch.Tensor) -> torch.Tensor:
        # EdgeModel's forward writes float_buf: the module's forward writes the model's own
        # (shared) buffer, so each side starts from the same value.
        saved = model.float_buf.clone()
        with ema.average_parameters() as m:
            out = m(x).detach()
        model.float_buf.copy_(saved)
        return out

    expected_out = swapped(x)
    assert torch.equal(module(x), expected_out)
    # A re-allocated untracked tensor (p.data = ...) is followed before the next forward.
    with torch.no_grad():
        model.frozen.data = torch.full((6, 2), 3.0)
        model.float_buf.copy_(before["float_buf"])
    expected_out = swapped(x)
    assert torch.equal(module(x), expected_out)
    assert module.frozen.data_ptr() == model.frozen.data_ptr()
    # Loading a state into the module would write the untracked tensors into the model:
    # refused before anything is written; the tracked part alone loads (strict=False).
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    model_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ema_before = {k: v.detach().clone() for k, v in ema.ema_tensors().items()}
    with pytest.raises(ValueError, match=r"\['frozen', 'float_buf'\] are the model's own"):
        module.load_state_dict(changed)
    assert mismatches(model.state_dict(), model_before) == []
    assert mismatches(ema.ema_tensors(), ema_before) == []
    module.load_state_dict({k: changed[k] for k in ema_before}, strict=False)
    assert mismatches(ema.ema_tensors(), {k: changed[k] for k in ema_before}) == []
    assert mismatches(model.state_dict(), model_before) == []
    module.load_state_dict(module.state_dict())  # what it gave loads back, strictly
    rounded = dict(state, frozen=model.frozen.detach().to(torch.bfloat16))
    if not torch.equal(rounded["frozen"].float(), model.frozen.detach()):
        with pytest.raises(ValueError, match=r"\['frozen'\] are the model's own"):
            module.load_state_dict(rounded)  # a rounded copy would change the model's bits
    # A submodule's load is checked too, before it writes anything.
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    seq_ema = ModelEMA(seq, decay=DECAY, tau=None, track=lambda fqn, t: fqn != "0.weight")
    first = seq_ema.module[0]
    with pytest.raises(ValueError, match=r"\['weight'\] are the model's own"):
        first.load_state_dict({"weight": torch.zeros(4, 3), "bias": torch.zeros(4)})
    assert not torch.equal(seq[0].weight, torch.zeros(4, 3))
    assert not torch.equal(seq_ema.ema_tensors()["0.bias"], torch.zeros(4))


def test_trainable_set_changes_are_explicit() -> None:
    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    ref = ReferenceEMA(dict(_trainable(model)), DECAY, None)
    _step_(model, 0)
    ema.update()
    ref.update(dict(model.named_parameters()))
    model.frozen.requires_grad_(True)  # progressive unfreezing
    with pytest.raises(ValueError, match=r"now trainable \['frozen'\] \(call ema.add_tensors"):
        ema.update()
    assert ema.updates == 1  # the refused update did not count
    with pytest.raises(ValueError, match=r"cannot add tensors: 'odd': already tracked; 'nope':"):
        ema.add_tensors(["odd", "nope"])
    with pytest.raises(ValueError, match=r"'int_buf': an integer buffer"):
        ema.add_tensors(["int_buf"])
    with pytest.raises(TypeError, match="got the string"):
        ema.add_tensors("frozen")
    with torch.no_grad():
        model.frozen.add_(1.0)
    ema.add_tensors(["frozen"])  # starts from its current value
    assert torch.equal(ema.ema_tensors()["frozen"], model.frozen.detach())
    order = [k for k in model.state_dict() if k in ema.ema_tensors()]
    assert "frozen" in order and list(ema.ema_tensors()) == order  # state-dict order
    ref.ema["frozen"] = model.frozen.detach().clone()
    ref.updates = 1
    for step in (1, 2):
        _step_(model, step)
        ema.update()
        ref.update(dict(model.named_parameters()))
    got = {k: v.detach() for k, v in ema.ema_tensors().items()}
    assert mismatches(got, ref.ema) == []
    assert json.loads(ema.state_dict()["config"])["untracked"] == ["float_buf"]
    # Freezing: drop the tensor (its bytes are freed), or keep it with add_tensors([]).
    model.odd.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen \['odd'\] \(call ema.drop_tensors\(\['odd'\]"):
        ema.update()
    nbytes = ema.local_nbytes()
    ema.drop_tensors(["odd"])
    assert ema.local_nbytes() == nbytes - 13 * 7 * 4 and "odd" in ema.untracked
    ema.update()
    model.vec.requires_grad_(False)
    ema.add_tensors([])  # accepts the change; vec stays averaged
    ema.update()
    assert "vec" in ema.ema_tensors()
    with pytest.raises(ValueError, match="cannot drop all"):
        ema.drop_tensors(list(ema.ema_tensors()))
    with pytest.raises(ValueError, match=r"'odd': not tracked"):
        ema.drop_tensors(["odd"])
    ema.module  # noqa: B018
    with pytest.raises(RuntimeError, match=r"add_tensors\(\) after ema.module was built"):
        ema.add_tensors(["odd"])


def test_states_of_another_tracked_set_are_refused_unless_asked() -> None:
    model = _edge()
    whole = ModelEMA(model, decay=DECAY, tau=None)
    lora = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    _step_(model, 0)
    whole.update()
    lora.update()
    # The whole model's state into the trainable-only EMA: named, nothing written.
    before = {k: v.clone() for k, v in lora.ema_tensors().items()}
    _step_(model, 1)
    whole.update()
    with pytest.raises(
        ValueError,
        match=r"tracks other tensors than this EMA \(tracked only in the checkpoint "
        r"\['frozen', 'float_buf'\]\).*load the 8 tensors both track with common_subset=True",
    ):
        lora.load_state_dict(whole.state_dict())
    assert mismatches(lora.ema_tensors(), before) == [] and lora.updates == 1
    lora.load_state_dict(whole.state_dict(), common_subset=True)
    assert lora.updates == 2
    expected = {k: v for k, v in whole.ema_tensors().items() if k in lora.ema_tensors()}
    assert mismatches(lora.ema_tensors(), expected) == []
    # The other way: the saved config says what it left untracked.
    frozen_before = whole.ema_tensors()["frozen"].clone()
    with pytest.raises(ValueError, match=r"tracked only by this EMA \['frozen', 'float_buf'\]"):
        whole.load_state_dict(lora.state_dict())
    whole.load_state_dict(lora.state_dict(), common_subset=True)
    assert torch.equal(whole.ema_tensors()["frozen"], frozen_before)  # kept its value
    # Another model's tensors are still "does not match", with or without common_subset.
    state = lora.state_dict()
    state = {**state, "ema": {**state["ema"], "ghost": torch.zeros(2)}}
    with pytest.raises(ValueError, match=r"does not match the model: unexpected \['ghost'\]"):
        lora.load_state_dict(state, common_subset=True)
    # Options are still compared (within the common tensors).
    other = ModelEMA(model, decay=0.9, tau=None, track="trainable")
    with pytest.raises(ValueError, match="options differ"):
        other.load_state_dict(whole.state_dict(), common_subset=True)


def test_dcp_and_checkpoints_of_a_tracked_subset(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    for step in range(2):
        _step_(model, step)
        ema.update()
    saved = {k: v.clone() for k, v in ema.ema_tensors().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to ..."
        dcp.save({"ema": ema}, checkpoint_id=str(tmp_path / "dcp"))
    save_checkpoint({"ema": ema}, tmp_path / "ckpt")
    fresh = ModelEMA(_edge(seed=3), decay=DECAY, tau=None, track="trainable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"ema": fresh}, checkpoint_id=str(tmp_path / "dcp"))
    assert mismatches(fresh.ema_tensors(), saved) == [] and fresh.updates == 2
    again = ModelEMA(_edge(seed=3), decay=DECAY, tau=None, track="trainable")
    load_checkpoint({"ema": again}, tmp_path / "ckpt")
    assert mismatches(again.ema_tensors(), saved) == [] and again.updates == 2
    # After a change of the tracked set, the checkpoint loads into an EMA built with it.
    model.frozen.requires_grad_(True)
    ema.add_tensors(["frozen"])
    _step_(model, 2)
    ema.update()
    save_checkpoint({"ema": ema}, tmp_path / "after")
    rebuilt = _edge(seed=4)
    rebuilt.frozen.requires_grad_(True)
    follows = ModelEMA(rebuilt, decay=DECAY, tau=None, track="trainable")
    load_checkpoint({"ema": follows}, tmp_path / "after")
    assert mismatches(follows.ema_tensors(), ema.ema_tensors()) == []
    # Another tracked set is refused before anything is written, naming the tensors...
    lora = ModelEMA(_edge(seed=5), decay=DECAY, tau=None, track="trainable")
    before = {k: v.clone() for k, v in lora.ema_tensors().items()}
    with pytest.raises(ValueError, match=r"tracked only in the checkpoint \['frozen'\].*"
                       r"common_subset=True"):  # fmt: skip
        load_checkpoint({"ema": lora}, tmp_path / "after")
    assert mismatches(lora.ema_tensors(), before) == [] and lora.updates == 0
    # ... unless the caller asks for the tensors both track.
    load_checkpoint({"ema": lora}, tmp_path / "after", common_subset=True)
    expected = {k: v for k, v in ema.ema_tensors().items() if k != "frozen"}
    assert mismatches(lora.ema_tensors(), expected) == [] and lora.updates == 3
    whole_model = ModelEMA(_edge(seed=6), decay=DECAY, tau=None)
    kept = {k: whole_model.ema_tensors()[k].clone() for k in ("float_buf",)}
    with pytest.raises(ValueError, match=r"tracked only by this EMA \['float_buf'\]"):
        load_checkpoint({"ema": whole_model}, tmp_path / "after")
    load_checkpoint({"ema": whole_model}, tmp_path / "after", common_subset=True)
    got = whole_model.ema_tensors()
    assert mismatches({k: got[k] for k in ema.ema_tensors()}, ema.ema_tensors()) == []
    assert torch.equal(got["float_buf"], kept["float_buf"])  # not in the checkpoint: kept
    # MultiModelEMA members too.
    multi = MultiModelEMA(_edge(seed=7), {"a": {"decay": DECAY, "tau": None}})
    save_checkpoint({"emas": MultiModelEMA(model, {"a": {"decay": DECAY, "tau": None}},
                                           track="trainable")}, tmp_path / "multi")  # fmt: skip
    with pytest.raises(ValueError, match="tracked only by this EMA"):
        load_checkpoint({"emas": multi}, tmp_path / "multi")
    load_checkpoint({"emas": multi}, tmp_path / "multi", common_subset=True)
    assert multi["a"].updates == 0 and "frozen" in multi["a"].ema_tensors()


def test_multi_model_ema_shares_the_tracked_set() -> None:
    model = _edge()
    multi = MultiModelEMA(model, {"a": {"decay": 0.5}, "b": {"decay": 0.9}}, track="trainable")
    multi.update()
    assert list(multi["a"].ema_tensors()) == list(multi["b"].ema_tensors())
    assert multi["a"].untracked == ["frozen", "float_buf"]
    with pytest.raises(ValueError, match=r"\['track'\], which all EMAs share"):
        MultiModelEMA(model, {"a": {"track": "trainable"}})


def test_multi_model_ema_changes_the_tracked_set_of_every_member() -> None:
    """``multi.add_tensors``/``drop_tensors`` change every member, bit for bit against one
    reference per decay; a member changed alone is refused by the next update (its update
    groups would pair different tensors), with nothing updated."""
    model = _edge()
    decays = {"a": 0.5, "b": 0.9}
    multi = MultiModelEMA(model, {n: {"decay": d, "tau": None} for n, d in decays.items()},
                          track="trainable")  # fmt: skip
    refs = {n: ReferenceEMA(dict(_trainable(model)), d, None) for n, d in decays.items()}
    _step_(model, 0)
    multi.update()
    for ref in refs.values():
        ref.update(dict(model.named_parameters()))
    model.frozen.requires_grad_(True)
    multi.add_tensors(["frozen"])
    for ref in refs.values():
        ref.ema["frozen"] = model.frozen.detach().clone()
    multi["b"].add_tensors(["float_buf"])  # one member alone
    before = {n: {k: v.clone() for k, v in multi[n].ema_tensors().items()} for n in decays}
    with pytest.raises(ValueError, match=r"'a' alone tracks \[\], 'b' alone tracks \['float_b"):
        multi.update()
    assert all(mismatches(multi[n].ema_tensors(), before[n]) == [] for n in decays)
    assert [multi[n].updates for n in decays] == [1, 1]
    multi["a"].add_tensors(["float_buf"])  # realigned by hand
    for ref in refs.values():
        ref.ema["float_buf"] = model.float_buf.detach().clone()  # a buffer: it stays put
    for step in (1, 2):
        _step_(model, step)
        multi.update()
        for ref in refs.values():
            ref.update(dict(model.named_parameters()) | dict(model.named_buffers()))
    for n in decays:
        assert mismatches({k: v.detach() for k, v in multi[n].ema_tensors().items()},
                          refs[n].ema) == []  # fmt: skip
    multi.drop_tensors(["frozen"])
    assert all("frozen" in multi[n].untracked for n in decays)

    # A member that fails part way: the ones already changed are changed back.
    def broken(names: list[str]) -> None:
        raise RuntimeError("out of memory, say")

    multi["b"].add_tensors = broken  # type: ignore[method-assign]
    model.frozen.requires_grad_(True)
    with pytest.raises(RuntimeError, match="out of memory"):
        multi.add_tensors(["frozen"])
    assert all("frozen" in multi[n].untracked for n in decays)
    del multi["b"].add_tensors
    multi.add_tensors(["frozen"])
    multi.update()


# ------------------------------------------------------------------------------ peft LoRA
HAVE_PEFT = importlib.util.find_spec("peft") is not None and (
    importlib.util.find_spec("transformers") is not None
)
needs_peft = pytest.mark.skipif(
    not HAVE_PEFT and not os.environ.get("CI"),
    reason="needs the 'transformers' extra (transformers, peft)",
)


def _base(family: str) -> nn.Module:
    return transformers_base(family)


def _lora(family: str) -> nn.Module:
    return peft_lora(family)


@needs_peft
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_lora_holds_the_adapter_and_exports_it(tmp_path: Path, family: str) -> None:
    import peft

    model = _lora(family)
    adapter = {k: p for k, p in model.named_parameters() if "lora_" in k}
    assert adapter and adapter == _trainable(model)
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    assert ema.local_nbytes() == _bytes(adapter)  # the adapter's bytes, not the model's
    ref = ReferenceEMA(dict(adapter), DECAY, None)
    optimizer = torch.optim.SGD(list(adapter.values()), lr=0.1)
    tokens = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        ref.update(dict(model.named_parameters()))
    assert mismatches({k: v.detach() for k, v in ema.ema_tensors().items()}, ref.ema) == []
    model.eval()
    with ema.average_parameters() as m, torch.no_grad():
        swapped = m(tokens).logits
    with torch.no_grad():
        assert torch.equal(ema.module(tokens).logits, swapped)
    export_ema(ema, tmp_path / "adapter", format="peft")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert meta["dtensor_ema.tensors"] == "adapter" and meta["dtensor_ema.updates"] == "3"
    assert len(keys) == len(adapter) and all(".default." not in k for k in keys)
    loaded = peft.PeftModel.from_pretrained(_base(family), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, swapped)
    # The whole-model export is strict-loadable into a plain peft model.
    export_ema(ema, tmp_path / "whole.safetensors")
    from safetensors.torch import load_model

    fresh = _lora(family)
    missing, unexpected = load_model(fresh, str(tmp_path / "whole.safetensors"))
    assert not missing and not unexpected
    with torch.no_grad():
        assert torch.equal(fresh.eval()(tokens).logits, swapped)


@needs_peft
def test_peft_export_refuses_untracked_adapter_tensors(tmp_path: Path) -> None:
    model = _lora("gpt2")
    ema = ModelEMA(model, track=lambda fqn, t: "lora_A" in fqn)
    with pytest.raises(ValueError, match=r"does not track 2 tensors of adapter 'default'.*lora_B"):
        export_ema(ema, tmp_path / "adapter", format="peft")
    with pytest.raises(TypeError, match="needs the EMA of a peft PeftModel"):
        export_ema(ModelEMA(_edge()), tmp_path / "adapter", format="peft")
    with pytest.raises(ValueError, match="format must be 'file' or 'peft'"):
        export_ema(ema, tmp_path / "x.pt", format="lora")  # type: ignore[arg-type]
    assert not (tmp_path / "adapter").exists()


@needs_peft
def test_hf_trainer_callback_keeps_and_saves_the_adapter_ema(tmp_path: Path) -> None:
    """The Hugging Face ``Trainer`` path: ``EMACallback(track="trainable")`` on a peft
    model; ``save_pretrained`` hands peft a whole state dict and peft writes the adapter."""
    import peft
    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    from dtensor_ema.integrations.transformers import EMACallback, EMATrainer

    hf_logging.set_verbosity_error()
    model = _lora("gpt2")
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(1, 96, (8, 8), generator=g)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    callback = EMACallback(decay=DECAY, tau=None, track="trainable")
    EMATrainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    adapter = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert callback.ema.local_nbytes() == _bytes(adapter)
    callback.save_pretrained(tmp_path / "ema")
    tokens = torch.randint(1, 96, (1, 8), generator=g)
    model.eval()
    with callback.ema.average_parameters() as m, torch.no_grad():
        swapped = m(tokens).logits
    loaded = peft.PeftModel.from_pretrained(_base("gpt2"), str(tmp_path / "ema")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, swapped)


def test_copies_keep_the_tracked_set() -> None:
    """``copy.deepcopy``/``pickle`` of a trainable-only EMA rebuild the same tracked set,
    also after ``add_tensors``, with the same values."""
    import copy
    import io

    model = _edge()
    ema = ModelEMA(model, decay=DECAY, tau=None, track="trainable")
    _step_(model, 0)
    ema.update()
    ema.add_tensors(["frozen"])  # frozen stays requires_grad=False: add_tensors decided it
    _step_(model, 1)
    ema.update()
    copied = copy.deepcopy(ema)
    assert list(copied.ema_tensors()) == list(ema.ema_tensors())
    assert copied.untracked == ["float_buf"] and copied.updates == 2
    assert mismatches(copied.ema_tensors(), ema.ema_tensors()) == []
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert mismatches(loaded.ema_tensors(), ema.ema_tensors()) == []
    loaded.update()  # its model's trainable set is the one it was saved with: no refusal


@pytest.mark.parametrize("bucket_view", [False, True])
def test_drop_ins_follow_add_and_drop_tensors(bucket_view: bool) -> None:
    """A drop-in's module (here ``AveragedModel.module``, the replica every drop-in shares)
    follows ``engine.add_tensors``/``drop_tensors``: a newly tracked tensor holds its EMA,
    a dropped one the model's own tensor, and with ``parameters_as_bucket_view`` the
    rebuilt flat buffers. Before the fix the module kept the slots it was built with: the
    added weight showed the model's raw value, the dropped one a frozen EMA, and with
    bucket views every slot a stale copy, all silently (and in ``state_dict()``)."""
    from dtensor_ema.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    model[0].requires_grad_(False)
    average = AveragedModel(
        model,
        multi_avg_fn=get_ema_multi_avg_fn(DECAY),
        track="trainable",
        parameters_as_bucket_view=bucket_view,
    )
    engine = average.engine
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))

    def agrees() -> bool:
        whole = engine.get_ema_state_dict(include_untracked=True)
        average.eval()
        with torch.no_grad():
            out = average(x)
            with engine.average_parameters():
                swapped = model.eval()(x)
        return mismatches(average.module.state_dict(), whole) == [] and torch.equal(out, swapped)

    for step in range(2):
        _step_(model, step)
        average.update_parameters(model)
    assert agrees()
    model[0].requires_grad_(True)
    engine.add_tensors(["0.weight", "0.bias"])
    assert agrees()  # no update in between: the module's own hooks follow
    for step in range(2, 4):
        _step_(model, step)
        average.update_parameters(model)
    assert agrees()
    model[2].requires_grad_(False)
    engine.drop_tensors(["2.weight", "2.bias"])
    _step_(model, 4)
    average.update_parameters(model)
    assert agrees()
    assert torch.equal(average.module.state_dict()["2.weight"], model[2].weight)
    engine.drop_tensors(["0.bias"])  # dropped and added back: the same untracked set,
    engine.add_tensors(["0.bias"])  # a new EMA tensor (from the model's current value)
    assert agrees()
    _step_(model, 5)
    average.update_parameters(model)
    assert agrees()
