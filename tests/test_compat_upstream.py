"""What the originals' own unit tests exercise, on the drop-ins, against the real libraries.

The upstream files (torch ``test/optim/test_swa_utils.py``, Lightning
``tests/tests_pytorch/callbacks/test_weight_averaging.py``, diffusers
``tests/others/test_ema.py``, timm ``tests/test_task.py``) are run outside this repository
with only the import swapped; each test here mirrors the behaviours one of them exercises
(named in its docstring) with code of our own, usually more strictly: bit for bit against
the real library rather than ``allclose``. Plus the rules those files cannot see: any
elementwise averaging function on each rank's pieces, pickling, Lightning's hooks, and no
hidden collective in a rank-0 habit (one spawned body at W=2).
"""

from __future__ import annotations

import copy
import io
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("ema_pytorch", "compat")
require_extra("diffusers", "compat")
require_extra("lightning", "compat")
require_extra("timm", "zoo")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import UNet2DModel  # noqa: E402
from diffusers.training_utils import EMAModel as RealEMAModel  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from lightning_mirror import (  # noqa: E402
    Decayed,
    LateModule,
    OurCounting,
    RealCounting,
    TinyModule,
    fit,
)
from models import tiny_unet  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.optim import swa_utils as torch_swa  # noqa: E402

from dtensor_ema import ModelEMA, MultiModelEMA  # noqa: E402
from dtensor_ema.compat import diffusers as our_diffusers  # noqa: E402
from dtensor_ema.compat import ema_pytorch as our_ema_pytorch  # noqa: E402
from dtensor_ema.compat import lightning as our_lightning  # noqa: E402
from dtensor_ema.compat import swa_utils as our_swa  # noqa: E402
from dtensor_ema.compat import timm as our_timm  # noqa: E402
from dtensor_ema.compat import ultralytics as our_ultralytics  # noqa: E402
from dtensor_ema.decay import RunningMeanDecay  # noqa: E402
from dtensor_ema.options import AveragingFunction  # noqa: E402


# ------------------------------------------------------------------ averaging functions
def user_avg(p_avg: torch.Tensor, p: torch.Tensor, n_avg: torch.Tensor) -> torch.Tensor:
    return 0.9 * p_avg + (1 - 0.9) * p


def user_mean(p_avg: torch.Tensor, p: torch.Tensor, n_avg: torch.Tensor) -> torch.Tensor:
    """Reads num_averaged: equal to torch's only if it is torch's ``n_averaged``."""
    return p_avg + (p - p_avg) / (n_avg + 1)


def user_multi(avg: list[torch.Tensor], cur: list[torch.Tensor], n: torch.Tensor) -> None:
    if not avg[0].is_floating_point():  # torch passes integer buffers too (use_buffers)
        return
    torch._foreach_mul_(avg, 0.8)
    torch._foreach_add_(avg, cur, alpha=0.2)


# kind -> (keyword, function factory, runs on the function path)
KINDS: dict[str, tuple[str | None, Any, bool]] = {
    "none": (None, None, False),
    "swa_multi": ("multi_avg_fn", torch_swa.get_swa_multi_avg_fn, False),
    "swa_avg": ("avg_fn", torch_swa.get_swa_avg_fn, False),
    "ema_multi": ("multi_avg_fn", lambda: torch_swa.get_ema_multi_avg_fn(0.9), False),
    "ema_avg": ("avg_fn", lambda: torch_swa.get_ema_avg_fn(0.9), False),
    "user_avg": ("avg_fn", lambda: user_avg, True),
    "user_class": ("avg_fn", Decayed, True),
    "user_mean": ("avg_fn", lambda: user_mean, True),
    "user_multi": ("multi_avg_fn", lambda: user_multi, True),
}


def kind_kwargs(kind: str) -> dict[str, Any]:
    key, factory, _ = KINDS[kind]
    return {} if key is None else {key: factory()}


