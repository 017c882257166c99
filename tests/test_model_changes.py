"""Model changes and tensor kinds the EMA must refuse rather than get silently wrong
(issue 35, items 7 and 8), in one process.

* Removing a tracked tensor after construction (``del model.head``, ``del model.body.bias``,
  ``register_parameter("bias", None)``) fires no registration hook; the EMA used to carry
  on and export keys the model no longer has. Now the next ``update()`` and every read
  refuse, naming the tensor, as a replacement with another shape is refused.
* Complex parameters used to be filed with the integer buffers: copied from the model,
  never averaged. Now tracking one is refused, naming complex dtypes; left untracked
  (``track=``), they are read from the model like any untracked tensor. Complex buffers
  still follow the model, as integer buffers do.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from dtensor_ema import ModelEMA


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(4, 2)


def _delete_head(model: Net) -> None:
    del model.head


def _delete_bias(model: Net) -> None:
    del model.body.bias


def _bias_to_none(model: Net) -> None:
    model.body.register_parameter("bias", None)


def _buffer_to_none(model: Net) -> None:
    model.body.register_buffer("steps", None)


REMOVALS: dict[str, tuple[Callable[[Net], None], str]] = {
    "del_submodule": (_delete_head, "head.weight"),
    "del_parameter": (_delete_bias, "body.bias"),
    "parameter_to_none": (_bias_to_none, "body.bias"),
    "integer_buffer_to_none": (_buffer_to_none, "body.steps"),
}


@pytest.mark.parametrize("case", list(REMOVALS))
def test_removed_tensors_are_refused_at_the_next_update_and_read(case: str) -> None:
    remove, name = REMOVALS[case]
    torch.manual_seed(0)
    model = Net()
    ema = ModelEMA(model, decay=0.5, tau=None)
    ema.update()
    before = {k: v.clone() for k, v in ema.ema_tensors().items()}
    remove(model)
    for call in (ema.update, ema.get_model_state_dict, ema.get_ema_state_dict, ema.set):
        with pytest.raises(ValueError, match=rf"tensors changed.*{name}: missing from the model"):
            call()
    with pytest.raises(ValueError, match="missing from the model"), ema.average_parameters():
        pass
    after = ema.ema_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was written
    assert ema.updates == 1


def test_replacing_and_removing_read_alike() -> None:
    """The refusal of a removal reads like the (already refused) replacement's."""
    model = Net()
    ema = ModelEMA(model)
    model.head = nn.Linear(4, 5)
    with pytest.raises(ValueError, match=r"tensors changed since the EMA was created"):
        ema.update()


def test_forward_without_backward_on_an_unchanged_model_still_updates() -> None:
    """The removal check compares registrations by identity; a model that only ran a
    forward (nothing re-registered) keeps the fast path and updates exactly."""
    model = Net()
    ema = ModelEMA(model, decay=0.5, tau=None)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    for _ in range(3):
        with torch.no_grad():
            model.head(model.body.weight.sum(1, keepdim=True).expand(4, 4))
            for p in model.parameters():
                p.add_(0.25)
        ema.update()
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                ref[k].lerp_(v, 0.5)
    got = ema.ema_tensors()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


class WithComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.real = nn.Linear(3, 2)
        self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))


def test_complex_parameters_are_refused_naming_complex_dtypes() -> None:
    with pytest.raises(ValueError, match=r"phase \(torch.complex64\).*complex.*track="):
        ModelEMA(WithComplex())
    only_complex = nn.Module()
    only_complex.z = nn.Parameter(torch.randn(3, dtype=torch.complex128))
    with pytest.raises(ValueError, match=r"z \(torch.complex128\)"):
        ModelEMA(only_complex)


def test_untracked_complex_parameters_are_read_from_the_model() -> None:
    model = WithComplex()
    ema = ModelEMA(model, decay=0.5, tau=None, track=lambda fqn, t: not t.is_complex())
    assert ema.untracked == ["phase"]
    with torch.no_grad():
        model.real.weight.add_(1.0)
        model.phase.mul_(2.0)
    ema.update()
    full, _ = ema.get_model_state_dict()
    assert torch.equal(full["phase"], model.phase.detach())  # the model's, never a copy
    assert full["phase"].data_ptr() != model.phase.data_ptr()
    with pytest.raises(ValueError, match=r"'phase': torch.complex64, complex"):
        ema.add_tensors(["phase"])
    with torch.no_grad():
        expected = model.real.weight.detach() - 1.0
        expected = expected.lerp(model.real.weight.detach(), 0.5)
    assert torch.equal(full["real.weight"], expected)


class WithComplexBuffer(nn.Module):
    """Meta-llama's pattern: a persistent complex rotary table beside real weights."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4), torch.arange(4.0)))


def test_complex_buffers_follow_the_model() -> None:
    """Complex buffers are not parameters: they follow the model, as integer buffers do
    (refusing them would refuse every model with a persistent ``freqs_cis``)."""
    model = WithComplexBuffer()
    ema = ModelEMA(model, decay=0.5, tau=None)
    assert "freqs_cis" not in ema.ema_tensors() and ema.untracked == []
    with torch.no_grad():
        model.freqs_cis.mul_(2.0)
    ema.update()
    full, _ = ema.get_model_state_dict()
    assert torch.equal(full["freqs_cis"], model.freqs_cis)
