"""Tensor-subclass parameters in one process: the one rule (``plain_tensor`` in
``dtensor_ema/layout.py``, docs/options.md "Tensor subclasses") on crafted subclasses of
every kind, and QLoRA (torchao ``NF4Tensor`` base weights with peft LoRA adapters).

A wrapper subclass that wraps one plain tensor of its own shape and dtype (any other inner
tensors scalars) is averaged through that tensor, bit for bit, and the EMA is plain; a
subclass with storage of its own is viewed as plain; any other kind is refused when the
EMA is built, in one line naming the tensor, its type and the way out. The reference is a
plain ``lerp_`` of the inner tensors, written here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import require_extra
from models import ReferenceEMA, mismatches, perturb_trainable_
from torch import nn
from torch.utils import _pytree as pytree

from dtensor_ema import ModelEMA

DECAY = 0.9


class Crafted(torch.Tensor):
    """A wrapper subclass (no storage of its own) over the inner tensors ``parts``, whose
    values are ``value(*parts)``: ops see that plain tensor (in place, for ``value`` the
    identity on ``parts[0]``)."""

    parts: list[torch.Tensor]
    value: Callable[..., torch.Tensor]

    @staticmethod
    def __new__(
        cls, parts: list[torch.Tensor], value: Callable[..., torch.Tensor], like: torch.Tensor
    ) -> Crafted:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype)  # type: ignore[attr-defined,no-any-return]

    def __init__(
        self, parts: list[torch.Tensor], value: Callable[..., torch.Tensor], like: torch.Tensor
    ) -> None:
        self.parts, self.value = parts, value
        for i, part in enumerate(parts):
            setattr(self, f"p{i}", part)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [f"p{i}" for i in range(len(self.parts))], None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            t = args[0]
            return type(t)([p.detach() for p in t.parts], t.value, t.value(*t.parts))
        args, kwargs = pytree.tree_map_only(Crafted, lambda t: t.value(*t.parts), (args, kwargs))
        return func(*args, **(kwargs or {}))


class NoFlatten(Crafted):
    """The same wrapper without ``__tensor_flatten__``: nothing says what it wraps."""

    __tensor_flatten__ = None  # type: ignore[assignment]


class Classic(torch.Tensor):
    """A subclass with storage of its own (``as_subclass``)."""


def _one(w: torch.Tensor) -> Crafted:  # torchao float8's weight wrapper
    return Crafted([w], lambda d: d, w)


def _with_scale(w: torch.Tensor) -> Crafted:  # ... with its precomputed scale
    return Crafted([w, torch.tensor(0.5)], lambda d, s: d, w)


def _codes(w: torch.Tensor) -> Crafted:  # int8 codes times a scale (NF4-like)
    scale = w.abs().max() / 127
    return Crafted([(w / scale).round().to(torch.int8), scale], lambda c, s: c * s, w)


def _sum(w: torch.Tensor) -> Crafted:  # two candidates of its shape and dtype
    return Crafted([w / 2, w / 2], lambda a, b: a + b, w)


def _no_flatten(w: torch.Tensor) -> NoFlatten:
    return NoFlatten([w], lambda d: d, w)


AVERAGED = {"one_inner": _one, "one_inner_and_a_scale": _with_scale}
REFUSED = {"int8_codes_and_scale": _codes, "two_inner": _sum, "no_flatten": _no_flatten}


def _model(make: Callable[[torch.Tensor], torch.Tensor]) -> tuple[nn.Module, torch.Tensor]:
    """A linear layer whose weight is ``make(w)`` (frozen), and a plain trainable bias."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    inner = model.weight.detach().clone()
    model.weight = nn.Parameter(make(inner), requires_grad=False)
    return model, inner


