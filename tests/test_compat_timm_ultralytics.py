"""dtensor_ema.compat.timm and .ultralytics against the real timm and ultralytics.

One spawned body per world size: a small BatchNorm CNN under DDP trains a few real SGD
steps (different data per rank) with several option sets; every rank keeps the real timm
``ModelEmaV3`` and the real ultralytics ``ModelEMA`` (8.4.190, the ``compat`` extra) beside
our drop-ins, and the body returns bit-exact comparisons of weights, per-rank buffers,
``distribute_bn``, ultralytics' validation habit (rank 0's EMA buffers broadcast, then
``ema.ema`` forward), the rank-0 save habit (ultralytics: its own ``BaseTrainer.save_model``)
and a resume from the rank-0 file.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_harness import require_extra, run_ranks

timm_utils = pytest.importorskip("timm.utils")
require_extra("ultralytics", "compat")

TIMM_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "warmup": {
        "decay": 0.99,
        "use_warmup": True,
        "warmup_power": 3 / 4,
        "warmup_gamma": 2.0,
        "min_decay": 0.3,
        "update_after_step": 2,
    },
    "exclude_buffers": {"decay": 0.9, "exclude_buffers": True, "update_after_step": 1},
    "no_step": {"decay": 0.8},  # update(model) without step=
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 7, 3)
        self.bn1 = nn.BatchNorm2d(7)
        self.conv2 = nn.Conv2d(7, 5, 3)
        self.bn2 = nn.BatchNorm2d(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (bitwise), or are missing."""
    bad = [k for k in a if k not in b or not torch.equal(a[k].float(), b[k].float())]
    return bad + [k for k in b if k not in a]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(4, 3, 9, 9, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def body(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from timm.utils import ModelEmaV3, distribute_bn, unwrap_model

    from dtensor_ema.compat.timm import ModelEmaV2
    from dtensor_ema.compat.timm import ModelEmaV3 as OurV3

    distributed = dist.is_initialized()
    out: dict[str, Any] = {}
    for name, opts in TIMM_OPTIONS.items():
        torch.manual_seed(0)
        net = Net()
        theirs, ours = ModelEmaV3(net, **opts), OurV3(net, **opts)
        model = nn.parallel.DistributedDataParallel(net) if distributed else net
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(1, 6):
            _train_step(model, opt, rank, step)
            kwargs = {} if name == "no_step" else {"step": step}
            theirs.update(net, **kwargs)
            ours.update(net, **kwargs)
        out[f"{name}/decay"] = (theirs.get_decay(7), ours.get_decay(7), ours.get_decay())
        stale_error = ""
        if distributed and world > 1:
            try:
                ours.module.state_dict()
            except RuntimeError as e:
                stale_error = str(e)
        out[f"{name}/stale_refused"] = stale_error
        if name == "no_step":
            ours.gather_for_save()  # the name every drop-in shares: the same gather
        else:
            ours.eval()
        out[f"{name}/weights"] = _same(ours.module.state_dict(), theirs.module.state_dict())
        x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            out[f"{name}/forward"] = torch.equal(ours(x), theirs(x))
        if distributed:
            distribute_bn(theirs, world, True)
            distribute_bn(ours, world, True)
            out[f"{name}/distribute_bn"] = _same(
                dict(ours.module.named_buffers()), dict(theirs.module.named_buffers())
            )
        path = Path(tmp) / f"{name}.pt"
        if rank == 0:  # timm's habit: rank 0 saves unwrap_model(model_ema).state_dict()
            torch.save(unwrap_model(ours).state_dict(), path)
            torch.save(unwrap_model(theirs).state_dict(), Path(tmp) / f"{name}-timm.pt")
        if distributed:
            dist.barrier()
        saved = torch.load(path)
        out[f"{name}/saved_equals_timm_rank0"] = _same(
            saved, torch.load(Path(tmp) / f"{name}-timm.pt")
        )
        # Resume: every rank loads rank 0's file, as timm's train.py does, then trains on.
        resumed = OurV3(net, **opts)
        unwrap_model(resumed).load_state_dict(saved)
        theirs.module.load_state_dict(saved)
        for step in range(6, 8):
            _train_step(model, opt, rank, step)
            kwargs = {} if name == "no_step" else {"step": step}
            theirs.update(net, **kwargs)
            resumed.update(net, **kwargs)
        resumed.eval()
        out[f"{name}/resumed"] = _same(resumed.module.state_dict(), theirs.module.state_dict())
        out[f"{name}/bytes"] = (ours.engine.local_nbytes(), _nbytes(theirs.module))

    if distributed:
        out.update(_fsdp2_part(rank))  # W=1 too: a one-rank mesh
    if distributed and world > 1:
        # ModelEMA(replicate_buffers=True): float buffers plain and whole, parameters sharded.
        tensors = ours.engine.ema_tensors()
        out["replicated_buffer_types"] = sorted(
            {type(tensors[k]).__name__ for k, _ in net.named_buffers() if k in tensors}
        )
        out["sharded_param_types"] = sorted(
            {type(tensors[k]).__name__ for k, _ in net.named_parameters()}
        )
        try:
            ours.engine.build_module()
            out["build_module"] = "built"
        except NotImplementedError as e:
            out["build_module"] = str(e)

    # timm ModelEmaV2: decay * ema + (1 - decay) * model, same rounding (weighted_sum).
    torch.manual_seed(0)
    net = Net()
    theirs2, ours2 = timm_utils.ModelEmaV2(net, decay=0.9), ModelEmaV2(net, decay=0.9)
    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        _train_step(model, opt, rank, step)
        theirs2.update(net)
        ours2.update(net)
    ours2.eval()
    a, b = ours2.module.state_dict(), theirs2.module.state_dict()
    out["v2/max_abs_gap"] = max(
        float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()
    )
    out["v2/max_abs"] = max(float(b[k].abs().max()) for k in b if b[k].is_floating_point())

    out.update(_swa_update_bn(rank, distributed))

    for name, opts in ULTRA_OPTIONS.items():
        out.update(_ultralytics_part(rank, world, distributed, tmp, name, opts))
    return out


ULTRA_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "custom": {"decay": 0.95, "tau": 3, "updates": 4},
}


def _save_model(ema: Any, model: nn.Module, opt: torch.optim.Optimizer, wdir: Path) -> None:
    """ultralytics' own ``BaseTrainer.save_model`` (rank 0's checkpoint ``wdir/last.pt``:
    ``deepcopy(ema.ema).half()`` pickled whole under ``'ema'``, ``ema.updates`` under
    ``'updates'``) on a stand-in trainer holding just what it reads."""
    from types import SimpleNamespace

    from ultralytics.engine.trainer import BaseTrainer

    trainer = SimpleNamespace(
        ema=ema,
        model=model,
        optimizer=opt,
        epoch=0,
        best_fitness=1.0,
        fitness=0.5,
        metrics={},
        stopper=SimpleNamespace(best_fitness=1.0, best_epoch=0),
        scaler=SimpleNamespace(state_dict=dict),
        args=SimpleNamespace(),
        read_results_csv=dict,
        wdir=wdir,
        last=wdir / "last.pt",
        best=wdir / "best.pt",
        save_period=-1,
    )
    BaseTrainer.save_model(trainer)  # type: ignore[arg-type]


def _ultralytics_part(
    rank: int, world: int, distributed: bool, tmp: str, name: str, opts: dict[str, Any]
) -> dict[str, Any]:
    """ultralytics' trainer habits, the real ``ModelEMA`` and ours side by side on every
    rank: ``ModelEMA(model)`` on the DDP-wrapped model, ``update(model)`` after each step,
    ``update_attr`` on rank 0; ``validate()`` on every rank (a broadcast of rank 0's EMA
    buffers, then ``ema.ema.float().eval()`` forward under inference mode); rank 0 saves with
    ``save_model``; every rank resumes from rank 0's file as ``_load_checkpoint_state``
    does and trains on. Ours needs one line more: ``materialize()`` on every rank."""
    from ultralytics.utils.torch_utils import ModelEMA as TheirUltra

    from dtensor_ema.compat.ultralytics import ModelEMA as OurUltra

    torch.manual_seed(0)
    net = Net()
    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    theirs, ours = TheirUltra(model, **opts), OurUltra(model, **opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net.names = {0: "a"}
    for step in range(1, 6):
        _train_step(model, opt, rank, step)
        theirs.update(model)
        ours.update(model)
    if rank == 0:  # the trainer's epoch end, rank 0 only
        for ema in (theirs, ours):
            ema.update_attr(model, include=["yaml", "nc", "args", "names", "stride"])
    out: dict[str, Any] = {}
    wdir, their_wdir = Path(tmp) / f"ultra-{name}", Path(tmp) / f"ultra-{name}-theirs"
    stale = ""
    if rank == 0 and distributed and world > 1:
        try:  # rank 0's save_model without the gather: refused, nothing written
            _save_model(ours, model, opt, Path(tmp) / f"ultra-{name}-stale")
        except RuntimeError as e:
            stale = str(e)
    out[f"ultra-{name}/stale_refused"] = stale
    # The one line ours needs, on every rank before validate() (both names do the same).
    if name == "custom":
        ours.gather_for_save()
    else:
        ours.materialize()
    if distributed and world > 1:  # BaseTrainer.validate: sync EMA buffers from rank 0
        for ema in (theirs, ours):
            for buffer in ema.ema.buffers():
                dist.broadcast(buffer, src=0)
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():  # BaseValidator.__call__: model.float(), model.eval()
        y_theirs, y_ours = theirs.ema.float().eval()(x), ours.ema.float().eval()(x)
    out[f"ultra-{name}/forward"] = torch.equal(y_ours, y_theirs)
    out[f"ultra-{name}/weights"] = _same(ours.ema.state_dict(), theirs.ema.state_dict())
    out[f"ultra-{name}/updates"] = (ours.updates, theirs.updates, ours.decay(5), theirs.decay(5))
    out[f"ultra-{name}/attr"] = (
        getattr(ours.ema, "names", None),
        getattr(theirs.ema, "names", None),
    )
    if rank == 0:
        _save_model(ours, model, opt, wdir)
        _save_model(theirs, model, opt, their_wdir)
    if distributed:
        dist.barrier()
    ckpt = torch.load(wdir / "last.pt", weights_only=False)
    their_ckpt = torch.load(their_wdir / "last.pt", weights_only=False)
    out[f"ultra-{name}/saved"] = _same(ckpt["ema"].state_dict(), their_ckpt["ema"].state_dict())
    out[f"ultra-{name}/saved_meta"] = (
        (ckpt["updates"], type(ckpt["ema"]).__name__, ckpt["ema"].conv1.weight.dtype),
        (
            their_ckpt["updates"],
            type(their_ckpt["ema"]).__name__,
            their_ckpt["ema"].conv1.weight.dtype,
        ),
    )
    # BaseTrainer._load_checkpoint_state on every rank: a new ModelEMA, the half checkpoint
    # loaded as float, ``updates`` set; then training goes on, as it does for the EMAs that
    # just validated (ours: its float buffers are the ones rank 0's broadcast wrote).
    ramp = {k: v for k, v in opts.items() if k != "updates"}
    resumed, their_resumed = OurUltra(model, **ramp), TheirUltra(model, **ramp)
    for ema, file in ((resumed, ckpt), (their_resumed, their_ckpt)):
        ema.ema.load_state_dict(file["ema"].float().state_dict())
        ema.updates = file["updates"]
    for step in range(6, 8):
        _train_step(model, opt, rank, step)
        for ema in (theirs, ours, their_resumed, resumed):
            ema.update(model)
    resumed.materialize()
    ours.materialize()
    out[f"ultra-{name}/continued"] = _same(ours.ema.state_dict(), theirs.ema.state_dict())
    out[f"ultra-{name}/resumed"] = _same(resumed.ema.state_dict(), their_resumed.ema.state_dict())
    out[f"ultra-{name}/resumed_updates"] = (resumed.updates, their_resumed.updates)
    return out


def _swa_update_bn(rank: int, distributed: bool) -> dict[str, Any]:
    """torch's SWA habit on a BatchNorm model under DDP: ``update_bn(loader, swa_model)``
    recomputes the average's own statistics (each rank from its own batches), then the
    forward in eval mode; the drop-in against torch's ``AveragedModel``, bit for bit. The
    drop-in needs ``gather_for_save()`` on every rank first: a forward after an update never
    gathers behind the caller's back (``train()``, which ``update_bn`` calls, keeps it)."""
    from torch.optim import swa_utils

    from dtensor_ema.compat.swa_utils import AveragedModel

    torch.manual_seed(0)
    net = Net()
    theirs = swa_utils.AveragedModel(net, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    ours = AveragedModel(net, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        _train_step(model, opt, rank, step)
        theirs.update_parameters(net)
        ours.update_parameters(net)
    g = torch.Generator().manual_seed(50 + rank)
    loader = [torch.randn(4, 3, 9, 9, generator=g) for _ in range(2)]
    swa_utils.update_bn(loader, theirs)
    ours.gather_for_save()  # every rank
    swa_utils.update_bn(loader, ours)
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        same_forward = torch.equal(ours(x), theirs(x))
    return {
        "swa/update_bn": _same(ours.module.state_dict(), theirs.module.state_dict()),
        "swa/update_bn_forward": same_forward,
    }


def _fsdp2_pair(
    rank: int, theirs_cls: Any, ours_cls: Any, opts: dict[str, Any], step: bool
) -> tuple[Any, Any]:
    """A small FSDP2 model trained 5 SGD steps with our drop-in ``ours_cls`` on it, and the
    real library's ``theirs_cls`` on a plain copy fed the model's full weights after every
    step (``update(model, step=)`` when ``step``). Returns ``(theirs, ours)``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 3))
    plain = copy.deepcopy(net)
    theirs = theirs_cls(plain, **opts)
    for layer in (net[0], net[3]):
        fully_shard(layer)
    fully_shard(net)
    ours = ours_cls(net, **opts)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i in range(1, 6):
        g = torch.Generator().manual_seed(1000 * rank + i)
        net(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        plain.load_state_dict({k: v.full_tensor() for k, v in net.state_dict().items()})
        kwargs = {"step": i} if step else {}
        theirs.update(plain, **kwargs)
        ours.update(net, **kwargs)
    return theirs, ours


def _fsdp2_part(rank: int) -> dict[str, Any]:
    """An FSDP2 model with the timm facade; real timm on a plain copy fed the full weights."""
    from timm.utils import ModelEmaV3

    from dtensor_ema.compat.timm import ModelEmaV3 as OurV3

    theirs, ours = _fsdp2_pair(rank, ModelEmaV3, OurV3, TIMM_OPTIONS["warmup"], step=True)
    full = ours.engine.get_ema_state_dict()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gap = float((ours(x) - theirs(x)).abs().max())
    out = {"fsdp2/weights": _same(full, theirs.module.state_dict()), "fsdp2/forward_gap": gap}
    return out | _ultralytics_fsdp2_part(rank)


def _ultralytics_fsdp2_part(rank: int) -> dict[str, Any]:
    """An FSDP2 model with the ultralytics drop-in; real ultralytics on a plain copy fed
    the full weights (its own ``ModelEMA`` cannot deepcopy an FSDP2 model)."""
    from ultralytics.utils.torch_utils import ModelEMA

    from dtensor_ema.compat.ultralytics import ModelEMA as Ours

    theirs, ours = _fsdp2_pair(rank, ModelEMA, Ours, ULTRA_OPTIONS["custom"], step=False)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gap = float((ours.ema(x) - theirs.ema(x)).abs().max())
    return {
        "ultralytics_fsdp2/weights": _same(
            ours.engine.get_ema_state_dict(), theirs.ema.state_dict()
        ),
        "ultralytics_fsdp2/updates": (ours.updates, theirs.updates),
        "ultralytics_fsdp2/forward_gap": gap,
    }


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _check(results: list[dict[str, Any]], world: int, distributed: bool) -> None:
    for rank, out in enumerate(results):
        for name in TIMM_OPTIONS:
            theirs_decay, ours_decay, ours_default = out[f"{name}/decay"]
            assert ours_decay == theirs_decay and math.isfinite(ours_decay)
            assert ours_default == TIMM_OPTIONS[name].get("decay", 0.9999)
            for check in ("weights", "saved_equals_timm_rank0", "resumed"):
                assert out[f"{name}/{check}"] == [], (rank, name, check)
            assert out[f"{name}/forward"], (rank, name)
            if distributed:
                assert out[f"{name}/distribute_bn"] == [], (rank, name)
            if distributed and world > 1:
                stale = out[f"{name}/stale_refused"]
                assert "model_ema.gather_for_save()" in stale, (rank, name)
                assert "model_ema.eval()" in stale and "every rank" in stale, (rank, name)
                local, full = out[f"{name}/bytes"]
                assert local < full * 0.75, (local, full)
        if distributed and world > 1:
            assert out["replicated_buffer_types"] == ["Tensor"]
            assert out["sharded_param_types"] == ["DTensor"]
            assert "replicate_buffers=True" in out["build_module"]
        if distributed:
            assert out["fsdp2/weights"] == [], rank
            assert out["fsdp2/forward_gap"] <= 1e-5, rank
            assert out["ultralytics_fsdp2/weights"] == [], rank
            assert out["ultralytics_fsdp2/updates"] == (9, 9), rank  # 4 + 5 updates
            assert out["ultralytics_fsdp2/forward_gap"] <= 1e-5, rank
        assert out["v2/max_abs_gap"] == 0 and math.isfinite(out["v2/max_abs"])
        assert out["swa/update_bn"] == [] and out["swa/update_bn_forward"], rank
        for name, opts in ULTRA_OPTIONS.items():
            for check in ("weights", "saved", "continued", "resumed"):
                assert out[f"ultra-{name}/{check}"] == [], (rank, name, check)
            assert out[f"ultra-{name}/forward"], (rank, name)
            updates, their_updates, d, their_d = out[f"ultra-{name}/updates"]
            assert (updates, d) == (their_updates, their_d) and updates == 5 + opts.get(
                "updates", 0
            )
            ours_meta, their_meta = out[f"ultra-{name}/saved_meta"]
            assert ours_meta == their_meta == (updates, "Net", torch.float16), (rank, name)
            assert out[f"ultra-{name}/resumed_updates"] == (updates + 2, updates + 2)
            ours_attr, their_attr = out[f"ultra-{name}/attr"]
            assert ours_attr == their_attr == ({0: "a"} if rank == 0 else None), (rank, name)
            stale = out[f"ultra-{name}/stale_refused"]
            if distributed and world > 1 and rank == 0:
                assert "materialize()" in stale and "every rank" in stale, (rank, name)
            else:
                assert stale == "", (rank, name)


def test_no_process_group(tmp_path: Path) -> None:
    _check([body(0, 1, str(tmp_path))], 1, distributed=False)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_ddp(tmp_path: Path, world: int) -> None:
    _check(run_ranks(body, world, tmp_path, str(tmp_path)), world, distributed=True)
