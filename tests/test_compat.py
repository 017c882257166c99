"""The drop-ins of :mod:`dtensor_ema.compat` against the real libraries (ema-pytorch,
torch ``swa_utils``, diffusers, Lightning), bit for bit.

A small model is trained with real SGD steps; every real EMA and its drop-in watch the same
model, with default and non-default options: in this process (no process group), and at
W=1, 2 and 3 on gloo under DDP and FSDP2 (W=1 in this process, one spawned body per
larger world size). Each library's checkpoint habit is exercised: ``torch.save`` of
``state_dict()`` on rank 0 (refused at W>1, naming the fix, until a gather every rank
reached: ``eval()`` for the drop-ins with a module,
``gather_for_save()`` for diffusers), loaded back on every rank and resumed; the W=2 and
W=3 files load into the real libraries in this process; Lightning checkpoints keep
Lightning's layout (``state_dict`` = the average) and resume. Evaluation: the drop-ins'
forward (a replica gathered once per pass) equals the real EMA model's bit for bit, the
module refuses to run while released, and the sharded per-unit forward (FSDP2 models,
``evaluation="sharded"``) matches within FSDP2's rounding.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("ema_pytorch", "compat")
require_extra("diffusers", "compat")
require_extra("lightning", "compat")

import ema_pytorch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers.training_utils import EMAModel as RealEMAModel  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging as RealEMAWA  # noqa: E402
from models import tiny_unet  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.optim import swa_utils as torch_swa  # noqa: E402

from dtensor_ema.compat import diffusers as our_diffusers  # noqa: E402
from dtensor_ema.compat import ema_pytorch as our_ema_pytorch  # noqa: E402
from dtensor_ema.compat import lightning as our_lightning  # noqa: E402
from dtensor_ema.compat import swa_utils as our_swa  # noqa: E402
from dtensor_ema.decay import DiffusersDecay, EmaPytorchDecay, RunningMeanDecay  # noqa: E402
from dtensor_ema.update.fused_update import combine_  # noqa: E402


class Net(nn.Module):
    """Odd sizes (uneven shards at W=2, 3) and a float buffer that moves every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(0.25)
        return self.body(x)


# name -> (library, options). Defaults and a non-default set per library.
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "ep_default": ("ep", {}),
    "ep_custom": (
        "ep",
        dict(
            beta=0.99,
            update_after_step=3,
            update_every=2,
            power=3 / 4,
            inv_gamma=2.0,
            min_value=0.1,
            param_or_buffer_names_no_ema={"seen"},
        ),
    ),
    "swa_multi_buffers": ("swa", dict(multi_avg_fn=0.9, use_buffers=True)),
    "swa_avg": ("swa", dict(avg_fn=0.95)),
    "df_default": ("df", {}),
    "df_warmup_foreach": (
        "df",
        dict(
            decay=0.9,
            update_after_step=2,
            use_ema_warmup=True,
            power=3 / 4,
            min_decay=0.1,
            foreach=True,
        ),
    ),
}
STEPS = 110  # past ema-pytorch's default update_after_step=100


def _swa_kwargs(options: dict[str, Any], ours: bool) -> dict[str, Any]:
    lib = our_swa if ours else torch_swa
    out = dict(options)
    if "multi_avg_fn" in out:
        out["multi_avg_fn"] = lib.get_ema_multi_avg_fn(out["multi_avg_fn"])
    if "avg_fn" in out:
        out["avg_fn"] = torch_swa.get_ema_avg_fn(out["avg_fn"])  # torch's own, recognized
    return out


def make(name: str, model: nn.Module, ours: bool, **extra: Any) -> Any:
    lib, options = OPTIONS[name]
    options = options | (extra if ours else {})
    if lib == "ep":
        return (our_ema_pytorch.EMA if ours else ema_pytorch.EMA)(model, **options)
    if lib == "swa":
        return (our_swa.AveragedModel if ours else torch_swa.AveragedModel)(
            model, **_swa_kwargs(options, ours)
        )
    return (our_diffusers.EMAModel if ours else RealEMAModel)(model.parameters(), **options)


def step(name: str, ema: Any, model: nn.Module) -> None:
    lib = OPTIONS[name][0]
    if lib == "ep":
        ema.update()
    elif lib == "swa":
        ema.update_parameters(model)
    else:
        ema.step(model.parameters())


