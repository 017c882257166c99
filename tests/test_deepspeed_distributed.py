"""ModelEMA on DeepSpeed ZeRO through DeepSpeed's own engine (``deepspeed.initialize``), CPU gloo.

One spawn per world size, W = 3, 2, 1 in that order (each loads the checkpoints the earlier
ones wrote), every spawn with several engines and many checks; the tests below assert on
what the ranks return. ZeRO-3 is the case that matters: each rank holds only its partition
of every parameter (``p.ds_tensor``, a flat range of the flattened tensor, the last ranks'
padded), small parameters (``stage3_param_persistence_threshold``) are whole on every
rank after the first forward, and the parameter itself is a ``(0,)`` placeholder between
gathers.

The reference is written here: every rank gathers every parameter's partitions itself
(``all_gather_into_tensor`` of ``ds_tensor``, padding cut, viewed in ``ds_shape``; it also
checks that a whole persistent parameter equals that) and runs plain ``lerp_`` on the full
tensors (``tests/models.py``'s ``ReferenceEMA``), so the EMA must equal it bit for bit at
every step. The model mixes partitioned and persistent parameters, a 3-D one (a flat range
of it is up to five boxes), one with fewer elements than ranks (a rank holds nothing of
it) and a float buffer (not partitioned: split like DDP's).
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from comm_mode import comm_debug_mode
from dist_harness import run_ranks
from models import ReferenceEMA, mismatches
from torch import nn
from torch.distributed.tensor import DTensor

pytest.importorskip("deepspeed")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DECAY = 0.9
STEPS = 3
THRESHOLD = 12
"""``stage3_param_persistence_threshold``: parameters of at most 12 elements stay whole
after the first forward (the biases, the norm, ``tiny``); the weights are partitioned."""


class Net(nn.Module):
    """Conv (a 3-D weight, 36 elements), two linears (77 and 55), a norm, a 2-element
    parameter (fewer than W = 3 ranks) and a float buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.fc = nn.Linear(12, 7)
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 5)
        self.tiny = nn.Parameter(torch.randn(2))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = self.norm(self.fc(h))
        return self.head(h) * self.scale.mean() + self.tiny.sum()


def _config(stage: int, *, bf16: bool = False, **zero: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": THRESHOLD,
            **zero,
        },
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _engine(config: dict[str, Any], *, model: nn.Module | None = None) -> Any:
    import deepspeed

    if model is None:
        torch.manual_seed(0)
        model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(2, 3, 5, generator=generator).to(dtype)


