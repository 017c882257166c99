"""Several ranks on one device: the ``multirank`` section of ``gpu_suite.py``.

**Spawned ranks.** W = 4, then W = 2 processes (``tests/dist_harness.spawn_ranks``; on CUDA
every rank on the one visible GPU, group ``cpu:gloo,cuda:gloo``: NCCL refuses two ranks per
device, gloo copies CUDA tensors through pinned host memory) each build the same small
transformer (tied embeddings, 2 encoder layers) on the device, wrap it as DDP, FSDP2 (1-D,
each block and the root) or HSDP (2 x 2, W=4 only), in fp32 and in bf16 (fp32 EMA), and
train it a few clamped SGD steps (where a probe step of the layout fails, as when the
backend lacks a training collective on the device, seeded in-place perturbations of each
rank's local pieces instead: the row's ``training`` says which). Per case, beside the
model:

* EMAs on the device: ``eager`` (``cuda_graph=False``), ``graph`` (``cuda_graph=True``,
  CUDA only), ``offload`` (the CUDA default updater) and ``offload_chunked`` (the chunked
  pipeline, CUDA only). After every step each is updated and the model's full weights
  (``full_tensor()`` of the sharded objects) are copied to the CPU, where a reference
  written here (``lerp_`` on full tensors, the ramp spelled out) takes the same step. Every
  EMA must equal it bit for bit.
* ``average_parameters()``: the swapped-in weights equal the reference (cast to the model's
  dtype), the forward inside equals a plain model on the device loaded with them, the
  weights come back on exit.
* ``get_model_state_dict()``: the EMA and the model, full, equal the reference and the
  model.
* ``ema.module``: its forward against the same plain model (``build_module``'s promise:
  relative error <= 1e-5, bf16 models <= 1e-2).
* Bytes: every rank's ``local_nbytes()``; the largest over total / W.
* W = 4 saves the eager EMA with ``save_checkpoint`` (and rank 0 the reference, to CPU),
  then with ``save_checkpoint(async_=True)``, updating once more while it writes; W = 2
  loads each W = 4 checkpoint (both saves: staged loads of device shards) into its own DDP
  or FSDP2 model (HSDP's into FSDP2), then a copy with one byte flipped, which must raise
  and leave the EMA as it was; :func:`load_one_process` loads the blocking saves in the
  suite's process with no process group.

The same ranks then run :mod:`gpu_zero3`: the model as DeepSpeed ZeRO-3 partitions (the
attributes DeepSpeed sets, emulated on the device), every update flavour, the swap, the
gathers and a W = 4 save loaded at W = 2 and in one process.

Every operation runs in its own ``try``: a failure is recorded in the row (one that leaves
ranks in a collective costs the group timeout). Rows go to ``rank<r>.jsonl`` as they
finish, so a rank killed by the section's budget keeps what it had done.

**Fake process group** (:func:`fake_world_rows`): this process as rank 0 and rank W - 1 of
W = 8 and 64 (torch's fake group), a model laid out as DDP, FSDP2 and HSDP on the meta
device and materialized on the device: every EMA shard's local shape equals what torch's
``compute_local_shape_and_global_offset`` says for its placements, and after one update it
equals the matching slice of this rank's source tensors, lerped on the device.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from gpu_checks import (
    DECAY,
    DTYPES,
    STEPS,
    TAU,
    attempt,
    differing,
    ema_full,
    failed_load,
    full_cpu,
    load_and_compare,
    ramp,
    save_in_background,
    verdict,
    with_chunked,
)
from torch import nn

LAYOUTS = {4: ("ddp", "fsdp2", "hsdp"), 2: ("ddp", "fsdp2")}
"""Layouts per spawned world size; W = 4 runs first and saves, W = 2 loads."""
LOAD_INTO = {"ddp": "ddp", "fsdp2": "fsdp2", "hsdp": "fsdp2"}
"""At W = 2, the layout each W = 4 checkpoint is loaded into."""


# --------------------------------------------------------------------------- helpers
def rank_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------- one case
def _mesh(layout: str, device_type: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hsdp":
        return init_device_mesh(device_type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,))


def build(layout: str, dtype: torch.dtype, device: torch.device, world: int) -> nn.Module:
    """The seeded test transformer on ``device`` in ``dtype``, wrapped as ``layout``."""
    from models import make_model
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = make_model("transformer").to(device=device, dtype=dtype)
    if layout == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    mesh = _mesh(layout, device.type, world)
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, device: torch.device
) -> None:
    from models import clamp_grads_, make_batch

    tokens, target = make_batch("transformer", step)
    assert target is not None
    logits = model(tokens.to(device))
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.to(device).flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    clamp_grads_(model)
    opt.step()


@torch.no_grad()
def perturb_step(model: nn.Module, step: int) -> None:
    """A training step without collectives: the same seeded noise on the full weights of
    every rank, each adding its own local piece (for a layout whose training collectives the
    backend lacks on this device)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    g = torch.Generator().manual_seed(1000 + step)
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        noise = torch.randn(p.shape, generator=g) * 0.01
        local = p.to_local() if isinstance(p, DTensor) else p.data
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            noise = noise[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        local.add_(noise.to(device=local.device, dtype=local.dtype))


def probe_training(layout: str, device: torch.device, world: int) -> str:
    """``"sgd"`` if one training step of ``layout`` runs here, else ``"perturb"`` and why
    (an unsupported collective raises alike on every rank, before any data moves)."""
    try:
        model = build(layout, torch.float32, device, world)
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.05), 0, device)
    except Exception as err:
        return f"perturb ({type(err).__name__}: {str(err)[:200]})"
    return "sgd"