def real_full(name: str, ema: Any) -> dict[str, torch.Tensor]:
    lib = OPTIONS[name][0]
    if lib == "df":
        return {str(i): t for i, t in enumerate(ema.shadow_params)}
    module = ema.ema_model if lib == "ep" else ema.module
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def ours_full(ema: Any) -> dict[str, torch.Tensor]:
    """Collective: the drop-in's full EMA, through the engine."""
    return {k: v for k, v in ema.engine.get_ema_state_dict().items() if v.is_floating_point()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.isfinite(a[k]).all() and torch.equal(a[k], b[k]) for k in a
    )


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def mirror_(mirror: nn.Module, model: nn.Module) -> None:
    """Copy the (possibly FSDP2-sharded) model's full weights into a plain replica
    (collective for DTensors)."""
    with torch.no_grad():
        for (_, t), (_, m) in zip(
            model.state_dict().items(), mirror.state_dict().items(), strict=True
        ):
            m.copy_(t.full_tensor() if isinstance(t, DTensor) else t)


def compare_run(
    rank: int,
    model: nn.Module,
    tracked: nn.Module,
    mirror: nn.Module,
    names: list[str],
    steps: int,
    **extra: Any,
) -> tuple[dict[str, bool], dict[str, Any], dict[str, Any]]:
    """Train ``model`` ``steps`` steps; the real EMAs watch ``mirror`` (kept equal to the
    model), the drop-ins (built with ``extra`` options) watch ``tracked``. Returns equality
    per name and both sets."""
    real = {n: make(n, mirror, ours=False) for n in names}
    ours = {n: make(n, tracked, ours=True, **extra) for n in names}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        train_step(model, opt, seed=1000 * rank + i)
        mirror_(mirror, tracked)
        for n in names:
            step(n, real[n], mirror)
            step(n, ours[n], tracked)
    return {n: same(real_full(n, real[n]), ours_full(ours[n])) for n in names}, real, ours


# ------------------------------------------------------------------------ spawned body
def _body(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    out: dict[str, Any] = {}
    names = list(OPTIONS)
    # DDP: the real EMAs watch the unwrapped replica itself (DDP keeps replicas equal).
    net = Net()
    ddp = DDP(net)
    out["ddp"], real, ours = compare_run(rank, ddp, net, net, names, STEPS)
    # The rank-0 save habit: refused with the fix, then works after gather_for_save().
    refusals: dict[str, str] = {}
    if rank == 0 and world > 1:
        for n in names:
            try:
                ours[n].state_dict()
                refusals[n] = "no error"
            except RuntimeError as e:
                refusals[n] = str(e)
    out["refusals"] = refusals
    # Evaluation: the module itself refuses to run while its weights are not gathered;
    # eval() gathers them once (every rank), then the drop-in's forward equals the real
    # EMA model's bit for bit, and rank 0 can save without gather_for_save().
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(11))
    direct: dict[str, str] = {}
    forward: dict[str, bool] = {}
    for n in names:
        if OPTIONS[n][0] == "df":
            ours[n].gather_for_save()  # no module: the save habit's own call
            continue
        try:
            with torch.no_grad():
                _module(n, ours[n])(x)
            direct[n] = "no error"
        except RuntimeError as e:
            direct[n] = str(e)
        forward[n] = _same_forward(n, real[n], ours[n], x)
    out["direct"], out["forward"] = direct, forward
    for n in names:
        if rank == 0:
            torch.save(ours[n].state_dict(), base / f"{n}-w{world}.pt")
            torch.save(real[n].state_dict(), base / f"{n}-real-w{world}.pt")
    dist.barrier()
    # Every rank loads the rank-0 file into a fresh drop-in and resumes.
    resumed, continued = {}, {}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    fresh = {}
    for n in names:
        fresh[n] = make(n, net, ours=True)
        fresh[n].load_state_dict(torch.load(base / f"{n}-w{world}.pt", weights_only=False))
        resumed[n] = same(real_full(n, real[n]), ours_full(fresh[n]))
    for i in range(3):
        train_step(ddp, opt, seed=5000 + 1000 * rank + i)
        for n in names:
            step(n, real[n], net)
            step(n, fresh[n], net)
    for n in names:
        continued[n] = same(real_full(n, real[n]), ours_full(fresh[n]))
        if OPTIONS[n][0] != "df":
            continued[n] = continued[n] and _same_forward(n, real[n], fresh[n], x)
    out["resumed"], out["continued"] = resumed, continued
    # FSDP2: the drop-ins track the sharded model (diffusers: its DTensor parameters,
    # layout inferred); the real EMAs a plain mirror of its full weights. At W=1 (a one-rank
    # mesh) the EMA is live: the forward and the rank-0 save need no gather.
    model = Net()
    fully_shard(model.body[0])
    fully_shard(model)
    mirror = Net()
    out["fsdp2"], real, ours = compare_run(rank, model, model, mirror, names, 12)
    if world == 1:
        out["fsdp2_live"] = {
            n: _same_state(_ema_part(ours[n].state_dict()), _ema_part(real[n].state_dict()))
            and (OPTIONS[n][0] == "df" or _same_forward(n, real[n], ours[n], x))
            for n in names
        }
    if world > 1:
        out["fsdp2_save"] = sharded_save(rank, names, real, ours, x)
        # A plain DDP model with evaluation="sharded": the per-unit forward, same save rule.
        net = Net()
        ddp = DDP(net)
        sharded = [n for n in names if OPTIONS[n][0] != "df"]
        _, real, ours = compare_run(rank, ddp, net, net, sharded, 6, evaluation="sharded")
        habit = {}  # timm's habit, `unwrap_model(ema).state_dict()`, on rank 0 alone
        for n in sharded:
            habit[f"{n}/module_refusal"] = None
            if rank == 0:
                try:
                    _module(n, ours[n]).state_dict()
                    habit[f"{n}/module_refusal"] = "no error"
                except RuntimeError as e:
                    habit[f"{n}/module_refusal"] = str(e)
        out["sharded_option"] = sharded_save(rank, sharded, real, ours, x)
        for n in sharded:  # gathered: the module's state dict is the full EMA
            habit[f"{n}/module_saved"] = rank != 0 or _same_state(
                _module(n, ours[n]).state_dict(), _module(n, real[n]).state_dict()
            )
        out["sharded_option"].update(habit)
    if world == 2:
        out["lightning"] = lightning_runs(world, base / "lightning")
        out["diffusers_habit"] = diffusers_habit(rank, base / "unet_ema")
    return out