def _train_step(engine: Any, step: int) -> None:
    engine.train()
    out = engine(_batch(step, next(engine.module.parameters()).dtype))
    engine.backward(out.float().square().mean())
    engine.step()


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` in full, keyed like ``Net().state_dict()``:
    ZeRO-3 parameters gathered here from their partitions (a whole copy DeepSpeed holds
    must equal them), the others as they are. Collective over the default group."""
    out: dict[str, torch.Tensor] = {}
    live = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name in Net().state_dict():
        tensor = live[name]
        if getattr(tensor, "ds_tensor", None) is None:
            out[name] = tensor.detach().clone()
            continue
        full = _gather_partitions(tensor)
        if tensor.numel() == tensor.ds_numel and not torch.equal(tensor.detach(), full):
            raise AssertionError(f"{name}: the whole copy differs from its partitions")
        out[name] = full
    return out


def _gather_partitions(param: torch.Tensor) -> torch.Tensor:
    """A ZeRO-3 parameter in full, from every rank's partition. Collective."""
    ds_tensor = param.ds_tensor.detach().contiguous()  # type: ignore[attr-defined]
    rows = torch.empty(dist.get_world_size() * ds_tensor.numel(), dtype=ds_tensor.dtype)
    dist.all_gather_into_tensor(rows, ds_tensor)
    return rows[: param.ds_numel].view(param.ds_shape).clone()  # type: ignore[attr-defined]


def _plain(state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    model = Net().to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.eval()


def _partitions(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's partition as DeepSpeed holds it, padding included, as its bytes:
    the last rank's padding is uninitialized memory (``torch.empty`` in DeepSpeed's
    ``_partition_param``), and a NaN pattern there never equals itself as a float (this
    comparison failed once in a full run at W=3, on ``norm.weight``/``norm.bias``)."""
    return {n: p.ds_tensor.clone().view(torch.uint8) for n, p in module.named_parameters()}


def _whole(module: nn.Module) -> list[str]:
    """The parameters DeepSpeed holds whole right now."""
    return [n for n, p in module.named_parameters() if p.numel() == p.ds_numel]


def _error(fn: Callable[[], object]) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


# ------------------------------------------------------------------------------ ZeRO-3 fp32
def zero3_fp32(out: dict[str, Any], tmp: Path, plan: dict[str, Any]) -> None:
    """The fp32 ZeRO-3 engine: two EMAs (one built before any forward through the engine,
    one through ``engine.module`` after a step, when the persistent parameters are whole)
    against references, then evaluation, full state dicts, export, a checkpoint, and the
    refusals."""
    from dtensor_ema import ModelEMA, export_ema, save_checkpoint

    engine = _engine(_config(3))
    module = engine.module
    out["keys"] = list(Net().state_dict())
    before = ModelEMA(engine, decay=DECAY, tau=None)
    ref_before = ReferenceEMA(gathered(module), DECAY, None)
    out["whole_at_build"] = _whole(module)
    out["ema_keys"] = list(before.get_ema_state_dict())
    out["local_nbytes"] = before.local_nbytes()
    out["groups"] = len(before.engine.groups)
    sources = {s.data_ptr() for g in before.engine.groups for s in g.source_locals}
    out["reads_partitions"] = {
        p.ds_tensor.data_ptr() for p in module.parameters() if _valid(p)
    } <= sources
    after = ref_after = None
    steps: list[dict[str, list[str]]] = []
    comms = []
    for step in range(STEPS):
        _train_step(engine, step)
        if step == 0:  # persistent parameters are whole now
            out["whole_after_step"] = _whole(module)
            after = ModelEMA(module, decay=DECAY, tau=None)
            ref_after = ReferenceEMA(gathered(module), DECAY, None)
        with comm_debug_mode() as mode:
            before.update()
        comms.append(mode.get_total_counts())
        assert after is not None and ref_after is not None
        after.update()
        weights = gathered(module)
        ref_before.update(weights)
        ref_after.update(weights)
        steps.append(
            {
                "before": mismatches(before.get_ema_state_dict(), ref_before.ema),
                "after": mismatches(after.get_ema_state_dict(), ref_after.ema),
            }
        )
    out["steps"], out["update_collectives"] = steps, comms
    assert after is not None and ref_after is not None

    # Evaluation: the EMA in the partitions, DeepSpeed's own forward, exact restore. The
    # forward (no backward) leaves every parameter whole: gathered() checks those copies.
    x = _batch(99)
    raw, held = gathered(module), _partitions(module)
    engine.eval()
    with before.average_parameters():
        inside = gathered(module)
        with torch.no_grad():
            y = engine(x)
        out["whole_inside"] = _whole(module)
        inside_after_forward = gathered(module)
    out["swap_inside"] = mismatches(inside, ref_before.ema)
    out["swap_inside"] += mismatches(inside_after_forward, ref_before.ema)
    out["swap_forward"] = torch.equal(y, _plain(ref_before.ema, torch.float32)(x))
    out["swap_restored"] = mismatches(gathered(module), raw)
    out["swap_partitions"] = mismatches(_partitions(module), held)
    with torch.no_grad():  # a second evaluation enters with every parameter whole
        with before.average_parameters():
            out["swap_inside"] += mismatches(gathered(module), ref_before.ema)
            y2 = engine(x)
        out["swap_forward"] = out["swap_forward"] and torch.equal(y2, y)
        out["swap_restored"] += mismatches(gathered(module), raw)
    _train_step(engine, STEPS)  # training goes on from the raw weights
    before.update()
    after.update()
    weights = gathered(module)
    ref_before.update(weights)
    ref_after.update(weights)
    out["after_swap"] = mismatches(before.get_ema_state_dict(), ref_before.ema) + mismatches(
        after.get_ema_state_dict(), ref_after.ema
    )

    # Full state dicts and export in real shapes.
    ema_sd, model_sd = before.get_model_state_dict()
    out["full_ema"], out["full_model"] = (
        mismatches(ema_sd, ref_before.ema),
        mismatches(model_sd, gathered(module)),
    )
    fresh = ModelEMA(module, decay=DECAY, tau=None)
    fresh.load_full_state_dict(ema_sd)  # each rank cuts its flat range out
    out["load_full"] = mismatches(fresh.get_ema_state_dict(), ref_before.ema)
    rank0 = before.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
    out["rank0_only"] = mismatches(rank0, ref_before.ema) if dist.get_rank() == 0 else list(rank0)
    path = tmp / f"export_w{dist.get_world_size()}.pt"
    export_ema(before, path)
    if dist.get_rank() == 0:
        exported = torch.load(path, weights_only=True)
        out["export"] = mismatches(exported, ref_before.ema)
        out["export_loads"] = str(Net().load_state_dict(exported, strict=True))
    out["module"] = _error(lambda: before.module)

    # A checkpoint in real shapes; loads of the other world sizes' checkpoints.
    if plan.get("save"):
        save_checkpoint({"ema": before}, plan["save"])
        out["saved"] = ref_before.ema
    out["loads"] = _load_into_zero3(module, plan.get("load", []))
    out["refusals"] = _refusals(engine, before)


def _valid(param: nn.Parameter) -> int:
    """Elements of this rank's partition that are not padding (DeepSpeed's rule)."""
    chunk = math.ceil(param.ds_numel / dist.get_world_size())
    return max(0, min(param.ds_numel - dist.get_rank() * chunk, chunk))


def _load_into_zero3(module: nn.Module, paths: list[str]) -> dict[str, Any]:
    """Each checkpoint loaded into a fresh ZeRO-3 EMA of ``module``: its full state."""
    from dtensor_ema import ModelEMA, load_checkpoint

    loads = {}
    for path in paths:
        fresh = ModelEMA(module, decay=DECAY, tau=None)
        load_checkpoint({"ema": fresh}, path)
        loads[path] = (fresh.updates, fresh.get_ema_state_dict())
    return loads


def _refusals(engine: Any, ema: Any) -> dict[str, str | None]:
    """Settings the EMA cannot follow, each refused at construction (or, for a partition
    that changes afterwards, at the next update, the EMA untouched)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from dtensor_ema import ModelEMA

    module = engine.module
    weight = module.fc.weight
    out: dict[str, str | None] = {}
    # DeepSpeed sets these on the partition when configured (NVMe offload needs libaio, the
    # quantized weights a CUDA kernel): set here on a live partition, as DeepSpeed would.
    with _patched(weight.ds_tensor, "final_location", OffloadDeviceEnum.nvme):
        out["nvme"] = _error(lambda: ModelEMA(engine))
    with _patched(weight.ds_tensor, "ds_quant_scale", torch.ones(1)):
        out["quantized"] = _error(lambda: ModelEMA(engine))
    with _patched(weight.ds_tensor, "final_location", OffloadDeviceEnum.nvme):
        out["nvme_untracked"] = _error(
            lambda: ModelEMA(engine, track=lambda fqn, t: fqn != "fc.weight")
        )
    if dist.get_world_size() > 1:  # a mesh over the same ranks in another order
        from torch.distributed.device_mesh import DeviceMesh

        reversed_mesh = DeviceMesh("cpu", list(reversed(range(dist.get_world_size()))))
        out["mesh"] = _error(lambda: ModelEMA(engine, mesh=reversed_mesh))
    state = {k: v.clone() for k, v in ema.get_ema_state_dict().items()}
    counted = ema.updates
    with _patched(weight, "ds_tensor", torch.zeros(weight.ds_tensor.numel() + 1)):
        out["repartitioned"] = _error(ema.update)
    changed = mismatches(ema.get_ema_state_dict(), state)
    out["repartitioned_untouched"] = str(changed + ([] if ema.updates == counted else ["updates"]))
    return out


# ------------------------------------------------------------------------------ ZeRO-3 bf16
def zero3_bf16(out: dict[str, Any]) -> None:
    """bf16 ZeRO-3: an fp32 EMA of the bf16 partitions, one fused pass, bit-exact; the first
    evaluation runs before any training forward (persistent parameters partitioned on
    entry, whole on exit)."""
    from dtensor_ema import ModelEMA

    engine = _engine(_config(3, bf16=True))
    module = engine.module
    ema = ModelEMA(engine, decay=DECAY, tau=None)
    ref = ReferenceEMA(gathered(module), DECAY, None)
    out.update(
        {
            "dtypes": sorted({str(e.ema_local.dtype) for e in ema.engine.plan}),
            "model_dtype": str(next(module.parameters()).dtype),
            "groups": sorted(str(g.source_locals[0].dtype) for g in ema.engine.groups),
            "buffer_dtype": str(module.scale.dtype),
        }
    )
    x = _batch(98, torch.bfloat16)
    raw = gathered(module)
    out["whole_before"] = _whole(module)
    engine.eval()
    with ema.average_parameters(), torch.no_grad():
        y = engine(x)
    out["swap_forward"] = torch.equal(y, _plain(ref.ema, torch.bfloat16)(x))
    out["swap_restored"] = mismatches(gathered(module), raw)
    steps = []
    for step in range(STEPS):
        _train_step(engine, step)
        ema.update()
        ref.update(gathered(module))
        steps.append(_local_mismatches(ema, ref.ema))
    out["steps"] = steps


def _local_mismatches(ema: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose EMA pieces, in the EMA's own dtype, differ in any bit from the matching
    piece of ``expected`` (full tensors): ZeRO-3 entries by their flat range, the others
    gathered. Collective (the gathers)."""
    from torch.distributed.tensor import DTensor

    from dtensor_ema.flat_chunks import FlatChunks

    bad = []
    for name, value in ema.state_dict()["ema"].items():
        if isinstance(value, FlatChunks):
            mine = value.local
            theirs = expected[name].reshape(-1).narrow(0, value.start, mine.numel())
        else:
            mine = value.full_tensor() if isinstance(value, DTensor) else value
            theirs = expected[name]
        if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
            bad.append(name)
    return bad


# --------------------------------------------------------------------------- other engines
def zero_init_first(out: dict[str, Any]) -> None:
    """An EMA built on a model partitioned by ``deepspeed.zero.Init``, before
    ``deepspeed.initialize`` moves every partition into the optimizer's flat buffers: the
    EMA follows them."""
    import deepspeed

    from dtensor_ema import ModelEMA

    config = _config(3)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Net()
    ema = ModelEMA(model, decay=DECAY, tau=None)
    ref = ReferenceEMA(gathered(model), DECAY, None)
    pointers = [p.ds_tensor.data_ptr() for p in model.parameters()]
    engine = _engine(config, model=model)
    moved = pointers != [p.ds_tensor.data_ptr() for p in model.parameters()]
    steps = []
    for step in range(2):
        _train_step(engine, step)
        ema.update()
        ref.update(gathered(model))
        steps.append(mismatches(ema.get_ema_state_dict(), ref.ema))
    out.update(moved=moved, steps=steps)
    # An EMA built on the whole model that deepspeed.initialize then partitions: refused.
    torch.manual_seed(0)
    whole = Net()
    early = ModelEMA(whole, decay=DECAY, tau=None)
    _train_step(_engine(config, model=whole), 0)
    out["partitioned_later"] = _error(early.update)


def hpz(out: dict[str, Any], world_size: int) -> None:
    """ZeRO++ hpZ: a micro-step's backward leaves secondary partitions (copies that every
    gather reads while they exist) until the optimizer step; an evaluation in the middle
    of gradient accumulation must compute with the EMA, and the training after it must
    equal a twin's that never evaluated."""
    from dtensor_ema import ModelEMA

    config = {**_config(3, zero_hpz_partition_size=world_size), "gradient_accumulation_steps": 2}
    engine, twin = _engine(config), _engine(config)
    ema = ModelEMA(engine, decay=DECAY, tau=None)
    ref = ReferenceEMA(gathered(engine.module), DECAY, None)
    steps, secondaries = [], []
    for step in range(STEPS):
        for model in (engine, twin):
            _train_step(model, 2 * step)  # a micro-step: no optimizer step yet
        secondaries.append(
            sum(p.ds_secondary_tensor is not None for p in engine.module.parameters())
        )
        x = _batch(60 + step)
        engine.eval()
        with ema.average_parameters(), torch.no_grad():
            y = engine(x)
        steps.append([] if torch.equal(y, _plain(ref.ema, torch.float32)(x)) else ["forward"])
        for model in (engine, twin):
            _train_step(model, 2 * step + 1)  # the optimizer step
        ema.update()
        ref.update(gathered(engine.module))
        steps.append(mismatches(ema.get_ema_state_dict(), ref.ema))
    out.update(steps=steps, secondaries=secondaries)
    out["twin"] = mismatches(gathered(engine.module), gathered(twin.module))


def zero012(out: dict[str, Any]) -> None:
    """Stages 0-2 keep whole parameters on every rank: ``ModelEMA(engine)`` and
    ``ModelEMA(engine.module)`` give the plain model's keys and the reference's values."""
    from dtensor_ema import ModelEMA

    for stage in (0, 1, 2):
        engine = _engine(_config(stage))
        emas = [
            ModelEMA(engine, decay=DECAY, tau=None),
            ModelEMA(engine.module, decay=DECAY, tau=None),
        ]
        ref = ReferenceEMA(gathered(engine.module), DECAY, None)
        _train_step(engine, 0)
        for ema in emas:
            ema.update()
        ref.update(gathered(engine.module))
        out[stage] = [
            (list(sd), mismatches(sd, ref.ema)) for sd in (e.get_ema_state_dict() for e in emas)
        ]


class _Case(NamedTuple):
    """One EMA on a ZeRO-3 engine. ``update``: ``None`` for ``ema.update()``;
    ``copies_first``: its first update copies the model (torch's ``AveragedModel``,
    ema-pytorch); ``module``: the module its users evaluate and save (drop-ins);
    ``engine``: the ModelEMA whose state is compared with the reference."""

    make: Callable[[Any], Any]
    evaluate: Callable[[Any, Any, torch.Tensor], torch.Tensor]
    update: Callable[[Any, Any, int], None] | None = None
    copies_first: bool = False
    module: Callable[[Any], nn.Module] | None = None
    engine: Callable[[Any], Any] = lambda ema: ema.engine
    decay: float = DECAY


def _dropin_cases() -> dict[str, _Case]:
    """Each drop-in built and evaluated as its library's users do, and ModelEMA's options
    that keep buffers of their own, evaluated with ``average_parameters``."""
    from dtensor_ema import ModelEMA, MultiModelEMA
    from dtensor_ema.compat import ema_pytorch, swa_utils, timm, ultralytics

    def swapped(ema: Any, engine: Any, x: torch.Tensor) -> torch.Tensor:
        engine.eval()
        with ema.average_parameters(), torch.no_grad():
            return engine(x)

    def own_eval(ema: Any, engine: Any, x: torch.Tensor) -> torch.Tensor:
        ema.eval()  # the gather timm's validate(), torch's and ema-pytorch's habits trigger
        with torch.no_grad():
            return ema(x)

    def gathered_then(ema: Any, engine: Any, x: torch.Tensor) -> torch.Tensor:
        ema.gather_for_save()  # ultralytics' ema.ema is a module: gather, then call it
        with torch.no_grad():
            return ema.ema(x)

    options = {"decay": DECAY, "tau": None}
    return {
        "timm": _Case(
            make=lambda e: timm.ModelEmaV3(e, decay=DECAY),
            evaluate=own_eval,
            update=lambda ema, e, step: ema.update(e, step=step + 10),
            module=lambda ema: ema.module,
        ),
        "ultralytics": _Case(
            make=lambda e: ultralytics.ModelEMA(e.module, decay=DECAY, tau=1e-9),
            evaluate=gathered_then,
            update=lambda ema, e, step: ema.update(e.module),
            module=lambda ema: ema.ema,
        ),
        "swa_utils": _Case(
            make=lambda e: swa_utils.AveragedModel(
                e.module, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(DECAY), use_buffers=True
            ),
            evaluate=own_eval,
            update=lambda ema, e, step: ema.update_parameters(e.module),
            copies_first=True,
            module=lambda ema: ema.module,
        ),
        "ema_pytorch": _Case(  # power=1e9: the decay is beta from the second update on
            make=lambda e: ema_pytorch.EMA(  # beta=0.5: its float32 decay is exact
                e.module, beta=0.5, update_after_step=0, update_every=1, power=1e9
            ),
            evaluate=own_eval,
            update=lambda ema, e, step: ema.update(),
            copies_first=True,
            module=lambda ema: ema.ema_model,
            decay=0.5,
        ),
        "offload": _Case(
            make=lambda e: ModelEMA(e, offload=True, **options),
            evaluate=swapped,
            engine=lambda ema: ema,
        ),
        "bucket_view": _Case(
            make=lambda e: ModelEMA(e, parameters_as_bucket_view=True, **options),
            evaluate=swapped,
            engine=lambda ema: ema,
        ),
        "multi": _Case(  # both updated by one call; "fast" checked
            make=lambda e: MultiModelEMA(e, {"slow": {"decay": 0.99}, "fast": options}),
            evaluate=lambda ema, e, x: swapped(ema["fast"], e, x),
            engine=lambda ema: ema["fast"],
        ),
    }


def dropins(out: dict[str, Any]) -> None:
    """The drop-ins and ModelEMA's offload, bucket-view and MultiModelEMA on a ZeRO-3
    engine, one engine each: after ``STEPS`` updates the evaluation output equals a plain
    ``Net`` holding the reference EMA, bit for bit (the drop-ins evaluate a replica: a plain
    copy whose parameters are gathered in their real shapes, DeepSpeed's hooks removed from
    it); the drop-in's full state (what its users save) equals the reference; DeepSpeed's
    engine still trains afterwards and the next update stays exact. ema-pytorch with
    ``ignore_names``: the ignored weight in the replica is the model's current one."""
    from dtensor_ema.compat import ema_pytorch

    for name, case in _dropin_cases().items():
        engine = _engine(_config(3))
        _train_step(engine, 0)
        ema = case.make(engine)
        ref = ReferenceEMA(gathered(engine.module), case.decay, None)
        for step in range(1, STEPS + 2):
            if step == STEPS + 1:  # after the evaluation: DeepSpeed's engine still trains
                x = _batch(99)
                expected = _plain({**gathered(engine.module), **ref.ema}, torch.float32)(x)
                record = {"output": torch.equal(case.evaluate(ema, engine, x), expected)}
                if case.module is not None:  # the state its users save, gathered
                    ema.gather_for_save()
                    record["state"] = mismatches(case.module(ema).state_dict(), ref.ema)
            _train_step(engine, step)
            if case.update is None:
                ema.update()
            else:
                case.update(ema, engine, step)
            if case.copies_first and step == 1:
                ref = ReferenceEMA(gathered(engine.module), case.decay, None)
            else:
                ref.update(gathered(engine.module))
        record["next"] = mismatches(case.engine(ema).get_ema_state_dict(), ref.ema)
        out[name] = record

    engine = _engine(_config(3))
    _train_step(engine, 0)
    ignoring = ema_pytorch.EMA(engine.module, beta=DECAY, ignore_names={"fc.weight"})
    ignoring.update()
    _train_step(engine, 1)
    ignoring.eval()
    out["ignored_is_model"] = torch.equal(
        ignoring.ema_model.fc.weight, gathered(engine.module)["fc.weight"]
    )


def lora(out: dict[str, Any], folder: str) -> None:
    """peft LoRA on a tiny Llama under ZeRO-3, every weight partitioned (threshold 0): the
    EMA of only what trains (``track="trainable"``) equals the reference lerp of the gathered
    adapters at every step and holds ``1/W`` of their elements; the exported PEFT adapter
    holds the reference; DeepSpeed's forward with the EMA swapped in equals a plain peft
    model holding it, and the adapters come back exactly."""
    try:
        from models import peft_lora
    except ImportError:  # pragma: no cover - the test skips without peft
        return
    from dtensor_ema import ModelEMA
    from dtensor_ema.export.peft import export_peft_adapter

    model = peft_lora("llama")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    config = {**_config(3, stage3_param_persistence_threshold=0)}
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    trained = [n for n, p in engine.module.named_parameters() if p.requires_grad]

    def step(i: int) -> None:
        generator = torch.Generator().manual_seed(10 * i + dist.get_rank())
        ids = torch.randint(0, 96, (2, 8), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    step(0)
    ema = ModelEMA(engine, decay=DECAY, tau=None, track="trainable")
    ref = {n: t for n, t in _gathered_all(engine.module).items() if n in trained}
    out["steps"] = []
    for i in range(1, STEPS + 1):
        step(i)
        ema.update()
        now = _gathered_all(engine.module)
        for name, tensor in ref.items():
            tensor.lerp_(now[name], 1 - DECAY)
        out["steps"].append(mismatches(ema.get_ema_state_dict(), ref))
    local = [t.to_local() if isinstance(t, DTensor) else t for t in ema.ema_tensors().values()]
    out["local_numel"] = sum(t.numel() for t in local)
    out["trained"] = (len(ref), sum(t.numel() for t in ref.values()))
    export_peft_adapter(ema, Path(folder))
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        exported = load_file(str(Path(folder) / "adapter_model.safetensors"))
        out["exported"] = mismatches(
            exported, {n.replace(".default.", "."): t for n, t in ref.items()}
        )
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(99))
    plain = peft_lora("llama").eval()
    with torch.no_grad():
        for name, param in plain.named_parameters():
            param.copy_(ref.get(name, now[name]))
        expected = plain(input_ids=ids).logits
        engine.eval()
        before = _gathered_all(engine.module)
        with ema.average_parameters():
            out["forward"] = torch.equal(engine(input_ids=ids).logits, expected)
        out["restored"] = mismatches(_gathered_all(engine.module), before)


def _gathered_all(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 ``module`` in full. Collective."""
    return {name: _gather_partitions(p) for name, p in module.named_parameters()}


def other_layouts(out: dict[str, Any], plan: dict[str, Any]) -> None:
    """The ZeRO-3 checkpoint loaded into an FSDP2 EMA and a DDP EMA of a plain ``Net``; the
    FSDP2 EMA saves its own (which :func:`zero3_fp32` loads back into ZeRO-3)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    sharded = Net()
    fully_shard(sharded.fc)
    fully_shard(sharded)
    fsdp = ModelEMA(sharded, decay=DECAY, tau=None)
    torch.manual_seed(0)
    ddp = ModelEMA(DistributedDataParallel(Net()), decay=DECAY, tau=None)
    for name, ema in (("fsdp", fsdp), ("ddp", ddp)):
        load_checkpoint({"ema": ema}, plan["zero3_ckpt"])
        out[name] = (ema.updates, ema.get_ema_state_dict())
    save_checkpoint({"ema": fsdp}, plan["fsdp_ckpt"])


def ds_body(rank: int, world_size: int, tmp: str, plan: dict[str, Any]) -> dict[str, Any]:
    """One spawn: every engine of this world size, one after another."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # joins the harness's process group
    root = Path(tmp)
    out: dict[str, Any] = {}
    if plan.get("zero3_ckpt"):
        out["others"] = _section(other_layouts, plan)
    out["zero3"] = _section(zero3_fp32, root, plan)
    out["bf16"] = _section(zero3_bf16)
    out["zero_init"] = _section(zero_init_first)
    out["zero012"] = _section(zero012)
    out["dropins"] = _section(dropins)
    if plan.get("hpz"):
        out["hpz"] = _section(hpz, world_size)
    if plan.get("posthoc"):
        out["posthoc"] = _section(posthoc, plan["posthoc"])
    if plan.get("lora"):
        out["lora"] = _section(lora, plan["lora"])
    return out


def _section(fn: Callable[..., None], *args: Any) -> dict[str, Any]:
    """What ``fn(out, *args)`` put in ``out``, with ``"error"`` (the traceback) if it raised:
    a failing engine fails the tests of what it did not record (every rank fails alike:
    DeepSpeed and the EMA keep them in step)."""
    out: dict[str, Any] = {}
    try:
        fn(out, *args)
    except Exception:
        out["error"] = traceback.format_exc()
    return out


def posthoc(out: dict[str, Any], snapshot_dir: str) -> None:
    """``PostHocEMA`` on ZeRO-3: its snapshot holds real shapes and synthesizes back to the
    tracked profile exactly."""
    from dtensor_ema import PostHocEMA

    engine = _engine(_config(3))
    ph = PostHocEMA(engine.module, sigma_rels=(0.05, 0.10), snapshot_dir=snapshot_dir)
    for step in range(2):
        _train_step(engine, step)
        ph.update()
    ph.snapshot()
    out["p0"] = ph.emas["p0"].get_ema_state_dict()


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """W = 3 saves; one process (no process group) loads that and saves again; W = 2 loads
    both (and FSDP2/DDP load the W = 3 one); W = 1 loads W = 2's."""
    from dtensor_ema import ModelEMA, convert_checkpoint, load_checkpoint, save_checkpoint

    tmp = tmp_path_factory.mktemp("deepspeed")
    ckpt = {w: str(tmp / f"zero3_w{w}") for w in (1, 2, 3)}
    single = str(tmp / "single")
    w3 = run_ranks(
        ds_body,
        3,
        tmp,
        str(tmp),
        {"save": ckpt[3], "posthoc": str(tmp / "snaps"), "lora": str(tmp / "lora")},
    )
    torch.manual_seed(0)
    plain = ModelEMA(Net(), decay=DECAY, tau=None)
    try:  # in this process, with no process group
        load_checkpoint({"ema": plain}, ckpt[3])
        one_process: Any = (plain.updates, plain.get_ema_state_dict())
        save_checkpoint({"ema": plain}, single)
        converted: Any = convert_checkpoint(ckpt[3], tmp / "ema_w3.pt")
    except (OSError, ValueError, RuntimeError):
        one_process = converted = traceback.format_exc()
    fsdp = str(tmp / "fsdp")
    w2 = run_ranks(
        ds_body,
        2,
        tmp,
        str(tmp),
        {
            "save": ckpt[2],
            "load": [ckpt[3], single, fsdp],
            "zero3_ckpt": ckpt[3],
            "fsdp_ckpt": fsdp,
            "hpz": True,
        },
    )
    w1 = run_ranks(ds_body, 1, tmp, str(tmp), {"save": ckpt[1], "load": [ckpt[2]]})
    return {
        "tmp": tmp,
        "ckpt": ckpt,
        "single": single,
        "fsdp": fsdp,
        "one_process": one_process,
        "converted": converted,
        1: w1,
        2: w2,
        3: w3,
    }


WORLDS = (1, 2, 3)


class Section(dict):  # type: ignore[type-arg]
    """One section of a rank's result: reading what it did not record fails the test with
    the traceback of what it raised."""

    def __missing__(self, key: Any) -> Any:
        raise AssertionError(f"{key!r} was not recorded; the section raised:\n{self.get('error')}")


def _part(result: dict[str, Any], name: str) -> Section:
    return Section(result[name])


def _zero3(runs: dict[str, Any], world: int) -> list[dict[str, Any]]:
    return [_part(r, "zero3") for r in runs[world]]


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", WORLDS)
def test_every_engine_ran_to_the_end(runs: dict[str, Any], world: int) -> None:
    """No section of any rank raised (the tests below name what each one checks)."""
    for rank, result in enumerate(runs[world]):
        for name, section in result.items():
            assert "error" not in section, f"rank {rank}, {name}:\n{section['error']}"


@pytest.mark.parametrize("world", WORLDS)
def test_zero3_ema_is_bit_exact_at_every_step(runs: dict[str, Any], world: int) -> None:
    """Item 2: the EMA of each rank's partitions equals a plain lerp of the gathered weights
    at every step, built before a forward (persistent parameters partitioned) and after
    (whole). Fails on main: there the EMA of ZeRO-3 parameters is empty (0 bytes, ``(0,)``
    tensors) and the first update after a forward raises "tensors changed"."""
    for result in _zero3(runs, world):
        assert result["whole_at_build"] == []
        assert set(result["whole_after_step"]) == {
            "conv.bias",
            "fc.bias",
            "norm.weight",
            "norm.bias",
            "head.bias",
            "tiny",
        }
        assert result["steps"] == [{"before": [], "after": []}] * STEPS
        assert result["after_swap"] == []


@pytest.mark.parametrize("world", WORLDS)
def test_zero3_ema_holds_one_wth_and_updates_in_place(runs: dict[str, Any], world: int) -> None:
    """Item 2: each rank stores its partition without padding (1/W of the parameters, a
    1/W row split of the buffer), the update reads the partitions in place with no
    collective, in one fused pass (one group: fp32 EMA of fp32 partitions)."""
    sizes = {k: v.numel() for k, v in Net().state_dict().items()}
    totals = []
    for rank, result in enumerate(_zero3(runs, world)):
        expected = 0
        for numel in sizes.values():
            chunk = math.ceil(numel / world)
            expected += max(0, min(numel - rank * chunk, chunk))
        assert result["local_nbytes"] == 4 * expected
        totals.append(result["local_nbytes"])
        assert result["groups"] == 1
        assert result["reads_partitions"]
        assert all(not counts for counts in result["update_collectives"])
    assert sum(totals) == 4 * sum(sizes.values())


@pytest.mark.parametrize("world", WORLDS)
def test_engine_and_module_keys_match_the_plain_model(runs: dict[str, Any], world: int) -> None:
    """Item 1: ``ModelEMA(engine)`` (ZeRO-3) and, on stages 0-2, both ``ModelEMA(engine)``
    and ``ModelEMA(engine.module)`` give the plain model's keys and the reference's values.
    Fails on main: ``ModelEMA(engine)`` keeps DeepSpeed's ``module.`` prefix."""
    keys = list(Net().state_dict())
    for result in runs[world]:
        for stage in (0, 1, 2):
            for got_keys, bad in _part(result, "zero012")[stage]:
                assert got_keys == keys, stage
                assert bad == [], stage
        assert _part(result, "zero3")["ema_keys"] == keys


@pytest.mark.parametrize("world", WORLDS)
def test_bf16_partitions_get_an_fp32_ema(runs: dict[str, Any], world: int) -> None:
    """Item 2: bf16 ZeRO-3 parameters, fp32 EMA by default, one fused pass, bit-exact; an
    evaluation before any training forward works and restores."""
    for result in runs[world]:
        bf16 = _part(result, "bf16")
        assert bf16["model_dtype"] == "torch.bfloat16"
        assert bf16["dtypes"] == ["torch.float32"]
        # one fused pass per source dtype: the bf16 partitions, and the buffer if it is not
        assert bf16["groups"] == sorted({"torch.bfloat16", bf16["buffer_dtype"]})
        assert bf16["whole_before"] == []
        assert bf16["swap_forward"]
        assert bf16["swap_restored"] == []
        assert bf16["steps"] == [[]] * STEPS


@pytest.mark.parametrize("world", WORLDS)
def test_evaluation_swaps_into_the_partitions_and_restores(
    runs: dict[str, Any], world: int
) -> None:
    """Item 3: inside ``average_parameters()`` DeepSpeed's own forward computes with the EMA
    (equal to a plain model loaded with the reference); on exit every partition (padding
    included) and every whole copy DeepSpeed keeps (an evaluation forward leaves every
    parameter whole) holds the raw weights again, and training goes on exactly. Entering
    with whole copies writes the EMA into them too."""
    for result in _zero3(runs, world):
        assert result["swap_inside"] == []
        assert result["swap_forward"]
        assert result["swap_restored"] == []
        assert result["swap_partitions"] == []
        assert len(result["whole_inside"]) == len(Net().state_dict()) - 1  # not the buffer


@pytest.mark.parametrize("world", WORLDS)
def test_full_state_dicts_and_export_in_real_shapes(runs: dict[str, Any], world: int) -> None:
    """Item 3: ``get_model_state_dict``, ``get_ema_state_dict(only_rank0_receives=True)``
    and ``export_ema`` give full tensors of the real shapes that load into the plain model
    (and back into a ZeRO-3 EMA with ``load_full_state_dict``); ``ema.module`` is refused,
    naming what to use."""
    for rank, result in enumerate(_zero3(runs, world)):
        assert result["full_ema"] == []
        assert result["full_model"] == []
        assert result["load_full"] == []
        assert result["rank0_only"] == []
        if rank == 0:
            assert result["export"] == []
            assert "Missing" not in result["export_loads"]
        assert result["module"] is not None
        assert "average_parameters" in result["module"]
        assert result["module"].startswith("NotImplementedError")


def test_partitions_moved_by_deepspeed_initialize_are_followed(runs: dict[str, Any]) -> None:
    """An EMA built inside ``zero.Init``'s partitioning, before ``deepspeed.initialize``
    moved the partitions into the optimizer's buffers, follows them; one built on the whole
    model that ``deepspeed.initialize`` then partitions is refused at the next update."""
    for world in WORLDS:
        for result in runs[world]:
            section = _part(result, "zero_init")
            assert section["moved"]
            assert section["steps"] == [[], []]
            assert "after deepspeed.initialize" in section["partitioned_later"]


def test_hpz_secondary_partitions_never_see_the_ema(runs: dict[str, Any]) -> None:
    """ZeRO++ hpZ: the EMA follows the primary partitions; evaluating it in the middle of
    gradient accumulation drops the secondary ones, so the forward computes with the EMA
    and the training after it equals a twin's that never evaluated."""
    for result in runs[2]:
        hpz = _part(result, "hpz")
        assert all(hpz["secondaries"])  # the case this test is about
        assert hpz["steps"] == [[]] * (2 * STEPS)
        assert hpz["twin"] == []


def test_checkpoint_stores_real_shapes_as_chunks(runs: dict[str, Any]) -> None:
    """Item 4: the W = 3 checkpoint looks like any other: the same keys, real shapes, and
    each partitioned tensor's chunks (a flat range of it is several boxes) cover it exactly
    once (the reader's coverage check accepts them)."""
    from dtensor_ema.checkpoint.reader import open_checkpoint

    metadata = open_checkpoint(Path(runs["ckpt"][3])).metadata.state_dict_metadata
    shapes = {k: tuple(v.shape) for k, v in Net().state_dict().items()}
    saved = {k[len("ema.ema.") :]: v for k, v in metadata.items() if k.startswith("ema.ema.")}
    assert {k: tuple(v.size) for k, v in saved.items()} == shapes
    assert len(saved["conv.weight"].chunks) > 3  # 36 = 12 + 12 + 12 over (4, 3, 3): boxes
    assert all(len(c.sizes) == len(shapes["conv.weight"]) for c in saved["conv.weight"].chunks)


def test_checkpoints_cross_world_sizes_and_layouts_exactly(runs: dict[str, Any]) -> None:
    """Item 4: the ZeRO-3 checkpoint of W = 3 loads bit-exactly into ZeRO-3 at W = 2, into
    FSDP2 and DDP EMAs, into one process without a process group, and converts offline to
    one file; that process's checkpoint and the FSDP2 EMA's load back into ZeRO-3 (W = 2);
    W = 2's into ZeRO-3 at W = 1."""
    saved3 = _part(runs[3][0], "zero3")["saved"]
    updates = STEPS + 1
    assert not isinstance(runs["one_process"], str), runs["one_process"]
    assert runs["one_process"][0] == updates
    assert mismatches(runs["one_process"][1], saved3) == []
    assert mismatches(runs["converted"], saved3) == []  # convert_checkpoint, offline
    for result in runs[2]:
        loads = _part(result, "zero3")["loads"]
        for path in (runs["ckpt"][3], runs["single"], runs["fsdp"]):
            assert loads[path][0] == updates
            assert mismatches(loads[path][1], saved3) == [], path
        for name in ("fsdp", "ddp"):
            assert _part(result, "others")[name][0] == updates, name
            assert mismatches(_part(result, "others")[name][1], saved3) == [], name
    saved2 = _part(runs[2][0], "zero3")["saved"]
    for result in runs[1]:
        count, state = _part(result, "zero3")["loads"][runs["ckpt"][2]]
        assert count == updates
        assert mismatches(state, saved2) == []


def test_posthoc_snapshots_under_zero3(runs: dict[str, Any]) -> None:
    """Item 4: a ``PostHocEMA`` snapshot under ZeRO-3 (W = 3) holds real shapes and
    synthesizes the tracked profile back exactly, in one process."""
    from dtensor_ema import synthesize

    expected = _part(runs[3][0], "posthoc")["p0"]
    got = synthesize(runs["tmp"] / "snaps", 0.05)
    assert mismatches({k: got[k] for k in expected}, expected) == []


@pytest.mark.parametrize("world", WORLDS)
def test_settings_the_ema_cannot_follow_are_refused(runs: dict[str, Any], world: int) -> None:
    """Item 6: NVMe parameter offload and quantized partitions are refused at construction,
    tracked or not, naming the setting and the way out; a mesh that is not DeepSpeed's
    group is refused naming it; a partition that changes after construction is refused at
    the next update with the EMA untouched. Never an EMA of empty tensors."""
    for result in _zero3(runs, world):
        refusals = result["refusals"]
        assert "offload_param.device='nvme'" in refusals["nvme"]
        assert "offload_param.device='nvme'" in refusals["nvme_untracked"]
        assert "zero_quantized_nontrainable_weights" in refusals["quantized"]
        if world > 1:
            assert "ds_process_group" in refusals["mesh"]
        assert "fc.weight" in refusals["repartitioned"]
        assert "partition" in refusals["repartitioned"]
        assert refusals["repartitioned_untouched"] == "[]"


DROPINS = ("timm", "ultralytics", "swa_utils", "ema_pytorch", "offload", "bucket_view", "multi")


@pytest.mark.parametrize("world", WORLDS)
def test_dropins_and_options_evaluate_and_save_the_zero3_ema(
    runs: dict[str, Any], world: int
) -> None:
    """timm, ultralytics, torch swa_utils and ema-pytorch drop-ins on a ZeRO-3 model:
    their evaluation habit gives a plain model's output with the reference EMA, bit for
    bit, and the module they save holds the reference (before the fix their forward ran
    DeepSpeed's gather hooks on the replica's plain tensors and raised AttributeError);
    ModelEMA with offload, bucket view and MultiModelEMA: exact through
    ``average_parameters``. DeepSpeed's engine trains on and the next update is exact."""
    for rank, result in enumerate(runs[world]):
        section = _part(result, "dropins")
        for name in DROPINS:
            record = section[name]
            assert record["output"], f"rank {rank}, {name}: evaluation output differs"
            assert record.get("state", []) == [], f"rank {rank}, {name}: saved state differs"
            assert record["next"] == [], f"rank {rank}, {name}: update after evaluation"
        assert section["ignored_is_model"], f"rank {rank}: ignore_names weight not the model's"


def test_lora_adapters_under_zero3(runs: dict[str, Any]) -> None:
    """peft LoRA on DeepSpeed ZeRO-3 at W = 3, every weight partitioned: the EMA of the
    trained adapters only is exact at every step with ``1/W`` of their elements per rank
    (every element on one rank, padding excluded), the exported PEFT adapter holds the
    reference, and DeepSpeed's forward inside ``average_parameters()`` equals a plain peft
    model with it."""
    pytest.importorskip("peft")
    sections = [_part(result, "lora") for result in runs[3]]
    for rank, section in enumerate(sections):
        assert section["steps"] == [[]] * STEPS, f"rank {rank}"
        assert section["forward"] and section["restored"] == [], f"rank {rank}"
    assert sections[0]["exported"] == []
    tensors, elements = sections[0]["trained"]
    local = [section["local_numel"] for section in sections]
    # each tensor: ceil(n / 3) on the first ranks, the rest on the last (at most 2 fewer)
    assert sum(local) == elements and max(local) - min(local) <= 2 * tensors, (local, elements)