class ConvNet(nn.Module):
    """torch's test model shape: a conv, a BatchNorm with momentum, a linear on the last dim
    (odd sizes: uneven shards at W=2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 5, kernel_size=3)
        self.bn = nn.BatchNorm2d(5, momentum=0.3)
        self.fc = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)))


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 1, 7, 7, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def float_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if v.is_floating_point()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        bool(torch.isfinite(a[k]).all()) and torch.equal(a[k], b[k]) for k in a
    )


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_averaging_functions_bit_exact_against_torch(kind: str, use_buffers: bool) -> None:
    """Mirrors torch ``test/optim/test_swa_utils.py``: ``test_averaged_model_all_devices``
    (``get_ema_multi_avg_fn``/``get_swa_multi_avg_fn``), ``test_averaged_model_exponential``
    (a user's ``decay * p_avg + (1 - decay) * p``, ``use_buffers``) and
    ``test_averaged_model_state_dict``; and Lightning's picklable ``EMAAveragingFunction``.
    torch's factories take the fused path, any other callable the function path; both
    equal torch's ``AveragedModel`` bit for bit (torch checks ``assertEqual``, a tolerance),
    and a state dict round trip continues equal."""
    net = ConvNet()
    real = torch_swa.AveragedModel(net, use_buffers=use_buffers, **kind_kwargs(kind))
    ours = our_swa.AveragedModel(net, use_buffers=use_buffers, **kind_kwargs(kind))
    assert (ours.engine.options.function is not None) == KINDS[kind][2]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if kind == "swa_multi" and use_buffers:  # torch fails on num_batches_tracked; we don't
        for i in range(2):
            sgd_step(net, opt, i)
            ours.update_parameters(net)
            if i:
                with pytest.raises(RuntimeError, match="Integer division with addcdiv"):
                    real.update_parameters(net)
            else:
                real.update_parameters(net)
        return
    for i in range(6):
        sgd_step(net, opt, i)
        real.update_parameters(net)
        ours.update_parameters(net)
    a, b = real.state_dict(), ours.state_dict()
    assert int(a["n_averaged"]) == int(b["n_averaged"]) == 6
    assert same(float_state(a), float_state(b))
    fresh = our_swa.AveragedModel(ConvNet(), use_buffers=use_buffers, **kind_kwargs(kind))
    fresh.load_state_dict(b)
    assert same(float_state(fresh.state_dict()), float_state(b))
    sgd_step(net, opt, 99)
    real.update_parameters(net)
    ours.update_parameters(net)
    assert same(float_state(real.state_dict()), float_state(ours.state_dict()))


def test_non_elementwise_functions_are_refused_naming_them() -> None:
    """The contract (the function must be elementwise) is checked at construction on a
    probe, whole and split by rows: a function reading the whole tensor is refused, by
    name, by every entry point (``AveragedModel``, Lightning's callbacks, ``ModelEMA``)."""

    def normalized(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return (a + b) / (a + b).norm()

    def centered(avg: list[torch.Tensor], cur: list[torch.Tensor], n: torch.Tensor) -> None:
        for a, c in zip(avg, cur, strict=True):
            a.copy_(c - c.mean(dim=0))

    def broken(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return a.view(7, 3)

    net = ConvNet()
    with pytest.raises(ValueError, match=r"avg_fn=.*normalized is not elementwise"):
        our_swa.AveragedModel(net, avg_fn=normalized)
    with pytest.raises(ValueError, match=r"multi_avg_fn=.*centered is not elementwise"):
        our_swa.AveragedModel(net, multi_avg_fn=centered)
    with pytest.raises(ValueError, match=r"broken failed on a \(7, 3\) float32 probe"):
        our_lightning.WeightAveraging(avg_fn=broken)
    with pytest.raises(ValueError, match="normalized is not elementwise"):
        ModelEMA(net, schedule=AveragingFunction(normalized))
    with pytest.raises(ValueError, match="cannot be combined with update_every=2"):
        ModelEMA(net, schedule=AveragingFunction(user_avg), update_every=2)
    with pytest.raises(ValueError, match="cannot be combined with capturable=True"):
        ModelEMA(net, schedule=AveragingFunction(user_avg), capturable=True)
    with pytest.raises(ValueError, match="not supported by MultiModelEMA"):
        MultiModelEMA(net, {"a": {"schedule": AveragingFunction(user_avg)}})
    with pytest.raises(AssertionError, match="Only one of"):  # torch's own message
        our_swa.AveragedModel(net, avg_fn=user_avg, multi_avg_fn=user_multi)


def test_running_mean_formulas_against_a_written_reference() -> None:
    """``formula="divide"`` (torch's ``get_swa_avg_fn``) is ``a + (b - a) / n`` with ``n`` the
    averaging step as an int64 tensor; ``"swa"`` is that on CPU; a function in the
    schedule's place gets ``num_averaged = step``, as an int64 tensor on the EMA's device."""
    model = nn.Linear(9, 5)
    seen: list[torch.Tensor] = []

    def spy(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        seen.append(n.clone())
        return a + (b - a) / (n + 1)  # num_averaged counts the models already averaged

    divide = ModelEMA(model, schedule=RunningMeanDecay(), formula="divide")
    swa = ModelEMA(model, schedule=RunningMeanDecay(), formula="swa")
    function = ModelEMA(model, schedule=AveragingFunction(spy), update_after_step=1)
    seen.clear()  # the construction probe's call
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for step in range(1, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        for k, v in model.state_dict().items():
            ref[k] = v.clone() if step == 1 else ref[k] + (v - ref[k]) / torch.tensor(step)
        divide.update()
        swa.update()
        function.update()
        for ema in (divide, swa):
            assert same(ema.get_ema_state_dict(), ref), step
    # avg_fn runs per tensor (weight, bias); the first update copies
    assert [int(n) for n in seen] == [n for n in range(1, 7) for _ in range(2)]
    assert all(n.dtype == torch.int64 and n.dim() == 0 for n in seen)
    assert same(function.get_ema_state_dict(), divide.get_ema_state_dict())
    assert function.last_decay != function.last_decay  # nan: no decay, the function decides


@pytest.mark.parametrize("multi", [False, True])
def test_a_function_that_raises_leaves_the_ema_unchanged(multi: bool) -> None:
    """An averaging function that raises part way through an update (here on 1-D tensors:
    after the weights of both dtype groups, before their biases) writes nothing: every
    result is computed before any is written, and the update is not counted."""

    def lerp_or_fail(a: torch.Tensor, b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        if fail and a.dim() == 1:
            raise RuntimeError("no biases today")
        if wrong_shape and a.dim() == 1:
            return (a + b).sum()
        return a + (b - a) * 0.25

    def multi_lerp_or_fail(a: list[torch.Tensor], b: list[torch.Tensor], n: torch.Tensor) -> None:
        for x, y in zip(a, b, strict=True):
            x.copy_(lerp_or_fail(x, y, n))  # in place, as torch's multi_avg_fn do

    fail = wrong_shape = False
    model = nn.ModuleDict({"f32": nn.Linear(4, 3), "f64": nn.Linear(4, 3).double()})
    fn = (
        AveragingFunction(multi_lerp_or_fail, multi=True)
        if multi
        else AveragingFunction(lerp_or_fail)
    )
    ema = ModelEMA(model, schedule=fn)
    ema.update()  # the first update copies
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in ema.get_ema_state_dict().items()}
    fail = True
    with pytest.raises(RuntimeError, match="no biases today"):
        ema.update()
    assert same(ema.get_ema_state_dict(), before) and ema.updates == 1
    fail = False
    ema.update()
    assert ema.updates == 2
    want = {k: v + (model.state_dict()[k] - v) * 0.25 for k, v in before.items()}
    assert same(ema.get_ema_state_dict(), want)
    if not multi:  # a result of another shape is refused before anything is written
        wrong_shape = True
        before = {k: v.clone() for k, v in ema.get_ema_state_dict().items()}
        with pytest.raises(ValueError, match=r"returned \(\) for an EMA piece of shape \(3,\)"):
            ema.update()
        assert same(ema.get_ema_state_dict(), before) and ema.updates == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_swa_follows_torchs_device_rule_on_cuda() -> None:
    """torch's ``AveragedModel`` without a function lerps on CUDA (foreach) and divides on
    CPU; so does the drop-in: bit for bit on both devices, for every kind of function."""
    for kind in KINDS:
        for device in ("cuda", "cpu"):
            net = ConvNet().to(device)
            real = torch_swa.AveragedModel(net, use_buffers=True, **kind_kwargs(kind))
            ours = our_swa.AveragedModel(net, use_buffers=True, **kind_kwargs(kind))
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for i in range(5):
                x = torch.randn(3, 1, 7, 7, generator=torch.Generator().manual_seed(i))
                net(x.to(device)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                real.update_parameters(net)
                ours.update_parameters(net)
            a, b = float_state(real.state_dict()), float_state(ours.state_dict())
            assert same(a, b), (kind, device)


# ------------------------------------------------------------------ pickling, copies
def _bump(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


DROPINS: dict[str, Any] = {
    # name -> (build(model), update(ema, model), the EMA as a module)
    "ModelEMA": (
        lambda m: ModelEMA(m, decay=0.9, tau=None),
        lambda e, m: e.update(m),
        lambda e: e.module,
    ),
    "AveragedModel": (
        lambda m: our_swa.AveragedModel(m, avg_fn=Decayed(), use_buffers=True),
        lambda e, m: e.update_parameters(m),
        lambda e: e.module,
    ),
    "ModelEmaV3": (
        lambda m: our_timm.ModelEmaV3(m, decay=0.9),
        lambda e, m: e.update(m),
        lambda e: e.module,
    ),
    "EMA": (
        lambda m: our_ema_pytorch.EMA(m, beta=0.9, update_after_step=0, update_every=1),
        lambda e, m: e.update(),
        lambda e: e.ema_model,
    ),
    "ultralytics": (
        lambda m: our_ultralytics.ModelEMA(m, decay=0.9, tau=10),
        lambda e, m: e.update(m),
        lambda e: e.ema,
    ),
}


@pytest.mark.parametrize("name", list(DROPINS))
def test_pickle_torch_save_and_deepcopy(name: str) -> None:
    """Mirrors torch ``test_swa_utils.py`` ``test_averaged_model_default_avg_fn_picklable``
    (``pickle.dumps(averaged_dnn)``), for ``ModelEMA`` and every drop-in with a module:
    ``pickle`` and ``torch.save``/``torch.load(weights_only=False)`` give the same EMA and
    forward; a ``deepcopy`` updates from its own copy of the model, and its module holds
    its own engine's tensors (before the fix: ``TypeError: cannot pickle
    'weakref.ReferenceType' object``)."""
    build, update, module = DROPINS[name]
    model = ConvNet()
    ema = build(model)
    _bump(model, 1)
    update(ema, model)
    x = torch.randn(2, 1, 7, 7, generator=torch.Generator().manual_seed(5))

    def out(e: Any) -> torch.Tensor:
        m = module(e)
        m.eval()
        with torch.no_grad():
            return m(x)

    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    for loaded in (pickle.loads(pickle.dumps(ema)), torch.load(buffer, weights_only=False)):
        assert torch.equal(out(loaded), out(ema))
        assert same(
            loaded.engine.get_ema_state_dict()
            if name != "ModelEMA"
            else loaded.get_ema_state_dict(),
            ema.engine.get_ema_state_dict() if name != "ModelEMA" else ema.get_ema_state_dict(),
        )
    copied = copy.deepcopy(ema)
    engine = copied if name == "ModelEMA" else copied.engine
    assert engine.model is not model
    own = engine.ema_tensors()
    assert any(t.data_ptr() == own["conv.weight"].data_ptr() for t in module(copied).parameters())
    _bump(engine.model, 2)  # only the copy's model moves
    update(copied, engine.model)
    update(ema, model)
    assert not torch.equal(out(copied), out(ema))


def test_a_copy_watches_its_own_model() -> None:
    """``copy.deepcopy(ema)`` watches the copy of the model: surgery on it after the first
    update is followed. Before the fix the copy's watch (a weakref) pointed at the original
    model, so the copy kept averaging the replaced layer's stale tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ema = ModelEMA(model, decay=0.5, tau=None)
    copied = copy.deepcopy(ema)
    copied.update()
    new = nn.Linear(3, 4)
    copied.model[0] = new  # surgery on the copy's model
    before = copied.ema_tensors()["0.weight"].clone()
    copied.update()
    assert torch.equal(copied.ema_tensors()["0.weight"], before.lerp(new.weight.detach(), 0.5))
    model[0] = nn.Linear(3, 4)  # and the original follows its own
    kept = ema.ema_tensors()["0.weight"].clone()
    ema.update()
    assert torch.equal(ema.ema_tensors()["0.weight"], kept.lerp(model[0].weight.detach(), 0.5))


def test_diffusers_copy_steps_from_the_same_parameters() -> None:
    """diffusers' ``EMAModel`` holds no model: its ``deepcopy`` is an independent EMA that
    steps from the same parameters; a pickled one carries its own copies of them."""
    model = ConvNet()
    real = RealEMAModel(model.parameters(), decay=0.9)
    ours = our_diffusers.EMAModel(model.parameters(), decay=0.9)
    for i in range(2):
        _bump(model, i)
        real.step(model.parameters())
        ours.step(model.parameters())
    copied = copy.deepcopy(ours)
    pickled = pickle.loads(pickle.dumps(ours))
    _bump(model, 7)
    real.step(model.parameters())
    copied.step(model.parameters())
    for a, b, c in zip(
        real.shadow_params, copied.state_dict()["shadow_params"], pickled.shadow_params, strict=True
    ):
        assert torch.equal(a, b) and not torch.equal(a, c)
    assert (
        copied.optimization_step == 3 and ours.optimization_step == pickled.optimization_step == 2
    )


# ------------------------------------------------------------------ Lightning
@pytest.mark.parametrize(
    ("options", "every_epoch"),
    [
        ({"avg_fn": Decayed(0.999)}, False),  # Lightning's test_ema
        ({"avg_fn": torch_swa.get_swa_avg_fn()}, True),  # Lightning's test_swa
    ],
    ids=["ema_function_object", "swa_every_other_epoch"],
)
def test_lightning_hooks_and_numbers_match(
    tmp_path: Path, options: dict[str, Any], every_epoch: bool
) -> None:
    """Mirrors Lightning ``tests_pytorch/callbacks/test_weight_averaging.py``:
    ``test_weight_averaging_deepcopy`` (the average exists in ``setup``, its module a copy
    with no trainer), ``test_ema`` (the picklable function object, ``n_averaged`` per
    epoch, two ``_swap_models`` calls per validation epoch, one
    ``_copy_average_to_current`` at the end) and ``test_swa`` (``should_update`` overridden
    to epochs, ``get_swa_avg_fn``), against Lightning's own callback: the same calls and
    counts, and the same final weights bit for bit."""
    runs = {}
    for name, cls in (("real", RealCounting), ("ours", OurCounting)):
        torch.manual_seed(1)
        module = TinyModule()
        callback = cls(every_epoch=every_epoch, **options)
        pl.seed_everything(3, verbose=False)
        fit(module, callback, tmp_path / name)
        runs[name] = (callback, {k: v.clone() for k, v in module.state_dict().items()})
    (real, real_final), (ours, our_final) = runs["real"], runs["ours"]
    assert ours.in_setup == real.in_setup == {"built": True, "bound": True, "no_trainer": True}
    assert ours.history == real.history and ours.history[-1][2] == 2 * 4
    assert ours.copy_calls == real.copy_calls == 1
    assert same(float_state(our_final), float_state(real_final))


def test_lightning_configure_model(tmp_path: Path) -> None:
    """Mirrors Lightning ``test_weight_averaging.py`` ``test_ema_configure_model``: layers
    built in ``configure_model`` (which the strategy calls again after ``setup``: the EMA
    follows the re-created layers) are in the average's module."""
    callback = our_lightning.WeightAveraging(avg_fn=Decayed(0.99))
    module = LateModule()
    fit(module, callback, tmp_path, epochs=2)
    assert isinstance(callback._average_model.module.layer, nn.Sequential)
    assert int(callback._average_model.n_averaged) == 8  # 4 optimizer steps per epoch


def test_lightning_should_update_matches() -> None:
    """Mirrors Lightning ``test_weight_averaging.py`` ``test_ema_weight_averaging_should_update``
    (and the option sets of ``test_ema_weight_averaging_step_frequency``,
    ``..._starting_step``, ``..._starting_epoch``): ``EMAWeightAveraging.should_update``
    answers as Lightning's for every step and epoch index."""
    from lightning.pytorch.callbacks import EMAWeightAveraging as RealEMAWA

    grid = [
        dict(update_every_n_steps=5, update_starting_at_step=10),
        dict(update_every_n_steps=1, update_starting_at_epoch=2),
        dict(update_every_n_steps=3),
        dict(update_every_n_steps=0, update_starting_at_epoch=1),
    ]
    for options in grid:
        ours, real = our_lightning.EMAWeightAveraging(**options), RealEMAWA(**options)
        for i in range(30):
            assert ours.should_update(step_idx=i) == real.should_update(step_idx=i), (options, i)
            assert ours.should_update(epoch_idx=i) == real.should_update(epoch_idx=i), (options, i)


@pytest.mark.slow
@pytest.mark.distributed
def test_lightning_ddp_spawn(tmp_path: Path) -> None:
    """Mirrors Lightning ``test_weight_averaging.py`` ``test_ema_ddp_spawn_cpu``: the
    callback (with the picklable function object) is pickled into two spawned ranks, each
    holding half of the average; Lightning's hook calls and the trained module handed back
    to this process equal Lightning's own callback's bit for bit."""
    finals = {}
    for name, cls in (("real", RealCounting), ("ours", OurCounting)):
        module = TinyModule()
        callback = cls(avg_fn=Decayed(0.9))
        fit(module, callback, tmp_path / name, strategy="ddp_spawn", devices=2, epochs=2)
        finals[name] = {k: v.clone() for k, v in module.state_dict().items()}
    assert same(float_state(finals["ours"]), float_state(finals["real"]))


# ------------------------------------------------------------------ diffusers


def randomize_(unet: nn.Module, seed: int) -> None:
    """diffusers' test's ``simulate_backprop``: new values loaded into the same tensors."""
    g = torch.Generator().manual_seed(seed)
    state = {
        k: torch.randn(v.shape, generator=g) + v * torch.randn(v.shape, generator=g)
        for k, v in unet.state_dict().items()
    }
    unet.load_state_dict(state)


@pytest.mark.parametrize("foreach", [False, True])
def test_diffusers_behaviours(tmp_path: Path, foreach: bool) -> None:
    """Mirrors diffusers ``tests/others/test_ema.py`` (``TestEMAModel`` and
    ``TestEMAModelForeach``): ``test_optimization_steps_updated``,
    ``test_shadow_params_not_updated``, ``test_shadow_params_updated``,
    ``test_consecutive_shadow_params_updated``, ``test_zero_decay``,
    ``test_from_pretrained`` and ``test_serialization``; every shadow parameter compared
    bit for bit with diffusers' own ``EMAModel`` (its file compares with ``allclose``, and
    its ``assert ~torch.allclose(...)`` lines cannot fail: ``~True`` is ``-2``)."""
    for decay in (0.9999, 0.0):
        unet = tiny_unet()
        kw: dict[str, Any] = dict(
            decay=decay, model_cls=UNet2DModel, model_config=unet.config, foreach=foreach
        )
        real = RealEMAModel(unet.parameters(), **kw)
        ours = our_diffusers.EMAModel(unet.parameters(), **kw)

        def shadows_equal(real: Any = real, ours: Any = ours) -> bool:
            theirs, mine = real.shadow_params, ours.state_dict()["shadow_params"]
            return all(torch.equal(a, b) for a, b in zip(theirs, mine, strict=True))

        for i in range(3):  # unchanged model: the shadows stay the parameters
            real.step(unet.parameters())
            ours.step(unet.parameters())
            assert ours.optimization_step == real.optimization_step == i + 1
            params = unet.parameters()
            assert all(torch.equal(s, p) for s, p in zip(real.shadow_params, params, strict=True))
            assert shadows_equal()
        previous = [s.clone() for s in ours.state_dict()["shadow_params"]]
        for seed in (1, 2):  # consecutive updates move the shadows (not with decay 0: copies)
            randomize_(unet, seed)
            real.step(unet.parameters())
            ours.step(unet.parameters())
            assert shadows_equal()
            now = ours.state_dict()["shadow_params"]
            moved = [not torch.equal(a, b) for a, b in zip(previous, now, strict=True)]
            assert all(moved)
            # decay 0: each shadow is ema - (ema - param), diffusers' rounding of the
            # parameter (checked above, bit for bit); otherwise none is near its parameter
            near = [torch.allclose(s, p) for s, p in zip(now, unet.parameters(), strict=True)]
            assert decay == 0.0 or not any(near)
            previous = [s.clone() for s in now]
    folder = tmp_path / f"ema-{foreach}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours.save_pretrained(str(folder))
        loaded = our_diffusers.EMAModel.from_pretrained(str(folder), UNet2DModel, foreach=foreach)
        saved = UNet2DModel.from_pretrained(str(folder))
    assert loaded.optimization_step == ours.optimization_step and loaded.decay == ours.decay
    assert all(
        torch.equal(a, b)
        for a, b in zip(ours.state_dict()["shadow_params"], loaded.shadow_params, strict=True)
    )
    ours.copy_to(unet.parameters())  # the module saved_pretrained wrote holds the same
    assert same(saved.state_dict(), unet.state_dict())
    x = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    unet.eval()
    with torch.no_grad():
        assert torch.allclose(saved(x, 3).sample, unet(x, 3).sample, atol=1e-4)


# ------------------------------------------------------------------ timm's task
class TinyFeatures(nn.Module):
    """A student/teacher for ``FeatureDistillationTask``: ``forward_features``/``forward_head``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(hidden)
        self.num_classes, self.in_chans, self.num_features = 3, 3, hidden
        self.pretrained_cfg = {"mean": (0.5,) * 3, "std": (0.25,) * 3}
        self.stem, self.head = nn.Linear(3, hidden), nn.Linear(hidden, 3)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x.mean((2, 3)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class TinyClassifier(nn.Module):
    """What ``timm.task`` needs of a model: ``num_classes``, ``pretrained_cfg``."""

    def __init__(self, hidden: int = 0) -> None:
        super().__init__()
        torch.manual_seed(hidden)
        self.num_classes, self.in_chans, self.num_features = 3, 3, 5
        self.pretrained_cfg = {"mean": (0.5,) * 3, "std": (0.25,) * 3}
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("lib", ["timm", "ours"])
def test_timm_task_habits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib: str) -> None:
    """Mirrors timm ``tests/test_task.py``:
    ``test_task_checkpoint_omits_empty_task_state_and_keeps_legacy_paths`` (``setup_ema``,
    ``CheckpointSaver`` with ``task=`` and with ``model_ema=``, ``resume_task_checkpoint``,
    ``load_task_ema_checkpoint``), ``test_compiled_ema_eval_model_reflects_update``
    (``compile_ema`` then ``update_ema(step=2)`` with decay 0) and
    ``test_feature_distillation_checkpoint_keeps_projection_in_task_state`` (the task's
    EMA state and forward), with timm's task module building the EMA from ``lib``'s
    ``ModelEmaV3``. (Its other three tests never touch the EMA.)"""
    import timm.task.task as task_module
    from timm.task import ClassificationTask, load_task_ema_checkpoint, resume_task_checkpoint
    from timm.utils import CheckpointSaver

    if lib == "ours":
        monkeypatch.setattr(task_module, "ModelEmaV3", our_timm.ModelEmaV3)
    task = ClassificationTask(TinyClassifier(), nn.CrossEntropyLoss(), verbose=False)
    optimizer = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.1)
    ema = task.setup_ema(decay=0.0)
    assert type(ema).__module__ == (
        "dtensor_ema.compat.timm" if lib == "ours" else "timm.utils.model_ema"
    )
    task.compile_ema(backend="eager")
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    before = task.get_eval_model(ema=True)(x).detach().clone()
    with torch.no_grad():
        for p in task.get_trainable_module().parameters():
            p.add_(0.25)
    task.update_ema(step=2)
    after = task.get_eval_model(ema=True)(x).detach()
    assert not torch.equal(before, after)
    assert torch.equal(after, task.get_eval_model()(x).detach())
    path = tmp_path / "task.pth.tar"
    CheckpointSaver(
        task.get_trainable_module(), optimizer, checkpoint_dir=tmp_path, task=task
    )._save(path, epoch=2)
    legacy = tmp_path / "legacy.pth.tar"
    CheckpointSaver(
        task.get_trainable_module(),
        optimizer,
        model_ema=task.get_trainable_module(ema=True),
        checkpoint_dir=tmp_path,
    )._save(legacy, epoch=2)
    for file in (path, legacy):
        checkpoint = torch.load(file, weights_only=False)
        assert same(checkpoint["state_dict_ema"], checkpoint["state_dict"])  # decay 0
    fresh = ClassificationTask(TinyClassifier(hidden=1), nn.CrossEntropyLoss(), verbose=False)
    fresh.setup_ema(decay=0.0)
    assert resume_task_checkpoint(fresh, str(path), log_info=False, weights_only=False) == 3
    load_task_ema_checkpoint(fresh, str(path), weights_only=False)
    assert torch.equal(fresh.get_eval_model(ema=True)(x), after)
    # test_feature_distillation_checkpoint_keeps_projection_in_task_state
    from timm.task import FeatureDistillationTask

    def distill() -> Any:
        task = FeatureDistillationTask(
            TinyFeatures(4), TinyFeatures(6), criterion=nn.CrossEntropyLoss(), verbose=False
        )
        task.setup_ema(decay=0.0)
        return task

    task = distill()
    opt = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.1)
    path = tmp_path / "fd.pth.tar"
    CheckpointSaver(task.get_trainable_module(), opt, checkpoint_dir=tmp_path, task=task)._save(
        path, epoch=1
    )
    checkpoint = torch.load(path, weights_only=False)
    assert "projection" in checkpoint["task_state_ema"]
    assert not any(k.startswith("projection") for k in checkpoint["state_dict_ema"])
    assert task.get_eval_model(ema=True)(x).shape == (2, 3)
    fresh = distill()
    resume_task_checkpoint(fresh, str(path), log_info=False, weights_only=False)
    load_task_ema_checkpoint(fresh, str(path), weights_only=False)
    assert torch.equal(fresh.get_eval_model(ema=True)(x), task.get_eval_model(ema=True)(x))


# ------------------------------------------------------------------ W=2: no hidden collective
def _timed(fn: Any) -> tuple[str, float]:
    """Run ``fn`` on one rank alone; the error it raises (or "no error") and how long it took."""
    start = time.monotonic()
    try:
        fn()
        result = "no error"
    except RuntimeError as e:
        result = str(e)
    return result, time.monotonic() - start


def _w2_body(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # diffusers' scripts: validation and the final copy inside `if is_main_process:`.
    unet = tiny_unet()
    model = DDP(unet)
    kw: dict[str, Any] = dict(decay=0.9, model_cls=UNet2DModel, model_config=unet.config)
    real = RealEMAModel(unet.parameters(), **kw)
    ours = our_diffusers.EMAModel(unet.parameters(), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        g = torch.Generator().manual_seed(100 * rank + i)
        model(torch.randn(2, 1, 8, 8, generator=g), i).sample.square().mean().backward()
        opt.step()
        opt.zero_grad()
        real.step(unet.parameters())
        ours.step(unet.parameters())
    raw = [p.detach().clone() for p in unet.parameters()]
    if rank == 0:
        out["copy_refused"] = _timed(lambda: ours.copy_to(unet.parameters()))
        out["untouched"] = all(
            torch.equal(a, b) for a, b in zip(raw, unet.parameters(), strict=True)
        )
    dist.barrier()
    ours.gather_for_save()  # the one line the scripts need, on every rank
    if rank == 0:
        ours.store(unet.parameters())
        out["copy_after_gather"] = _timed(lambda: ours.copy_to(unet.parameters()))
        out["validated_on_ema"] = all(
            torch.equal(s, p) for s, p in zip(real.shadow_params, unet.parameters(), strict=True)
        )
        ours.restore(unet.parameters())
        out["restored"] = all(
            torch.equal(a, b) for a, b in zip(raw, unet.parameters(), strict=True)
        )
        out["state_dict"] = all(
            torch.equal(a, b)
            for a, b in zip(real.shadow_params, ours.state_dict()["shadow_params"], strict=True)
        )
    dist.barrier()
    # torch's AveragedModel: forward and update_bn after an update.
    net = ConvNet()
    ddp = DDP(net)
    real_swa = torch_swa.AveragedModel(net, avg_fn=user_mean, use_buffers=True)
    swa = our_swa.AveragedModel(net, avg_fn=user_mean, use_buffers=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(4):
        sgd_step(ddp, opt, 10 * rank + i)
        real_swa.update_parameters(net)
        swa.update_parameters(net)
    x = torch.randn(4, 1, 7, 7, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        out["forward_refused"] = _timed(lambda: swa(x))
    dist.barrier()
    swa.gather_for_save()
    loader = [torch.randn(4, 1, 7, 7, generator=torch.Generator().manual_seed(50 + rank))]
    torch_swa.update_bn(loader, real_swa)
    our_swa.update_bn(loader, swa)  # train() keeps the gathered copy: no collective
    real_swa.eval()
    swa.eval()  # nothing to gather: still current
    with torch.no_grad():
        out["function_and_update_bn"] = torch.equal(real_swa(x), swa(x)) and all(
            torch.equal(a, b)
            for a, b in zip(real_swa.module.buffers(), swa.module.buffers(), strict=True)
            if a.is_floating_point()
        )
    # timm's habit: rank 0 saves unwrap_model(model_ema).state_dict() alone.
    ema = our_timm.ModelEmaV3(net, decay=0.9)
    ema.update(ddp, step=1)
    if rank == 0:
        out["timm_module_refused"] = _timed(lambda: ema.module.state_dict())
        out["timm_forward_refused"] = _timed(lambda: ema(x))
    dist.barrier()
    ema.eval()  # timm's validate() on every rank
    ema.train()  # local: keeps the gathered weights until the next update
    if rank == 0:
        out["timm_module_saved"] = _timed(lambda: ema.module.state_dict())
        out["timm_forward"] = _timed(lambda: ema(x))
    dist.barrier()
    # Pickling a sharded EMA raises at once, naming what to save instead.
    out["pickle"] = {
        "ModelEMA": _timed(lambda: pickle.dumps(swa.engine)),
        "AveragedModel": _timed(lambda: torch.save(swa, io.BytesIO())),
        "ModelEmaV3": _timed(lambda: copy.deepcopy(ema)),
        "EMAModel": _timed(lambda: copy.deepcopy(ours)),
    }
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("upstream_w2")
    return run_ranks(_w2_body, 2, root, str(root))


def _refused_at_once(result: tuple[str, float], *needles: str) -> None:
    message, seconds = result
    assert seconds < 5.0, result  # raised at once: waited on no other rank
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.distributed
def test_diffusers_main_process_habit_w2(w2: list[dict[str, Any]]) -> None:
    """diffusers' scripts call ``ema_unet.store(...); ema_unet.copy_to(unet.parameters())``
    and the final ``copy_to`` inside ``if accelerator.is_main_process:``. At W=2 that raises
    at once naming ``gather_for_save()`` (before the fix: rank 0 hung in a collective the
    other rank never entered), leaving the parameters untouched; after
    ``gather_for_save()`` on every rank it writes the full EMA (diffusers' own values bit
    for bit), ``restore`` puts the raw weights back and ``state_dict`` works, all on rank 0
    alone."""
    out = w2[0]
    _refused_at_once(out["copy_refused"], "gather_for_save()", "every rank")
    assert out["untouched"]
    assert out["copy_after_gather"][0] == "no error"
    assert out["validated_on_ema"] and out["restored"] and out["state_dict"]


@pytest.mark.distributed
def test_forward_and_update_bn_without_hidden_collective_w2(w2: list[dict[str, Any]]) -> None:
    """Mirrors torch ``test_swa_utils.py`` ``test_update_bn_cnn`` on the drop-in at W=2,
    and the rank-0 rule. An ``AveragedModel`` forward on one rank after an update raises at
    once naming
    ``gather_for_save()`` (before the fix it all-gathered: a hang when one rank evaluates);
    after ``gather_for_save()`` on every rank, torch's ``update_bn`` (which calls
    ``train()``, then forwards) runs on the gathered copy, and a user's ``avg_fn`` that
    reads ``num_averaged`` gives torch's numbers and BatchNorm statistics on every rank. The
    same for timm's ``.module.state_dict()`` and forward on rank 0 alone: refused at once,
    then working after ``eval()`` on every rank, also after ``train()``."""
    out = w2[0]
    _refused_at_once(out["forward_refused"], "gather_for_save()")
    _refused_at_once(out["timm_module_refused"], "gather_for_save()")
    _refused_at_once(out["timm_forward_refused"], "gather_for_save()")
    assert out["timm_module_saved"][0] == out["timm_forward"][0] == "no error"
    assert all(o["function_and_update_bn"] for o in w2)


@pytest.mark.distributed
def test_pickling_a_sharded_ema_raises_at_once_w2(w2: list[dict[str, Any]]) -> None:
    """With W > 1, ``pickle``, ``torch.save`` and ``deepcopy`` of ``ModelEMA`` and of the
    drop-ins raise at once on any rank, saying what to save instead."""
    for out in w2:
        for name, result in out["pickle"].items():
            _refused_at_once(result, "save_checkpoint", "get_ema_state_dict()")
            assert "sharded over 2 ranks" in result[0], name


def test_swa_utils_exports_torchs_test_imports() -> None:
    """torch's ``test_swa_utils.py`` imports ``AveragedModel, get_ema_multi_avg_fn,
    get_swa_multi_avg_fn, update_bn``: the drop-in module has all four (torch's functions,
    mapped onto the fused path). Its ``test_update_bn_dnn``/``_cnn`` and
    ``test_bn_update_eval_momentum`` call ``update_bn`` on a plain model (torch's own
    function, re-exported); ``update_bn`` on the drop-in is
    ``test_forward_and_update_bn_without_hidden_collective_w2``."""
    for name in ("AveragedModel", "get_ema_multi_avg_fn", "get_swa_multi_avg_fn", "update_bn"):
        assert name in our_swa.__all__, name
    assert our_swa.update_bn is torch_swa.update_bn