def _module(name: str, ema: Any) -> nn.Module:
    return ema.ema_model if OPTIONS[name][0] == "ep" else ema.module


def _same_forward(name: str, real: Any, ours: Any, x: torch.Tensor, atol: float = 0.0) -> bool:
    """The drop-in's forward after ``eval()`` (collective) against the real EMA model's."""
    real.eval()
    ours.eval()
    with torch.no_grad():
        a, b = real(x), ours(x)
    return bool(torch.isfinite(a).all()) and bool((a - b).abs().max() <= atol)


def sharded_save(
    rank: int, names: list[str], real: dict[str, Any], ours: dict[str, Any], x: torch.Tensor
) -> dict[str, Any]:
    """Drop-ins evaluating through the sharded module (FSDP2 models, evaluation="sharded"):
    the rank-0 save refuses until gather_for_save() ran on every rank, then equals the real
    library's state dict bit for bit; the forward matches within FSDP2's rounding."""
    out: dict[str, Any] = {}
    for n in names:
        refusal = "no error"
        if rank == 0:
            try:
                ours[n].state_dict()
            except RuntimeError as e:
                refusal = str(e)
        if OPTIONS[n][0] != "df":
            ours[n].eval()  # sharded: gathers nothing
            refusal_after_eval = "no error"
            if rank == 0:
                try:
                    ours[n].state_dict()
                except RuntimeError as e:
                    refusal_after_eval = str(e)
            out[f"{n}/forward"] = _same_forward(n, real[n], ours[n], x, atol=1e-5)
            out[f"{n}/after_eval"] = refusal_after_eval if rank == 0 else None
        ours[n].gather_for_save()
        saved = ours[n].state_dict() if rank == 0 else None
        out[f"{n}/refusal"] = refusal if rank == 0 else None
        out[f"{n}/saved"] = rank != 0 or _same_state(
            _ema_part(saved), _ema_part(real[n].state_dict())
        )
    return out


def _ema_part(state: Any) -> Any:
    """ema-pytorch's state dict without the online model (an FSDP2 model's own DTensors)."""
    return {k: v for k, v in state.items() if not k.startswith("online_model.")}


