"""A model tensor replaced between two updates is noticed by the first ``update()`` after
it (issue 48), at W=1 and W=2: the per-call check became cheap, not weaker.

Each rank runs every case once (one spawn per world size), on a plain replicated model
(the EMA split over the ranks) and on an FSDP2 model:

* replaced in place with the same shape (``.data =``, ``load_state_dict(assign=True)``,
  FSDP2's ``module.to()`` there and back): the first update averages the new tensors;
* replaced with another shape or dtype, or removed (``register_parameter(name, None)``):
  the first update raises the documented ``ValueError`` and writes nothing.

``MultiModelEMA`` checks the model once for all its EMAs; a member re-bound alone since is
checked again (one process).

The followed cases also run with the check skipped (``EmaPlan.sync`` stubbed out): their
EMA then averages the stale tensors, so these tests fail if the check stops catching them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import DEVICE_TYPE, run_ranks
from models import mismatches
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtensor_ema import ModelEMA, MultiModelEMA
from dtensor_ema.plan import EmaPlan

pytestmark = pytest.mark.distributed

DECAY = 0.5


def _model(fsdp: bool) -> nn.Module:
    torch.manual_seed(0)  # the same replicas on every rank
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).to(DEVICE_TYPE)
    if fsdp:
        fully_shard(model, mesh=init_device_mesh(DEVICE_TYPE, (dist.get_world_size(),)))
    return model


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole CPU copies (``full_tensor()`` is a collective: every rank calls it)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in tensors.items()
    }


def _reference(start: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """One EMA step written here: plain lerp of the whole tensors toward the model's."""
    now = _full(dict(model.named_parameters()))
    return {k: v.lerp(now[k].to(v.dtype), 1 - DECAY) for k, v in start.items()}


@contextlib.contextmanager
def _check_skipped() -> Iterator[None]:
    """The control: ``update()`` with the liveness check stubbed out."""
    real = EmaPlan.sync
    EmaPlan.sync = lambda self, **kwargs: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        EmaPlan.sync = real  # type: ignore[method-assign]


def _followed(fsdp: bool, replace: Callable[[nn.Module], None], skip: bool) -> list[str]:
    """Replace, update once, compare with the reference: the tensors that differ."""
    model = _model(fsdp)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    start = _full(ema.ema_tensors())
    replace(model)
    with _check_skipped() if skip else contextlib.nullcontext():
        ema.update()
    return mismatches(_full(ema.ema_tensors()), _reference(start, model))


def _refused(fsdp: bool, replace: Callable[[nn.Module], None]) -> dict[str, Any]:
    """Replace, update once: the error, and whether the EMA and its count stayed put."""
    model = _model(fsdp)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    start = _full(ema.ema_tensors())
    replace(model)
    try:
        ema.update()
        error = "accepted"
    except ValueError as e:
        error = str(e)
    return {
        "error": error,
        "unchanged": mismatches(_full(ema.ema_tensors()), start) == [] and ema.updates == 0,
    }


def _assign_data(model: nn.Module) -> None:
    model[0].weight.data = torch.full((6, 4), 2.0, device=DEVICE_TYPE)


def _load_assign(model: nn.Module) -> None:
    state = {k: torch.full_like(v, 1.5) for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _to_and_back(model: nn.Module) -> None:
    """FSDP2 swaps the local tensors inside the same DTensor objects (new storage)."""
    model.to(torch.float64)
    model.to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)


FOLLOWED: dict[str, tuple[bool, Callable[[nn.Module], None]]] = {
    "plain .data =": (False, _assign_data),
    "plain load_state_dict(assign=True)": (False, _load_assign),
    "fsdp2 module.to() there and back": (True, _to_and_back),
}

REFUSED: dict[str, tuple[bool, Callable[[nn.Module], None], str]] = {
    "plain .data = another shape": (
        False,
        lambda m: setattr(m[0].weight, "data", torch.randn(5, 4, device=DEVICE_TYPE)),
        "0.weight: was (6, 4) torch.float32, now (5, 4) torch.float32",
    ),
    "plain module.to(float64)": (
        False,
        lambda m: m.to(torch.float64),
        "0.weight: was (6, 4) torch.float32, now (6, 4) torch.float64",
    ),
    "plain parameter set to None": (
        False,
        lambda m: m[1].register_parameter("bias", None),
        "1.bias: missing from the model",
    ),
    "fsdp2 module.to(float64)": (
        True,
        lambda m: m.to(torch.float64),
        "0.weight: was (6, 4) torch.float32, now (6, 4) torch.float64",
    ),
}


def replaced_body(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "followed": {name: _followed(f, fn, skip=False) for name, (f, fn) in FOLLOWED.items()},
        "skipped": {name: _followed(f, fn, skip=True) for name, (f, fn) in FOLLOWED.items()},
        "refused": {name: _refused(f, fn) for name, (f, fn, _) in REFUSED.items()},
    }


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"W{w}")
def replaced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return run_ranks(replaced_body, request.param, tmp_path_factory.mktemp("replaced"))


@pytest.mark.parametrize("case", list(FOLLOWED))
def test_a_tensor_replaced_in_place_is_followed_by_the_first_update(
    replaced: list[dict[str, Any]], case: str
) -> None:
    for rank, result in enumerate(replaced):
        assert result["followed"][case] == [], (rank, case)


@pytest.mark.parametrize("case", list(FOLLOWED))
def test_without_the_check_the_same_update_reads_stale_tensors(
    replaced: list[dict[str, Any]], case: str
) -> None:
    """The control that gives the test above its teeth."""
    for rank, result in enumerate(replaced):
        assert result["skipped"][case] != [], (rank, case)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_tensor_replaced_otherwise_is_refused_by_the_first_update(
    replaced: list[dict[str, Any]], case: str
) -> None:
    expected = REFUSED[case][2]
    for rank, result in enumerate(replaced):
        got = result["refused"][case]
        assert "the model's tensors changed" in got["error"], (rank, got)
        assert expected in got["error"], (rank, got)
        assert got["unchanged"], (rank, case)


def test_multi_checks_again_a_member_rebound_alone() -> None:
    """``multi["b"].set()`` re-binds ``b`` alone to a replaced tensor; the model then goes
    back to the storage ``a`` was bound to. The next ``multi.update()`` finds ``a`` current,
    so only ``b``'s own check can notice that ``b`` holds a tensor the model dropped: ``b``
    still copies the model (``update_after_step``), which reads ``b``'s own views. (The EMAs
    are read only after that update: every read checks the model first.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    start = _full(dict(model.named_parameters()))
    emas = {"a": {"decay": DECAY, "tau": None}, "b": {"decay": DECAY, "update_after_step": 9}}
    multi = MultiModelEMA(model, emas)
    multi.update()
    old = model[0].weight.data
    model[0].weight.data = torch.full((6, 4), 2.0)
    multi["b"].set()
    model[0].weight.data = old
    with torch.no_grad():
        old.fill_(3.0)
    multi.update()
    now = _full(dict(model.named_parameters()))
    assert mismatches(_full(multi["a"].ema_tensors()), _reference(start, model)) == []
    assert mismatches(_full(multi["b"].ema_tensors()), now) == []  # a copy of the model
