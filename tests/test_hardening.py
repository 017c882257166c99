"""Failure paths and round trips found by review (issue 15), in one process.

Each test fails on the code before the fix: an offloaded update that failed in the worker
was counted anyway; the library's own full-tensor outputs could not be loaded back;
``load_checkpoint`` claimed a refused checkpoint had been overwritten; DCP's
``CheckpointException`` escaped ``except Exception``; ``rank0_only`` read as "only rank 0
calls"; stale docstrings.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from models import make_model, mismatches
from torch import nn

import dtensor_ema
from dtensor_ema import ModelEMA, export_ema, load_checkpoint, save_checkpoint
from dtensor_ema.update.fused_update import UpdateGroup


def _reference(states: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """Constant-decay EMA of the float tensors over ``states`` (the first initializes)."""
    ema = {k: v.detach().clone() for k, v in states[0].items() if v.is_floating_point()}
    for state in states[1:]:
        for k in ema:
            ema[k].lerp_(state[k].detach(), 1 - decay)
    return ema


def _dtensor_ema_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dtensor_ema")]


def _step(model: nn.Module, value: float) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ offload
def test_failed_offloaded_update_is_not_counted_and_surfaces_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(3, 4)
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    ema = ModelEMA(model, decay=0.5, tau=None, offload=True)
    original = UpdateGroup.apply_
    failures = {"left": 1}

    def flaky(self: UpdateGroup, decay: float, sources: Any = None) -> None:
        if sources is not None and failures["left"]:  # the worker thread's call
            failures["left"] -= 1
            raise OSError("injected worker failure")
        original(self, decay, sources)

    monkeypatch.setattr(UpdateGroup, "apply_", flaky)
    states.append(_step(model, 1.0))
    ema.update()  # its step fails in the worker
    _step(model, 1.0)  # the lost step's sources move on
    # The next call of any kind raises, once; the failed step was neither applied nor counted.
    with pytest.raises(RuntimeError, match="offloaded EMA update failed") as caught:
        ema.state_dict()
    assert isinstance(caught.value.__cause__, OSError)
    assert ema.updates == 0
    assert ema.last_decay is None
    assert mismatches(dict(ema.ema_tensors()), _reference(states[:1], 0.5)) == []
    states = [states[0], {k: v.detach().clone() for k, v in model.state_dict().items()}]
    ema.update()
    assert ema.updates == 1
    assert mismatches(dict(ema.ema_tensors()), _reference(states, 0.5)) == []
    # flush() surfaces it too.
    failures["left"] = 1
    ema.update()
    with pytest.raises(RuntimeError, match="offloaded EMA update failed"):
        ema.flush()
    assert ema.updates == 1
    ema.close()


def test_close_joins_the_worker_and_rebinding_reuses_it() -> None:
    before = len(_dtensor_ema_threads())
    model = nn.Linear(3, 4)
    with ModelEMA(model, decay=0.5, tau=None, offload=True) as ema:
        for value in range(4):
            model.weight.data = torch.full((4, 3), float(value))  # re-bind every step
            ema.update()
        assert len(_dtensor_ema_threads()) <= before + 1  # one worker, never one per re-bind
        assert ema.updates == 4
    assert len(_dtensor_ema_threads()) == before
    assert ema.state_dict()["updates"] == 4  # reading still works after close
    with pytest.raises(RuntimeError, match="closed"):
        ema.update()
    ema.close()  # idempotent
    inline = ModelEMA(model)
    inline.close()
    with pytest.raises(RuntimeError, match="closed"):
        inline.update()


# ----------------------------------------------------------------- full-tensor round trips
@pytest.mark.parametrize("name", ["edge", "transformer"])  # int buffers; tied weights
def test_full_state_dict_and_export_load_back(name: str, tmp_path: Path) -> None:
    model = make_model(name)
    ema = ModelEMA(model, decay=0.5, tau=None)
    _step(model, 0.25)
    ema.update()
    full = ema.get_ema_state_dict()
    assert any(not v.is_floating_point() for v in full.values()) or name == "transformer"
    fresh = ModelEMA(make_model(name), decay=0.5, tau=None)
    with pytest.raises(KeyError, match=r"load_full_state_dict"):
        fresh.load_state_dict(full)  # a model-keyed dict is not the sharded state
    fresh.load_full_state_dict(full, updates=ema.updates)
    assert fresh.updates == 1
    assert mismatches(fresh.ema_tensors(), ema.ema_tensors()) == []
    path = tmp_path / "ema.pt"
    export_ema(ema, path)
    other = ModelEMA(make_model(name), decay=0.5, tau=None)
    other.load_full_state_dict(torch.load(path, weights_only=True))
    assert mismatches(other.ema_tensors(), ema.ema_tensors()) == []
    with pytest.raises(ValueError, match=r"missing \[.*; unexpected \[.ghost.\]"):
        other.load_full_state_dict({"ghost": torch.zeros(1)})


def test_bf16_export_loads_back_rounded() -> None:
    model = make_model("edge").to(torch.bfloat16)
    ema = ModelEMA(model, decay=0.5, tau=None)
    _step(model, 0.1)
    ema.update()
    full = ema.get_ema_state_dict()  # in the model's bf16
    fresh = ModelEMA(make_model("edge").to(torch.bfloat16), decay=0.5, tau=None)
    fresh.load_full_state_dict(full)
    expected = {k: v.to(torch.bfloat16).float() for k, v in ema.ema_tensors().items()}
    assert mismatches(fresh.ema_tensors(), expected) == []


def test_refused_load_state_dict_changes_nothing() -> None:
    model = make_model("edge")
    ema = ModelEMA(model, decay=0.5, tau=None)
    ema.update()
    state = ema.state_dict()
    state = {**state, "ema": {k: v.clone() + 1 for k, v in state["ema"].items()}}
    state["ema"]["odd"] = torch.zeros(2, 2)
    before = {k: v.clone() for k, v in ema.ema_tensors().items()}
    with pytest.raises(ValueError, match=r"mismatched \['odd: saved \(2, 2\)"):
        ema.load_state_dict({**state, "updates": 7})
    assert ema.updates == 1 and mismatches(ema.ema_tensors(), before) == []


# --------------------------------------------------------------------------- checkpoints
def test_load_checkpoint_refusal_does_not_claim_an_overwrite(tmp_path: Path) -> None:
    ema = ModelEMA(make_model("edge"), decay=0.5, tau=None)
    ema.update()
    save_checkpoint({"ema": ema}, tmp_path / "ckpt")
    other = ModelEMA(make_model("edge", seed=1), decay=0.25, tau=None)
    before = {k: v.clone() for k, v in other.ema_tensors().items()}
    with pytest.raises(ValueError, match="cannot resume the EMA under 'ema'") as caught:
        load_checkpoint({"ema": other}, tmp_path / "ckpt")
    assert "overwritten" not in str(caught.value)
    assert other.updates == 0 and mismatches(other.ema_tensors(), before) == []


def test_checkpoint_failures_are_ordinary_exceptions(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    class Failing:
        def state_dict(self) -> dict[str, Any]:
            raise CheckpointException("injected", {})

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    ema = ModelEMA(nn.Linear(3, 3))
    caught: list[BaseException] = []
    try:
        save_checkpoint({"ema": ema, "other": Failing()}, tmp_path / "a")
    except Exception as e:  # must not escape this
        caught.append(e)
    from dtensor_ema import CheckpointError

    assert len(caught) == 1 and isinstance(caught[0], CheckpointError)
    assert isinstance(caught[0].__cause__, CheckpointException)
    save_checkpoint({"ema": ema, "model": nn.Linear(3, 3).state_dict()}, tmp_path / "b")
    # One line naming the checkpoint and what DCP raised, without DCP's wrapper and its
    # traceback (issue 42: "CheckpointException ranks:dict_keys([0])" and 20 lines before).
    with pytest.raises(CheckpointError) as loading:
        load_checkpoint({"ema": ema, "model": nn.Linear(4, 4).state_dict()}, tmp_path / "b")
    assert str(loading.value) == (
        f"{tmp_path / 'b'}: loading failed: ValueError: Size mismatch between saved "
        "torch.Size([3, 3]) and current: torch.Size([4, 4]) for model.weight"
    )
    assert isinstance(loading.value, RuntimeError) and loading.value.__cause__ is None


# ------------------------------------------------------------------------ naming and docs
def test_rank0_only_is_renamed_with_a_deprecation_warning() -> None:
    ema = ModelEMA(make_model("edge"))
    with pytest.warns(DeprecationWarning, match="every rank must still call"):
        old, _ = ema.get_model_state_dict(rank0_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new, _ = ema.get_model_state_dict(only_rank0_receives=True)
        ema.get_ema_state_dict(only_rank0_receives=True)
    assert mismatches(old, new) == []


def test_docstrings_cover_every_option_and_what_load_does() -> None:
    doc = ModelEMA.__doc__ or ""
    for option in ("capturable:", "offload:"):
        assert option in doc
    module_doc = dtensor_ema.model_ema.__doc__ or ""
    for schedule in ("half_life", "WarmupDecay", "update_every", "update_after_step"):
        assert schedule in module_doc
    load_doc = ModelEMA.load_state_dict.__doc__ or ""
    assert "full_tensor" not in load_doc and "no collective" in load_doc


def test_multi_ema_validates_every_member_before_loading_any() -> None:
    from dtensor_ema import MultiModelEMA

    model = make_model("edge")
    emas = MultiModelEMA(model, {"a": {"decay": 0.5, "tau": None}, "b": {"half_life": 3.0}})
    emas.update()
    state = emas.state_dict()
    good = {**state["a"], "ema": {k: v.clone() + 1 for k, v in state["a"]["ema"].items()}}
    bad = {**state["b"], "config": state["a"]["config"]}  # another member's options
    before = {k: v.clone() for k, v in emas["a"].ema_tensors().items()}
    with pytest.raises(ValueError, match=r"EMA 'b': .*options differ"):
        emas.load_state_dict({"a": {**good, "updates": 5}, "b": bad})
    assert emas["a"].updates == 1 and mismatches(emas["a"].ema_tensors(), before) == []