def _same_state(a: Any, b: Any) -> bool:
    """Two libraries' state dicts: every tensor (nested in lists too) equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_state(u, v) for u, v in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        a, b = a.detach().cpu(), b.detach().cpu()
        return a.dtype == b.dtype and bool(torch.isfinite(a.float()).all()) and torch.equal(a, b)
    return bool(a == b)


def train_unet(model: nn.Module, emas: list[Any], steps: int, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        model(torch.randn(2, 1, 8, 8, generator=g), i).sample.square().mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in emas:
            ema.step(model.module.parameters() if isinstance(model, DDP) else model.parameters())


def diffusers_habit(rank: int, path: Path) -> dict[str, Any]:
    """train_text_to_image's checkpoint hooks under DDP: save_pretrained on the main process,
    EMAModel.from_pretrained + load_state_dict on every rank, then resume."""
    from diffusers import UNet2DModel

    unet = tiny_unet()
    model = DDP(unet)
    kw: dict[str, Any] = dict(model_cls=UNet2DModel, model_config=unet.config, decay=0.9)
    real = RealEMAModel(unet.parameters(), **kw)
    ours = our_diffusers.EMAModel(unet.parameters(), **kw)
    train_unet(model, [real, ours], 3, seed=100 * rank)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if rank == 0:
            try:
                ours.save_pretrained(str(path))
                out["refusal"] = "no error"
            except RuntimeError as e:
                out["refusal"] = str(e)
        ours.gather_for_save()
        if rank == 0:
            ours.save_pretrained(str(path))
        dist.barrier()
        loaded = our_diffusers.EMAModel.from_pretrained(str(path), UNet2DModel)
        theirs = RealEMAModel.from_pretrained(str(path), UNet2DModel)
    resumed = our_diffusers.EMAModel(unet.parameters(), **kw)
    resumed.load_state_dict(loaded.state_dict())
    shadow = [t.detach().clone() for t in real.shadow_params]
    out["real_loads_ours"] = all(
        torch.equal(a, b) for a, b in zip(shadow, theirs.shadow_params, strict=True)
    )
    out["step"] = resumed.optimization_step
    train_unet(model, [real, resumed], 2, seed=1000 + 100 * rank)
    full = resumed.engine.get_ema_state_dict()
    out["resumed"] = all(torch.equal(a, full[str(i)]) for i, a in enumerate(real.shadow_params))
    return out


# ------------------------------------------------------------------------ Lightning
class LNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SeenAtValidation(Callback):
    """Put after the averaging callback: the weights validation runs with."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append({k: v.clone() for k, v in pl_module.state_dict().items()})


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 5, generator=g), torch.randn(32, 3, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


LIGHTNING_OPTIONS = {
    "default": {},
    "custom": dict(decay=0.8, update_every_n_steps=2, update_starting_at_step=3, use_buffers=False),
}


def fit(world: int, root: Path, callback: Callback, ckpt_path: str | None = None) -> dict[str, Any]:
    seen = SeenAtValidation()
    model = LNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy="ddp" if world > 1 else "auto",
            callbacks=[
                callback,
                seen,
                ModelCheckpoint(dirpath=str(root), every_n_train_steps=4, save_top_k=-1),
            ],
            default_root_dir=str(root),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=10,
            val_check_interval=3,
            limit_val_batches=1,
            num_sanity_val_steps=1,
        )
        trainer.fit(model, _loader(), _loader(), ckpt_path=ckpt_path)
    return {"final": {k: v.clone() for k, v in model.state_dict().items()}, "seen": seen.seen}


