"""Model surgery after the EMA was created: refused with the documented ``ValueError``
(never a raw kernel error, never silently accepted), and change detection that costs
nothing when only *other* modules register tensors. One process, no process group.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import dtensor_ema.plan as plan_module
from dtensor_ema import ModelEMA, watch


def _ema_values(ema: ModelEMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.ema_tensors().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reallocated_with_another_shape_is_refused() -> None:
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ema = ModelEMA(m, decay=0.5, tau=None)
    before = _ema_values(ema)
    m[0].weight.data = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"0\.weight: was \(3, 4\) torch.float32, now \(5, 4\)"):
        ema.update()
    assert _same(_ema_values(ema), before) and ema.updates == 0


def test_reallocated_with_another_dtype_is_refused() -> None:
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ema = ModelEMA(m, decay=0.5, tau=None)
    m[0].weight.data = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"0\.weight: .* now \(3, 4\) torch.float64"):
        ema.update()
    assert ema.updates == 0


def test_reallocated_in_place_is_followed() -> None:
    m = nn.Sequential(nn.Linear(4, 3))
    ema = ModelEMA(m, decay=0.5, tau=None)
    start = _ema_values(ema)
    m[0].weight.data = torch.full((3, 4), 2.0)
    ema.update()
    got = ema.ema_tensors()["0.weight"]
    assert torch.equal(got, start["0.weight"].lerp(torch.full((3, 4), 2.0), 0.5))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight


def test_untying_tied_weights_is_refused() -> None:
    m = Tied()
    ema = ModelEMA(m, decay=0.5, tau=None)
    m.b.weight = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"b\.weight: was tied to a\.weight"):
        ema.update()
    with pytest.raises(ValueError, match="was tied"):
        ema.get_model_state_dict()


def test_meta_device_model_is_refused() -> None:
    with torch.device("meta"):
        m = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        ModelEMA(m)


def test_other_modules_registering_tensors_cost_no_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss module built inside the training step registers a buffer; the tracked model
    did not change, so update() must not walk its state dict (the old global counter did)."""
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema = ModelEMA(m, decay=0.5, tau=None)
    walks = []
    real = plan_module.model_tensors
    monkeypatch.setattr(plan_module, "model_tensors", lambda mod: walks.append(1) or real(mod))
    for _ in range(3):
        nn.CrossEntropyLoss(weight=torch.ones(3))  # registers a buffer elsewhere
        nn.Linear(2, 2)
        ema.update()
    assert walks == []
    m.add_module("extra", nn.Linear(3, 3))  # a registration on the tracked model: re-walk
    with pytest.raises(ValueError, match=r"extra\.weight: new in the model"):
        ema.update()
    assert walks


def test_registration_hooks_are_removed_when_no_ema_is_alive() -> None:
    ema = ModelEMA(nn.Linear(2, 2))
    assert watch.hooks_installed()
    del ema
    gc.collect()
    if list(watch._watches):  # another test still holds an EMA in this process
        pytest.skip("other EMAs are alive in this process")
    assert not watch.hooks_installed()