@pytest.mark.parametrize("kind", list(AVERAGED))
def test_a_wrapper_of_one_plain_tensor_is_averaged_through_it(kind: str) -> None:
    model, inner = _model(AVERAGED[kind])
    ema = ModelEMA(model, decay=DECAY, tau=None)
    reference = ReferenceEMA({"weight": inner, "bias": model.bias}, DECAY, None)
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(step + 1.0)  # an optimizer's in-place step, on the inner tensor
            model.bias.add_(1.0)
        ema.update()
        reference.update({"weight": inner, "bias": model.bias})
        assert mismatches(ema.get_ema_state_dict(), reference.ema) == [], step
    assert all(type(t) is torch.Tensor for t in ema.ema_tensors().values())
    # The wrapper now holds another tensor (as FSDP2's module.to() swaps a local tensor):
    # the EMA follows it (its storage pointer, not the wrapper's null one, is checked).
    inner = inner + 1.0
    model.weight.parts[0] = model.weight.p0 = inner
    ema.update()
    reference.update({"weight": inner, "bias": model.bias})
    assert mismatches(ema.get_ema_state_dict(), reference.ema) == []
    raw = inner.clone()
    with ema.average_parameters():
        assert torch.equal(inner, reference.ema["weight"])
        assert torch.equal(model(torch.ones(1, 4)), torch.ones(1, 4) @ inner.T + model.bias)
    assert torch.equal(inner, raw)


def test_a_subclass_with_its_own_storage_is_viewed_as_plain() -> None:
    model = nn.Linear(4, 3)
    start = model.weight.detach().clone()
    model.weight = nn.Parameter(model.weight.detach().as_subclass(Classic))
    ema = ModelEMA(model, decay=DECAY, tau=None)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    ema_weight = ema.ema_tensors()["weight"]
    assert type(ema_weight) is torch.Tensor
    assert torch.equal(ema_weight, start.lerp(start + 1.0, 1 - DECAY))


@pytest.mark.parametrize("kind", list(REFUSED))
def test_any_other_subclass_is_refused_in_one_line_with_the_way_out(kind: str) -> None:
    model, _ = _model(REFUSED[kind])
    with pytest.raises(ValueError) as caught:
        ModelEMA(model)
    message = str(caught.value)
    assert "\n" not in message
    assert "'weight'" in message and type(model.weight).__qualname__ in message
    assert "track='trainable'" in message
    # The way out works: the frozen subclass weight is left to the model.
    ema = ModelEMA(model, track="trainable")
    assert list(ema.ema_tensors()) == ["bias"] and ema.untracked == ["weight"]


# ---------------------------------------------------------------------------- QLoRA
@pytest.fixture(scope="module")
def qlora() -> Callable[[], nn.Module]:
    require_extra("torchao", "torchao")
    require_extra("peft", "compat")
    from models import qlora_model

    return qlora_model


def test_qlora_default_refuses_the_nf4_weights_in_one_line(qlora: Any) -> None:
    with pytest.raises(ValueError) as caught:
        ModelEMA(qlora())
    message = str(caught.value)
    assert "\n" not in message and "NF4Tensor" in message
    assert "'base_model.model.1.base_layer.weight'" in message
    assert "track='trainable'" in message


def test_qlora_trainable_ema_is_exact_and_exports_as_a_peft_adapter(
    qlora: Any, tmp_path: Path
) -> None:
    import peft

    from dtensor_ema.export.peft import export_peft_adapter

    model = qlora()
    ema = ModelEMA(model, track="trainable", decay=DECAY, tau=None)
    adapters = lambda: {k: p for k, p in model.named_parameters() if p.requires_grad}  # noqa: E731
    reference = ReferenceEMA(adapters(), DECAY, None)
    for step in range(3):
        perturb_trainable_(model, step)
        ema.update()
        reference.update(adapters())
    assert mismatches(ema.get_ema_state_dict(), reference.ema) == []
    assert len(ema.untracked) == 4  # the NF4 weights and the frozen LayerNorm
    written = export_peft_adapter(ema, tmp_path / "adapter")
    assert written is not None
    loaded = peft.PeftModel.from_pretrained(qlora(adapters=False), tmp_path / "adapter")
    got = {k: p for k, p in loaded.named_parameters() if "lora_" in k}
    assert mismatches(got, reference.ema) == []
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert torch.equal(ema.module(x), loaded(x))
    # A whole state dict would copy the NF4 weights: refused in one line, not by NF4.
    with pytest.raises(ValueError, match=r"NF4Tensor.*export_peft_adapter") as caught:
        ema.get_ema_state_dict(include_untracked=True)
    assert "\n" not in str(caught.value)