@torch.no_grad()
def forward(model: nn.Module, device: torch.device) -> torch.Tensor:
    from models import make_batch

    was_training = model.training
    model.eval()
    out = model(make_batch("transformer", 99)[0].to(device)).detach().float().cpu()
    model.train(was_training)
    return out


def forward_ok(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    rel = relative_diff(got, want)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    return {"exact": rel == 0.0, "rel": rel, "ok": rel <= bound}


def plain_model(
    state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """An unsharded model on ``device`` holding ``state`` (full tensors)."""
    from models import make_model

    model = make_model("transformer").to(device=device, dtype=dtype)
    model.load_state_dict({k: v.to(device) for k, v in state.items()})
    return model


def run_case(
    layout: str,
    dt: str,
    rank: int,
    world: int,
    device: torch.device,
    save_dir: Path | None,
    training: str = "sgd",
) -> dict[str, Any]:
    """One (layout, dtype) case on this rank; see the module docstring. ``training``:
    :func:`probe_training`'s answer for the layout."""
    from dtensor_ema import ModelEMA, save_checkpoint

    dtype = DTYPES[dt]
    cuda = device.type == "cuda"
    start = time.perf_counter()
    row: dict[str, Any] = {"world": world, "layout": layout, "dtype": dt, "device": device.type}
    row["training"] = training
    model = build(layout, dtype, device, world)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opts: dict[str, Any] = {"decay": DECAY, "tau": TAU}
    emas: dict[str, Any] = {"eager": ModelEMA(model, cuda_graph=False, **opts)}
    if cuda:
        made = attempt(row, "graph_built", lambda: ModelEMA(model, cuda_graph=True, **opts))
        if not isinstance(made, str):
            emas["graph"] = made
            row["graph_built"] = True
    else:
        row["update_graph"] = "skipped: no CUDA"
    made = attempt(row, "offload_built", lambda: ModelEMA(model, offload=True, **opts))
    if not isinstance(made, str):
        emas["offload"] = made
        row["offload_built"] = type(made.engine.updater).__name__
    if cuda:
        built = attempt(
            row,
            "offload_chunked_built",
            lambda: with_chunked(ModelEMA(model, offload=True, **opts)),
        )
        if not isinstance(built, str):
            emas["offload_chunked"] = built
            row["offload_chunked_built"] = True
    else:
        row["update_offload_chunked"] = "skipped: no CUDA"

    sharded = dict(inner.state_dict(keep_vars=True))
    owners: dict[int, str] = {}
    alias = {k: owners.setdefault(id(v), k) for k, v in sharded.items()}
    alias = {k: owner for k, owner in alias.items() if k != owner}

    def snapshot() -> dict[str, torch.Tensor]:
        return {k: full_cpu(v) for k, v in sharded.items() if k not in alias}

    ref = {
        k: v.to(torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype)
        for k, v in snapshot().items()
        if v.is_floating_point()
    }
    failed: dict[str, Any] = {}  # an EMA whose update raised is not updated again
    for step in range(1, STEPS + 1):
        if training == "sgd":
            train_step(model, opt, step, device)
        else:
            perturb_step(model, step)
        for name, ema in emas.items():
            if name not in failed:
                error = attempt(failed, name, ema.update)
                if error is None:
                    del failed[name]
        weights = snapshot()
        for k, v in ref.items():
            v.lerp_(weights[k].to(v.dtype), 1 - ramp(step))
    row["reference_finite"] = all(bool(torch.isfinite(v).all()) for v in ref.values())
    for name, ema in emas.items():
        if name in failed:
            row[f"update_{name}"] = failed[name]
            row.setdefault("tracebacks", {}).update(failed.get("tracebacks", {}))
            continue
        attempt(row, f"update_{name}", lambda ema=ema: verdict(differing(ema_full(ema), ref)))
    if "graph" in emas:
        graph = emas["graph"].engine.graph
        row["graph_uses"] = emas["graph"].cuda_graph.use
        row["graph_reason"] = emas["graph"].cuda_graph.reason[:120]
        row["graph_captures"] = None if graph is None else graph.captures
        row["graph_first_call_ms"] = (
            None
            if graph is None or graph.capture_seconds is None
            else round(graph.capture_seconds * 1e3, 2)
        )
    for name in ("offload", "offload_chunked"):
        if name in emas:
            emas[name].close()

    eager = emas["eager"]
    # What the model holds, in its dtypes, the tied alias carrying its owner's EMA.
    model_sd = snapshot()
    expected = {
        k: ref[alias.get(k, k)].to(v.dtype) if v.is_floating_point() else v
        for k, v in {**model_sd, **{a: model_sd[o] for a, o in alias.items()}}.items()
    }
    plain = plain_model(expected, dtype, device)
    want = forward(plain, device)

    def swap() -> dict[str, Any]:
        before = snapshot()
        with eager.average_parameters() as swapped:
            inside = snapshot()
            logits = forward(swapped, device)
        after = snapshot()
        return {
            "weights": verdict(differing(inside, {k: expected[k] for k in inside})),
            "restored": verdict(differing(after, before)),
            "forward": forward_ok(logits, want, dtype),
        }

    attempt(row, "swap", swap)

    def materialize() -> dict[str, Any]:
        ema_sd, ori_sd = eager.get_model_state_dict()
        ema_sd = {k: v.cpu() for k, v in ema_sd.items()}
        ori_sd = {k: v.cpu() for k, v in ori_sd.items()}
        current = snapshot()
        current.update({a: current[o] for a, o in alias.items()})
        return {
            "ema_sd": verdict(differing(ema_sd, expected)),
            "model_sd": verdict(differing(ori_sd, current)),
        }

    attempt(row, "materialize", materialize)
    local = eager.local_nbytes()
    total = sum(v.numel() * v.element_size() for v in ref.values())
    row["ema_bytes_rank"] = local
    row["ema_bytes_total"] = total
    if save_dir is not None:
        path = save_dir / f"{layout}_{dt}"

        def save() -> str:
            save_checkpoint({"ema": eager}, path)
            if rank == 0:
                torch.save(
                    {"ref": ref, "updates": eager.updates}, save_dir / f"{layout}_{dt}.ref.pt"
                )
            return "ok"

        attempt(row, "dcp_save", save)
    attempt(row, "module_forward", lambda: forward_ok(forward(eager.module, device), want, dtype))
    if save_dir is not None:  # last: it updates the EMA once more
        attempt(row, "dcp_save_async", lambda: save_in_background(eager, path))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def load_case(
    layout: str, dt: str, world: int, device: torch.device, save_dir: Path
) -> dict[str, Any]:
    """Load the W = 4 checkpoint of ``(layout, dt)`` into this world's model (DCP reshards)."""
    from dtensor_ema import ModelEMA

    into = LOAD_INTO[layout]
    row: dict[str, Any] = {"world": world, "layout": f"load {layout} W=4 -> {into}", "dtype": dt}
    model = build(into, DTYPES[dt], device, world)
    ema = ModelEMA(model, decay=DECAY, tau=TAU, cuda_graph=False)

    name = f"{layout}_{dt}"
    attempt(row, "dcp_load", lambda: load_and_compare(ema, save_dir, name))
    if Path(save_dir / f"{name}_async").exists():
        attempt(row, "dcp_load_async", lambda: load_and_compare(ema, save_dir, name, "_async"))
    attempt(row, "failed_load_unchanged", lambda: failed_load(row, ema, save_dir, name, world))
    return row


def rank_body(
    rank: int, world: int, device_type: str, out_dir: str, ckpt_dir: str
) -> list[dict[str, Any]]:
    """Every case of this world size on this rank (W = 4: save to ``ckpt_dir``; W = 2: load
    W = 4's); rows also go to ``out_dir/rank<r>.jsonl`` as they finish."""
    import gpu_zero3

    device = rank_device(device_type)
    save_dir = Path(ckpt_dir)
    rows: list[dict[str, Any]] = []
    log = Path(out_dir) / f"rank{rank}.jsonl"

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        with log.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    for layout in LAYOUTS[world]:
        training = probe_training(layout, device, world)
        for dt in DTYPES:
            try:
                saves = save_dir if world == 4 else None
                keep(run_case(layout, dt, rank, world, device, saves, training))
            except Exception as err:
                keep(_failed(world, layout, dt, err))
    for dt in DTYPES:  # DeepSpeed ZeRO-3 partitions (emulated attributes): gpu_zero3.py
        try:
            keep(gpu_zero3.run_case(dt, rank, world, device, save_dir if world == 4 else None))
        except Exception as err:
            keep(_failed(world, gpu_zero3.LAYOUT, dt, err))
    if world == 2:
        for dt in DTYPES:
            if (save_dir / f"zero3_{dt}.ref.pt").exists():
                try:
                    keep(gpu_zero3.load_case(dt, world, device, save_dir))
                except Exception as err:
                    keep(_failed(world, f"load {gpu_zero3.LAYOUT}", dt, err))
        for layout in LAYOUTS[4]:
            for dt in DTYPES:
                if (save_dir / f"{layout}_{dt}.ref.pt").exists():
                    try:
                        keep(load_case(layout, dt, world, device, save_dir))
                    except Exception as err:
                        keep(_failed(world, f"load {layout}", dt, err))
    dist.barrier()
    return rows


def _failed(world: int, layout: str, dt: str, err: Exception) -> dict[str, Any]:
    return {
        "world": world,
        "layout": layout,
        "dtype": dt,
        "error": f"{type(err).__name__}: {str(err)[:300]}",
        "tracebacks": {"case": traceback.format_exc()[-1500:]},
    }


# --------------------------------------------------------------------------- fake worlds
def fake_world_rows(
    model_name: str, worlds: list[int], device: torch.device, time_left: Callable[[], float]
) -> list[dict[str, Any]]:
    """Per-rank shapes and one update at fake W (rank 0 and rank W - 1), every layout."""
    rows = []
    for world in worlds:
        for layout in ("ddp", "fsdp2", "hsdp"):
            for rank in sorted({0, world - 1}):
                row: dict[str, Any] = {"world": world, "layout": layout, "rank": rank}
                if time_left() < 5:
                    row["error"] = "skipped: out of the section's time budget"
                    rows.append(row)
                    continue
                attempt(
                    row,
                    "check",
                    lambda w=world, lay=layout, r=rank: _fake_case(model_name, w, lay, r, device),
                )
                check = row.pop("check")
                if isinstance(check, dict):
                    row.update(check)
                else:
                    row["error"] = check
                rows.append(row)
    return rows


def _fake_case(
    model_name: str, world: int, layout: str, rank: int, device: torch.device
) -> dict[str, Any]:
    from shapes import fake_world, lay_out, materialize, meta_model
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from dtensor_ema import ModelEMA

    start = time.perf_counter()
    with fake_world(world, rank=rank):
        model, mesh = lay_out(meta_model(model_name), layout, device.type, tag=f"_w{world}r{rank}")
        model = materialize(model, device)
        ema = ModelEMA(model, mesh=mesh, decay=DECAY, tau=None, cuda_graph=False)
        sources = dict(model.state_dict(keep_vars=True))
        before = {k: _local(v).detach().clone() for k, v in sources.items()}
        with torch.no_grad():
            for v in sources.values():
                local = _local(v)
                if local.is_floating_point():
                    local.mul_(0.5).add_(0.25)
        ema.update()
        bad_shape, bad_value, local_bytes, total_bytes = [], [], 0, 0
        for fqn, e in ema.ema_tensors().items():
            src = sources[fqn]
            total_bytes += e.numel() * e.element_size()
            local = _local(e)
            local_bytes += local.numel() * local.element_size()
            if not isinstance(e, DTensor):
                continue
            shape, offset = compute_local_shape_and_global_offset(
                e.shape, e.device_mesh, e.placements
            )
            if tuple(local.shape) != tuple(shape):
                bad_shape.append(f"{fqn}: {tuple(local.shape)} != {tuple(shape)}")
                continue
            if local.numel() == 0:
                continue
            src_offset = (0,) * src.dim()
            if isinstance(src, DTensor):
                _, src_offset = compute_local_shape_and_global_offset(
                    src.shape, src.device_mesh, src.placements
                )
            region = tuple(
                slice(o - so, o - so + n)
                for o, so, n in zip(offset, src_offset, shape, strict=True)
            )
            old, new = before[fqn][region], _local(src).detach()[region]
            want = old.to(local.dtype).lerp_(new.to(local.dtype), 1 - DECAY)
            if not torch.equal(local, want):
                bad_value.append(fqn)
        out = {
            "model": model_name,
            "ema_tensors": len(ema.ema_tensors()),
            "local_shapes": verdict(bad_shape),
            "local_values_after_update": verdict(bad_value),
            "bytes_over_total_per_W": round(local_bytes / (total_bytes / world), 4),
            "seconds": round(time.perf_counter() - start, 2),
        }
        del model, ema, sources, before
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def read_rows(out_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = out_dir / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ranks_env() -> dict[str, str]:
    """Environment of the spawned ranks: the repository and tests importable."""
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent), str(here.parent / "tests")]
    return {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
