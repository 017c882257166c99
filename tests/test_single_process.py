"""One process, no process group: the seed's ``python train.py`` case, plus pure math."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import ReferenceEMA, make_model, mismatches, train_step, with_torchvision
from torch import nn

from dtensor_ema import ModelEMA, RampDecay, chunk_range


@pytest.mark.parametrize("world_size", range(1, 10))
def test_chunk_range_matches_torch_chunk(world_size: int) -> None:
    for n in range(0, 65):
        chunks = torch.arange(n).chunk(world_size) if n else ()
        for rank in range(world_size):
            offset, length = chunk_range(n, world_size, rank)
            expected = chunks[rank] if rank < len(chunks) else torch.empty(0, dtype=torch.long)
            assert length == expected.numel(), (n, world_size, rank)
            if length:
                assert offset == int(expected[0])
            else:
                assert offset == n  # DTensor clamps an empty shard's offset to n


def test_ramp_decay_formula() -> None:
    ramp = RampDecay(decay=0.9999, tau=2000)
    for updates in (1, 10, 2000, 10**6):
        assert ramp(updates) == 0.9999 * (1 - math.exp(-updates / 2000))
    assert RampDecay(decay=0.5, tau=None)(1) == 0.5
    assert RampDecay(decay=0.5, tau=0)(7) == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": 1.5}, r"decay must be in \[0, 1\], got 1.5"),
        ({"decay": -0.1}, r"decay must be in \[0, 1\], got -0.1"),
        ({"tau": -1}, r"tau must be >= 0, got -1"),
        ({"updates": -3}, r"updates must be an int >= 0, got -3"),
        ({"ema_dtype": torch.int32}, r"ema_dtype must be a floating-point torch.dtype"),
        ({"mesh": "cpu"}, r"mesh must be a torch DeviceMesh or None, got str"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        ModelEMA(nn.Linear(2, 2), **kwargs)


def test_model_without_float_state_is_rejected() -> None:
    model = nn.Module()
    model.register_buffer("count", torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no floating-point parameters or buffers"):
        ModelEMA(model)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        ModelEMA({})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", with_torchvision(["edge", "resnet18", "transformer"]))
def test_unsharded_ema_matches_reference_without_process_group(name: str) -> None:
    assert not dist.is_initialized()
    model = make_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEMA(model, decay=0.9, tau=2)
    ref = ReferenceEMA(model.state_dict(), 0.9, 2)
    assert ema.mesh is None
    for step in range(3):
        train_step(name, model, optimizer, step)
        ema.update(model)
        ref.update(model.state_dict())
    assert ema.updates == 3 and ema.last_decay == 0.9 * (1 - math.exp(-3 / 2))
    assert mismatches(ema.ema_tensors(), {k: ref.ema[k] for k in ema.ema_tensors()}) == []
    ema_sd, ori_sd = ema.get_model_state_dict()
    assert list(ema_sd) == list(model.state_dict())
    assert mismatches(ori_sd, model.state_dict()) == []
    expected = {k: ref.ema.get(k, v) for k, v in model.state_dict().items()}
    assert mismatches(ema_sd, expected) == []
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.average_parameters() as m:
        assert m is model
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert mismatches(inside, expected) == []
    assert mismatches(model.state_dict(), before) == []
    # The seed's evaluation pattern: load EMA weights, evaluate, load the originals back.
    model.load_state_dict(ema_sd, strict=True)
    model.load_state_dict(ori_sd, strict=True)
    assert mismatches(model.state_dict(), before) == []


def test_dcp_round_trip_without_process_group(tmp_path: object) -> None:
    model = make_model("edge")
    ema = ModelEMA(model, decay=0.5, tau=None)
    with torch.no_grad():
        model.odd.add_(1.0)
    ema.update()
    saved = {k: v.clone() for k, v in ema.ema_tensors().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assumes a single process"
        dcp.save({"ema": ema}, checkpoint_id=str(tmp_path))
        ema.update()
        ema.update()
        fresh = ModelEMA(make_model("edge"), decay=0.5, tau=None)
        dcp.load({"ema": fresh}, checkpoint_id=str(tmp_path))
    assert fresh.updates == 1
    assert mismatches(fresh.ema_tensors(), saved) == []


def test_load_state_dict_validates_and_round_trips() -> None:
    model = make_model("edge")
    ema = ModelEMA(model, decay=0.5, tau=None)
    with torch.no_grad():
        model.odd.mul_(2)
    ema.update()
    state = {k: v for k, v in ema.state_dict().items()}
    state["ema"] = {k: v.clone() for k, v in state["ema"].items()}
    other = ModelEMA(make_model("edge"), decay=0.5, tau=None)
    other.load_state_dict(state)
    assert other.updates == 1
    assert mismatches(other.ema_tensors(), ema.ema_tensors()) == []

    missing = dict(state, ema={k: v for k, v in state["ema"].items() if k != "odd"})
    with pytest.raises(ValueError, match=r"missing \['odd'\]"):
        other.load_state_dict(missing)
    extra = dict(state, ema=dict(state["ema"], ghost=torch.zeros(1)))
    with pytest.raises(ValueError, match=r"unexpected \['ghost'\]"):
        other.load_state_dict(extra)
    wrong_shape = dict(state, ema=dict(state["ema"], odd=torch.zeros(3, 3)))
    with pytest.raises(ValueError, match=r"odd: saved \(3, 3\) torch.float32, this EMA \(13, 7\)"):
        other.load_state_dict(wrong_shape)
    wrong_dtype = dict(state, ema=dict(state["ema"], odd=torch.zeros(13, 7, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"odd: saved \(13, 7\) torch\.float64, this EMA"):
        other.load_state_dict(wrong_dtype)
    with pytest.raises(
        ValueError, match=r"options differ.*schedule: checkpoint .*0.5.*this EMA .*0.25"
    ):
        ModelEMA(make_model("edge"), decay=0.25, tau=None).load_state_dict(state)
    with pytest.raises(KeyError, match="no 'updates' entry"):
        other.load_state_dict({"ema": state["ema"]})


def test_update_rejects_another_model_and_changed_models() -> None:
    model = make_model("edge")
    ema = ModelEMA(model)
    with pytest.raises(ValueError, match="not the model this EMA tracks"):
        ema.update(make_model("edge"))
    model.conv = nn.Conv2d(3, 6, 3)  # a new shape under the same names
    with pytest.raises(ValueError, match=r"conv.weight: was \(5, 3, 3, 3\).*now \(6, 3, 3, 3\)"):
        ema.update()
    model = make_model("edge")
    ema = ModelEMA(model)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"extra\.weight: new in the model"):
        ema.update()


def test_update_follows_reassigned_tensors() -> None:
    """``param.data = ...`` and ``load_state_dict(assign=True)`` re-allocate tensors; the
    EMA must read the new ones, not stale views of the old storage."""
    model = nn.Linear(3, 2)
    ema = ModelEMA(model, decay=0.5, tau=None)
    ref = ReferenceEMA(model.state_dict(), 0.5, None)
    model.weight.data = torch.full((2, 3), 4.0)
    ema.update()
    ref.update(model.state_dict())
    model.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, assign=True)
    ema.update()
    ref.update(model.state_dict())
    assert mismatches(ema.ema_tensors(), ref.ema) == []


def test_low_precision_model_gets_float32_ema() -> None:
    model = make_model("edge").to(torch.bfloat16)
    ema = ModelEMA(model, decay=0.9, tau=None)
    assert all(t.dtype == torch.float32 for t in ema.ema_tensors().values())
    ema_sd, _ = ema.get_model_state_dict()
    assert ema_sd["odd"].dtype == torch.bfloat16
    assert ModelEMA(model, ema_dtype=torch.bfloat16).ema_tensors()["odd"].dtype == torch.bfloat16


def test_plain_dcp_load_with_other_options_says_tensors_were_overwritten(tmp_path: object) -> None:
    ema = ModelEMA(make_model("edge"), decay=0.5, tau=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"ema": ema}, checkpoint_id=str(tmp_path))
        other = ModelEMA(make_model("edge"), decay=0.25, tau=None)
        with pytest.raises(ValueError, match=r"already overwritten in place by dcp\.load"):
            dcp.load({"ema": other}, checkpoint_id=str(tmp_path))


@pytest.mark.parametrize("chunk", [7, 1 << 24])
def test_bf16_staged_upcast_matches_reference(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed dtypes upcast through a reused scratch buffer, in slices of ``chunk`` elements
    (7: every tensor split, batches of one slice); a channels_last weight takes the
    non-contiguous path. Both must equal the plain upcast-then-lerp reference."""
    import dtensor_ema.update.fused_update as fused_update

    monkeypatch.setattr(fused_update, "UPCAST_CHUNK", chunk)
    model = make_model("edge").to(torch.bfloat16)
    model.conv.to(memory_format=torch.channels_last)
    assert not model.conv.weight.is_contiguous()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = ModelEMA(model, decay=0.8, tau=3)
    ref = ReferenceEMA(model.state_dict(), 0.8, 3)
    for step in range(4):
        train_step("edge", model, optimizer, step)
        ema.update()
        ref.update(model.state_dict())
    assert mismatches(ema.ema_tensors(), {k: ref.ema[k] for k in ema.ema_tensors()}) == []


def test_pickling_inside_average_parameters_is_refused() -> None:
    """A copy made while the EMA is swapped in would hold the EMA weights as its model's
    training weights, silently (its next update would average from them). Before the fix
    ``copy.deepcopy`` and ``pickle`` succeeded and the copy's model held the EMA weights;
    now they raise, and the original restores the training weights on exit."""
    import copy
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ema = ModelEMA(model, decay=0.5, tau=None)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.average_parameters():
        with pytest.raises(RuntimeError, match="inside average_parameters"):
            copy.deepcopy(ema)
        with pytest.raises(RuntimeError, match="inside average_parameters"):
            pickle.dumps(ema)
    assert all(torch.equal(raw[k], v) for k, v in model.state_dict().items())
    copied = copy.deepcopy(ema)  # after the context: the training weights
    assert all(torch.equal(raw[k], v) for k, v in copied.model.state_dict().items())
