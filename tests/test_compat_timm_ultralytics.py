"""dtensor_ema.compat.timm and .ultralytics against the real timm and ultralytics' semantics.

One spawned body per world size: a small BatchNorm CNN under DDP trains a few real SGD
steps (different data per rank) with several option sets; every rank keeps the real timm
``ModelEmaV3`` (and a reference ultralytics EMA written here from ultralytics 8.4.190's
``ModelEMA.update``: ultralytics itself needs OpenCV, ~60 MB) beside our drop-in, and the
body returns bit-exact comparisons of weights, per-rank buffers, ``distribute_bn``, the
rank-0 save habit and a resume from the rank-0 file.
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

from tests.dist_harness import run_ranks

timm_utils = pytest.importorskip("timm.utils")

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


class UltralyticsReference:
    """ultralytics 8.4.190 ``ModelEMA`` update, verbatim in substance (one foreach lerp)."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000) -> None:
        self.ema = copy.deepcopy(model).eval()
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        pairs = [(v, msd[k]) for k, v in self.ema.state_dict().items() if v.is_floating_point()]
        torch._foreach_lerp_([e for e, _ in pairs], [m for _, m in pairs], 1 - d)


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
    from dtensor_ema.compat.ultralytics import ModelEMA as OurUltra

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

    # ultralytics ModelEMA: default ramp and a non-default one.
    for name, opts in {"default": {}, "short": {"decay": 0.95, "tau": 3}}.items():
        torch.manual_seed(0)
        net = Net()
        ref, ours_u = UltralyticsReference(net, **opts), OurUltra(net, **opts)
        model = nn.parallel.DistributedDataParallel(net) if distributed else net
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net.names = {0: "a"}
        for step in range(1, 6):
            _train_step(model, opt, rank, step)
            ref.update(net)
            ours_u.update(model)
        ours_u.update_attr(model, include=["names"])
        stale = ""
        if distributed and world > 1:
            try:
                copy.deepcopy(ours_u.ema).half().state_dict()
            except RuntimeError as e:
                stale = str(e)
        out[f"ultra-{name}/stale_refused"] = stale
        if name == "short":
            ours_u.gather_for_save()
        else:
            ours_u.materialize()
        out[f"ultra-{name}/weights"] = _same(ours_u.ema.state_dict(), ref.ema.state_dict())
        out[f"ultra-{name}/updates"] = (ours_u.updates, ref.updates, ours_u.decay(5), ref.decay(5))
        out[f"ultra-{name}/attr"] = getattr(ours_u.ema, "names", None)
        path = Path(tmp) / f"ultra-{name}.pt"
        if rank == 0:  # ultralytics' habit: a half-precision deepcopy of ema.ema, pickled
            torch.save({"ema": copy.deepcopy(ours_u.ema).half(), "updates": ours_u.updates}, path)
            torch.save({"ema": copy.deepcopy(ref.ema).half()}, Path(tmp) / f"ultra-{name}-ref.pt")
        if distributed:
            dist.barrier()
        ckpt = torch.load(path, weights_only=False)
        resumed_u = OurUltra(net, **opts, updates=ckpt["updates"])
        resumed_u.ema.load_state_dict(ckpt["ema"].float().state_dict())
        resumed_u.materialize()
        ref_file = torch.load(Path(tmp) / f"ultra-{name}-ref.pt", weights_only=False)
        half = ref_file["ema"].float().state_dict()  # rank 0's replica, as ultralytics saves
        out[f"ultra-{name}/saved_half"] = _same(ckpt["ema"].float().state_dict(), half)
        out[f"ultra-{name}/resumed"] = _same(resumed_u.ema.state_dict(), half)
    return out


def _swa_update_bn(rank: int, distributed: bool) -> dict[str, Any]:
    """torch's SWA habit on a BatchNorm model under DDP: ``update_bn(loader, swa_model)``
    recomputes the average's own statistics (each rank from its own batches), then the
    forward in eval mode; the drop-in against torch's ``AveragedModel``, bit for bit."""
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


def _fsdp2_part(rank: int) -> dict[str, Any]:
    """An FSDP2 model with the timm facade; real timm on a plain copy fed the full weights."""
    from timm.utils import ModelEmaV3
    from torch.distributed.fsdp import fully_shard

    from dtensor_ema.compat.timm import ModelEmaV3 as OurV3

    opts = TIMM_OPTIONS["warmup"]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.GELU(), nn.Linear(9, 3))
    plain = copy.deepcopy(net)
    theirs = ModelEmaV3(plain, **opts)
    for layer in (net[0], net[3]):
        fully_shard(layer)
    fully_shard(net)
    ours = OurV3(net, **opts)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(1, 6):
        g = torch.Generator().manual_seed(1000 * rank + step)
        loss = net(torch.randn(4, 5, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        plain.load_state_dict({k: v.full_tensor() for k, v in net.state_dict().items()})
        theirs.update(plain, step=step)
        ours.update(net, step=step)
    full = ours.engine.get_ema_state_dict()
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gap = float((ours(x) - theirs(x)).abs().max())
    return {"fsdp2/weights": _same(full, theirs.module.state_dict()), "fsdp2/forward_gap": gap}


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
        assert out["v2/max_abs_gap"] == 0 and math.isfinite(out["v2/max_abs"])
        assert out["swa/update_bn"] == [] and out["swa/update_bn_forward"], rank
        for name in ("default", "short"):
            assert out[f"ultra-{name}/weights"] == [], (rank, name)
            assert out[f"ultra-{name}/saved_half"] == [], (rank, name)
            assert out[f"ultra-{name}/resumed"] == [], (rank, name)
            updates, ref_updates, d, ref_d = out[f"ultra-{name}/updates"]
            assert (updates, d) == (ref_updates, ref_d)
            assert out[f"ultra-{name}/attr"] == {0: "a"}
            if distributed and world > 1:
                assert "materialize()" in out[f"ultra-{name}/stale_refused"], (rank, name)


def test_no_process_group(tmp_path: Path) -> None:
    _check([body(0, 1, str(tmp_path))], 1, distributed=False)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_ddp(tmp_path: Path, world: int) -> None:
    _check(run_ranks(body, world, tmp_path, str(tmp_path)), world, distributed=True)