def lightning_runs(world: int, root: Path) -> dict[str, Any]:
    """Real and drop-in Lightning fits; checkpoints compared key by key."""
    out: dict[str, Any] = {}
    end_of_epoch_0 = f"epoch=0-step={8 // world}.ckpt"  # resumes exactly (no mid-epoch)
    for name, options in LIGHTNING_OPTIONS.items():
        real = fit(world, root / f"real-{name}", RealEMAWA(**options))
        ours = fit(world, root / f"ours-{name}", our_lightning.EMAWeightAveraging(**options))
        files = sorted(p.name for p in (root / f"real-{name}").iterdir())
        checkpoints = {}
        for f in files:
            a = torch.load(root / f"real-{name}" / f, weights_only=False)
            b = torch.load(root / f"ours-{name}" / f, weights_only=False)
            checkpoints[f] = {
                key: same(a[key], b[key]) for key in ("state_dict", "current_model_state")
            } | {
                "n_averaged": bool(
                    a["averaging_state"]["n_averaged"] == b["averaging_state"]["n_averaged"]
                )
            }
        resumed = fit(
            world,
            root / f"resume-{name}",
            our_lightning.EMAWeightAveraging(**options),
            ckpt_path=str(root / f"ours-{name}" / end_of_epoch_0),
        )
        out[name] = {
            "final": same(real["final"], ours["final"]),
            "seen": len(real["seen"]) == len(ours["seen"])
            and all(same(a, b) for a, b in zip(real["seen"], ours["seen"], strict=True)),
            "validations": len(ours["seen"]),
            "checkpoints": checkpoints,
            "resumed_final": same(resumed["final"], ours["final"]),
            "first_ckpt": str(root / f"ours-{name}" / files[0]),
        }
    return out


