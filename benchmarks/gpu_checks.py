"""What the GPU suite's multi-rank sections share: the reference, the comparisons, the loads.

:mod:`gpu_ranks` (DDP, FSDP2, HSDP) and :mod:`gpu_zero3` (DeepSpeed ZeRO-3 partitions) both
import this module; neither imports the other's helpers.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DECAY, TAU, STEPS = 0.9, 2.0, 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def attempt(row: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``row[key] = fn()``; an exception is recorded as ``"error: ..."`` instead."""
    try:
        row[key] = fn()
    except Exception as err:
        row[key] = f"error: {type(err).__name__}: {str(err)[:300]}"
        row.setdefault("tracebacks", {})[key] = traceback.format_exc()[-1500:]
    return row[key]


def full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A full CPU copy (a collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True)


def differing(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit, dtype or shape (missing keys included)."""
    keys = sorted(set(actual) | set(expected))
    return [
        k
        for k in keys
        if k not in actual
        or k not in expected
        or actual[k].dtype != expected[k].dtype
        or actual[k].shape != expected[k].shape
        or not torch.equal(actual[k].cpu(), expected[k].cpu())
    ]


def verdict(bad: list[str]) -> str | list[str]:
    return "exact" if not bad else bad[:8]


def ramp(updates: int) -> float:
    """The reference decay, written here: ``DECAY * (1 - exp(-updates / TAU))``."""
    return DECAY * (1 - math.exp(-updates / TAU))


def with_chunked(ema: Any) -> Any:
    """The same EMA, updated through the chunked offload pipeline (the CUDA candidate)."""
    from dtensor_ema.update.updater import ChunkedOffloadUpdater

    ema.engine.use_updater(ChunkedOffloadUpdater(ema.engine.groups))
    return ema


def save_in_background(ema: Any, path: Path) -> str:
    """``save_checkpoint(async_=True)`` of ``ema`` to ``<path>_async``, then one more
    ``update()`` while the write runs: the checkpoint must hold the state at the call, the
    one the blocking save wrote to ``path`` (the W = 2 loads check both against the same
    reference). Collective."""
    from dtensor_ema import save_checkpoint

    future = save_checkpoint({"ema": ema}, Path(f"{path}_async"), async_=True)
    ema.update()
    future.result()
    return "ok"


def ema_full(ema: Any) -> dict[str, torch.Tensor]:
    return {k: full_cpu(v) for k, v in ema.ema_tensors().items()}


def load_one_process(layout: str, dt: str, device: torch.device, save_dir: Path) -> dict[str, Any]:
    """Load a W = 4 checkpoint in this process, with no process group, onto ``device``."""
    from models import make_model

    from dtensor_ema import ModelEMA

    row: dict[str, Any] = {"world": 1, "layout": f"load {layout} W=4 -> one process", "dtype": dt}

    def load() -> Any:
        model = make_model("transformer").to(device=device, dtype=DTYPES[dt])
        ema = ModelEMA(model, decay=DECAY, tau=TAU, cuda_graph=False)
        return load_and_compare(ema, save_dir, f"{layout}_{dt}")

    attempt(row, "dcp_load", load)
    return row


def load_and_compare(
    ema: Any,
    save_dir: Path,
    name: str,
    suffix: str = "",
    full: Callable[[Any], dict[str, torch.Tensor]] | None = None,
) -> Any:
    """Load checkpoint ``save_dir/<name><suffix>`` into ``ema`` (collective over its mesh)
    and compare its full tensors (``full(ema)``, default :func:`ema_full`) and counter with
    the reference saved beside the blocking save (``name.ref.pt``)."""
    from dtensor_ema import load_checkpoint

    saved = torch.load(save_dir / f"{name}.ref.pt", weights_only=True)
    load_checkpoint({"ema": ema}, save_dir / f"{name}{suffix}")
    bad = differing((full or ema_full)(ema), saved["ref"])
    if ema.updates != saved["updates"]:
        bad.append(f"updates {ema.updates} != {saved['updates']}")
    return verdict(bad)


def failed_load(
    row: dict[str, Any],
    ema: Any,
    save_dir: Path,
    name: str,
    world: int,
    full: Callable[[Any], dict[str, torch.Tensor]] | None = None,
) -> Any:
    """A load of a copy of ``save_dir/name`` with one byte flipped in the middle of its
    largest data file (rank 0 writes the copy) must raise on every rank and leave ``ema``
    exactly as it was: the staged load's promise, with the EMA on the device. What it raised
    goes to ``row["failed_load_raised"]``. Collective."""
    import shutil

    from dtensor_ema import load_checkpoint

    broken = save_dir / f"{name}_broken_w{world}"
    if dist.get_rank() == 0:
        shutil.copytree(save_dir / name, broken)
        largest = max(broken.glob("*.distcp"), key=lambda f: f.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        largest.write_bytes(bytes(data))
    dist.barrier()
    before = (full or ema_full)(ema)
    count = ema.updates
    try:
        load_checkpoint({"ema": ema}, broken)
    except Exception as err:
        row["failed_load_raised"] = f"{type(err).__name__}: {str(err)[:160]}"
    else:
        return ["the load of a corrupted checkpoint did not raise"]
    bad = differing((full or ema_full)(ema), before)
    if ema.updates != count:
        bad.append(f"updates {ema.updates} != {count}")
    return verdict(bad)