def _lightning_body(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29999")  # unused: the group already exists
    return _body(rank, world, root)


# ------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("compat")
    out = {}
    for world in (2, 3):
        d = root / f"w{world}"
        d.mkdir()
        out[world] = run_ranks(_lightning_body, world, d, str(d))
    # W=1 with a process group runs here: one gloo rank needs no spawn.
    d = root / "w1"
    d.mkdir()
    store = dist.FileStore(str(d / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out[1] = [_body(0, 1, str(d))]
    finally:
        dist.destroy_process_group()
    out[0] = [{"root": str(root)}]
    return out


# ------------------------------------------------------------------------ pure tests
def test_schedules_match_the_libraries() -> None:
    ep = ema_pytorch.EMA(
        nn.Linear(2, 2), beta=0.995, update_after_step=0, inv_gamma=2.0, power=0.7, min_value=0.01
    )
    ours = EmaPytorchDecay(decay=0.995, gamma=2.0, power=0.7, min_decay=0.01)
    for k in range(0, 300, 7):
        ep.step.fill_(k)
        assert ours(k) == ep.get_current_decay(), k  # float32 rounding, as ema-pytorch
    df = RealEMAModel(nn.Linear(2, 2).parameters(), decay=0.95, min_decay=0.2, update_after_step=3)
    sched = DiffusersDecay(decay=0.95, min_decay=0.2)
    for k in range(0, 300, 7):
        assert sched(max(k - 3, 0)) == df.get_decay(k), k
    mean = RunningMeanDecay()
    for n in range(0, 50):
        torch_weight = 1 / (torch.tensor(n) + 1)
        assert 1.0 - mean(n + 1) == torch_weight.item(), n


def test_formulas_round_like_the_libraries() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1001, generator=g), torch.randn(1001, generator=g)
    for d in (0.0, 0.3, 0.999):
        ema = [a.clone()]
        combine_(ema, [b], d, "weighted_sum")
        assert torch.equal(ema[0], d * a + (1 - d) * b)
        ema = [a.clone()]
        combine_(ema, [b], d, "subtract")
        assert torch.equal(ema[0], a - (1 - d) * (a - b))
        ema = [a.clone()]
        combine_(ema, [b], d, "subtract_alpha")
        ref = a.clone()
        torch._foreach_sub_([ref], torch._foreach_sub([ref], [b]), alpha=1 - d)
        assert torch.equal(ema[0], ref)
    with pytest.raises(ValueError, match="formula"):
        combine_([a.clone()], [b], 0.5, "nope")


def test_no_process_group_bit_exact() -> None:
    net = Net()
    equal, _, _ = compare_run(0, net, net, net, list(OPTIONS), STEPS)
    assert equal == {n: True for n in OPTIONS}


def test_swa_running_mean_bit_exact_on_cpu() -> None:
    """torch's SWA without a function divides on CPU (``a + (b - a) / (n + 1)``, its
    ``get_swa_avg_fn``); so does the engine there (formula ``"swa"``): bit for bit, also
    with ``use_buffers=True``. (Before: a lerp with the float32 weight, 1.9e-9 apart.)"""
    for use_buffers in (False, True):
        net = Net()
        real = torch_swa.AveragedModel(net, use_buffers=use_buffers)
        ours = our_swa.AveragedModel(net, use_buffers=use_buffers)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i in range(20):
            train_step(net, opt, i)
            real.update_parameters(net)
            ours.update_parameters(net)
        a, b = real.state_dict(), ours.state_dict()
        assert int(a["n_averaged"]) == int(b["n_averaged"]) == 20
        floats = {k: v for k, v in a.items() if v.is_floating_point()}
        assert same(floats, {k: b[k] for k in floats}), use_buffers


def test_refusals_are_clear() -> None:
    net = Net()
    with pytest.raises(ValueError, match="not elementwise"):
        our_swa.AveragedModel(net, avg_fn=lambda a, b, n: a / a.norm() + b)
    with pytest.raises(ValueError, match="not elementwise"):
        our_lightning.WeightAveraging(multi_avg_fn=lambda a, b, n: [x.sub_(x.mean()) for x in a])
    with pytest.raises(ValueError, match="update_model_with_ema_every"):
        our_ema_pytorch.EMA(net, update_model_with_ema_every=5)
    with pytest.raises(ValueError, match="ignore_names/ignore_startswith_names or track="):
        our_ema_pytorch.EMA(net, ignore_names={"body.0.weight"}, track="trainable")
    with pytest.raises(ValueError, match="device"):
        our_swa.AveragedModel(net, device="meta")
    from dtensor_ema import ModelEMA, MultiModelEMA

    with pytest.raises(ValueError, match="eager kernel only"):
        ModelEMA(net, formula="subtract", capturable=True)
    with pytest.raises(ValueError, match="formula"):
        ModelEMA(net, formula="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="formula"):
        MultiModelEMA(net, {"a": {"formula": "subtract"}})
    # a lerp EMA's checkpoint config is unchanged; another formula is part of it
    assert "formula" not in ModelEMA(net).state_dict()["config"]
    assert '"formula": "subtract"' in ModelEMA(net, formula="subtract").state_dict()["config"]


def test_diffusers_save_pretrained_round_trip(tmp_path: Path) -> None:
    from diffusers import UNet2DModel

    unet = tiny_unet
    m = unet()
    kw = dict(model_cls=UNet2DModel, model_config=m.config, decay=0.9)
    real, ours = RealEMAModel(m.parameters(), **kw), our_diffusers.EMAModel(m.parameters(), **kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for i in range(4):
        m(torch.randn(2, 1, 8, 8), i).sample.square().mean().backward()
        opt.step()
        opt.zero_grad()
        real.step(m.parameters())
        ours.step(m.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours.save_pretrained(str(tmp_path / "ours"))
        back = our_diffusers.EMAModel.from_pretrained(str(tmp_path / "ours"), UNet2DModel)
        theirs = RealEMAModel.from_pretrained(str(tmp_path / "ours"), UNet2DModel)
    assert back.optimization_step == theirs.optimization_step == 4
    for a, b, c in zip(
        real.shadow_params, back.state_dict()["shadow_params"], theirs.shadow_params, strict=True
    ):
        assert torch.equal(a, b) and torch.equal(a, c)
    # the train_text_to_image load hook: load_state_dict(from_pretrained(...).state_dict())
    resumed = our_diffusers.EMAModel(m.parameters(), **kw)
    resumed.load_state_dict(back.state_dict())
    real.step(m.parameters())
    resumed.step(m.parameters())
    assert all(
        torch.equal(a, b)
        for a, b in zip(real.shadow_params, resumed.state_dict()["shadow_params"], strict=True)
    )


def test_lightning_w1_matches_and_load_from_checkpoint(tmp_path: Path) -> None:
    """Mirrors Lightning ``tests_pytorch/callbacks/test_weight_averaging.py``
    ``test_ema_resume`` and ``test_ema_weight_averaging_checkpoint_save_load``: checkpoints
    in Lightning's layout, bit for bit, and a resumed fit ending where the uninterrupted one
    ends; ``load_from_checkpoint`` gives the averaged model."""
    out = lightning_runs(1, tmp_path)
    for name, run in out.items():
        assert run["final"] and run["seen"] and run["validations"] >= 3, (name, run)
        assert run["checkpoints"] and all(all(c.values()) for c in run["checkpoints"].values()), run
        assert run["resumed_final"], name
        ckpt = torch.load(run["first_ckpt"], weights_only=False)
        loaded = LNet.load_from_checkpoint(run["first_ckpt"])  # the averaged model
        assert same({k: v for k, v in loaded.state_dict().items()}, ckpt["state_dict"])


# ------------------------------------------------------------------------ multi-rank
@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_bit_exact_and_resume(ranks: dict[int, list[dict[str, Any]]], world: int) -> None:
    for out in ranks[world]:
        assert out["ddp"] == {n: True for n in OPTIONS}
        assert out["resumed"] == {n: True for n in OPTIONS}
        assert out["continued"] == {n: True for n in OPTIONS}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_bit_exact(ranks: dict[int, list[dict[str, Any]]], world: int) -> None:
    for out in ranks[world]:
        assert out["fsdp2"] == {n: True for n in OPTIONS}
    if world == 1:  # live: the rank-0 save and the forward need no gather, bit for bit
        assert ranks[1][0]["fsdp2_live"] == {n: True for n in OPTIONS}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_rank0_save_is_refused_with_the_fix(
    ranks: dict[int, list[dict[str, Any]]], world: int
) -> None:
    refusals = ranks[world][0]["refusals"]
    assert set(refusals) == set(OPTIONS)
    for message in refusals.values():
        assert "gather_for_save()" in message and "every rank" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_through_the_dropins_module(
    ranks: dict[int, list[dict[str, Any]]], world: int
) -> None:
    """ema(x) / swa_model(x) after eval() equal the real EMA model's forward bit for bit;
    the module itself refuses to run while its weights are not gathered."""
    with_module = [n for n in OPTIONS if OPTIONS[n][0] != "df"]
    for out in ranks[world]:
        assert out["forward"] == {n: True for n in with_module}
        assert set(out["direct"]) == set(with_module)
        for message in out["direct"].values():
            assert "gather_for_save()" in message and "every rank" in message, message
    for out in ranks[1]:  # one rank: the module holds the live EMA, nothing to gather
        assert out["forward"] == {n: True for n in with_module}
        assert out["direct"] == {n: "no error" for n in with_module}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_evaluation_and_rank0_save(
    ranks: dict[int, list[dict[str, Any]]], world: int
) -> None:
    """FSDP2 models, and evaluation="sharded" on DDP: the per-unit forward matches the real
    EMA model; the rank-0 save refuses (also after eval(), which gathers nothing) until
    gather_for_save() ran on every rank, then equals the real library's state dict."""
    for out in ranks[world]:
        for part in ("fsdp2_save", "sharded_option"):
            assert out[part], part
            for key, value in out[part].items():
                if key.endswith(("/forward", "/saved", "/module_saved")):
                    assert value is True, (part, key)
                elif value is not None:  # rank 0's refusals
                    assert "gather_for_save()" in value and "every rank" in value, (key, value)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_rank0_files_load_into_the_real_libraries(
    ranks: dict[int, list[dict[str, Any]]], world: int
) -> None:
    root = Path(ranks[0][0]["root"]) / f"w{world}"
    for name in OPTIONS:
        ours = torch.load(root / f"{name}-w{world}.pt", weights_only=False)
        theirs = torch.load(root / f"{name}-real-w{world}.pt", weights_only=False)
        fresh = make(name, Net(), ours=False)
        fresh.load_state_dict(ours)
        assert same(real_full(name, fresh), real_full(name, _loaded(name, theirs))), name


def _loaded(name: str, state: dict[str, Any]) -> Any:
    ema = make(name, Net(), ours=False)
    ema.load_state_dict(state)
    return ema


@pytest.mark.distributed
def test_diffusers_checkpoint_hooks_w2(ranks: dict[int, list[dict[str, Any]]]) -> None:
    for rank, out in enumerate(ranks[2]):
        habit = out["diffusers_habit"]
        assert habit["real_loads_ours"] and habit["resumed"] and habit["step"] == 3, habit
        if rank == 0:
            assert "gather_for_save()" in habit["refusal"], habit["refusal"]


@pytest.mark.distributed
def test_lightning_ddp_w2(ranks: dict[int, list[dict[str, Any]]]) -> None:
    """Mirrors Lightning ``test_weight_averaging.py`` ``test_ema_resume_ddp`` (there under
    ``ddp_spawn``; ``ddp_spawn`` itself: ``test_compat_upstream.py``) at W=2."""
    for name, run in ranks[2][0]["lightning"].items():
        assert run["final"] and run["seen"] and run["validations"] >= 2, (name, run)
        assert run["checkpoints"] and all(all(c.values()) for c in run["checkpoints"].values()), run
        assert run["resumed_final"], name
