"""Every CUDA path in one command, in at most 8 minutes on one GPU.

    PYTHONPATH=. python benchmarks/gpu_suite.py --out gpu_suite_out   # one GPU, the preset
    python benchmarks/gpu_suite.py --device cpu --out out               # what runs on CPU
    python benchmarks/gpu_suite.py --sections speed:300,offload:90 --out out

Runs on the GPU machine's own torch (2.11 and later) with nothing installed; only the
``speed`` section's baselines use timm and torchvision (a missing one is reported).

Sections (each in its own ``try``: a failure is recorded in the report, the rest still run).
``--sections name[:seconds],...`` picks them and gives each a time budget (besides the
overall ``--budget-s``); the default is :data:`PRESET`. A section that runs out (or a
SIGTERM) is stopped, and the rows it had finished are written with it. The report ends
with one summary line per section (its exactness checks counted) and the ``defaults:``
lines: whether this run allows flipping ``cuda_graph=None`` to replay and ``offload=True``
on CUDA to the chunked pipeline (:func:`verdict`).

1. ``cuda_graph`` (CUDA only): a ``capturable=True`` update captured by hand; the library's
   opt-in replay (``cuda_graph=True``) against eager and a ``lerp_`` reference over 12
   calls, re-captured after a re-allocated parameter, ``build_module`` and a load, fp32 and
   bf16 models (fp32 EMA), with the first call's cost and what ``cuda_graph=None`` decides;
   and FSDP2 parameters (a one-rank NCCL group) over training steps.
2. ``offload``: GPT-2 small training-step time with no EMA, on-device EMAs (eager; graph on
   CUDA) and ``offload=True`` through both updaters (the CUDA default, and the chunked
   pipeline on CUDA); every EMA equal to the device EMA over ``--offload-steps`` (20)
   steps; host and device bytes; issue 20's target (max(2 ms, 5% of the step)).
3. ``multirank``: W = 4 and W = 2 processes sharing the device (``gpu_ranks.py``; on CUDA
   over gloo, ``cpu:gloo,cuda:gloo``): DDP, FSDP2 and HSDP 2x2 models with their EMAs on
   the device, update (eager, graph, both offload updaters), swap, materialize,
   ``ema.module`` forward, DCP saved at W = 4 and loaded at W = 2 and in this process, all
   against a CPU reference of the same steps; per-rank shapes at fake W = 8 and 64.
4. ``speed``: per-rank update time of ResNet-50, GPT-2 and Llama-3-8B-shaped blocks at
   ``--worlds`` (fake process group, FSDP2 layout, this rank's real local tensors on the
   device), fp32 and bf16->fp32: ours (eager; the opt-in CUDA graph with its first-call
   capture cost; compiled where asked: ``--speed-variants``), a torchtitan-style
   ``_foreach_lerp_`` on DTensor clones, ``copy_`` of the same bytes, and timm
   ``ModelEmaV3`` on a full replica (without ``dtype=`` in the installed timm, its EMA is
   cast to float32 by hand).
5. ``float8`` (skipped with a note without torchao, or below SM89): torchao float8 training
   with ``enable_fsdp_float8_all_gather=True`` and ``precompute_float8_dynamic_scale_for_fsdp``
   under FSDP2 on a one-rank group (NCCL on CUDA), the float8 matmuls on the device: eager
   (and graphed, on CUDA) EMAs against a ``lerp_`` reference every step, the swap's weights
   and forward against an unsharded float8 model, the weights restored.
6. ``host``: the host time of one ``update()`` at 161 and 1000 fp32 tensors, eager and
   (CUDA only) with graph replay, beside one bare ``_foreach_lerp_`` on the same tensors
   (``host_overhead.py``'s code).
7. ``tests``: the test modules whose bodies follow the backend (:data:`TESTS_CUDA`) with
   ``DTENSOR_EMA_TEST_BACKEND=gloo-cuda`` (W = 1-4 ranks on the one GPU).
8. ``kernels`` (not in the preset): eager vs compiled vs a reference written here for fp32,
   bf16->fp32, fp16->fp32, mixed groups, channels_last, capturable, multi-EMA.

Writes ``gpu_suite.md`` and ``gpu_suite.json`` under ``--out`` (after every section).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]

DECAY = 0.9999
BYTES_PER_VALUE = {"fp32": 12, "bf16": 10}
"""Ideal single pass: read source + read EMA + write EMA (fp32 EMA)."""


# --------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleave(
    impls: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int,
    reps: int,
    clock: str = "wall",
) -> dict[str, float]:
    """Median seconds per call of each implementation, taking turns every repeat.

    ``clock="cpu"``: this thread's CPU time (with one torch thread, the work itself; on a
    shared CPU it leaves out the time other processes hold the core).
    """
    timer = time.thread_time if clock == "cpu" else time.perf_counter
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {n: [] for n in impls}
    names = list(impls)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            _sync(device)
            start = timer()
            impls[name]()
            _sync(device)
            samples[name].append(timer() - start)
    return {n: statistics.median(s) for n, s in samples.items()}


def compile_seconds(ema: Any) -> float | None:
    """Sum of first-call compile times of an EMA's compiled kernels (None if none)."""
    from dtensor_ema.update.compiled_lerp import CompiledLerp

    seconds = [
        v[1].compile_seconds
        for g in ema.engine.groups
        for v in g._cache.values()
        if isinstance(v[1], CompiledLerp) and v[1].compile_seconds is not None
    ]
    return sum(seconds) if seconds else None


def full(ema: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in ema.ema_tensors().items()
    }


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])
    ]


# --------------------------------------------------------------------------- sections
TESTS_CUDA = ("tests/test_fsdp_distributed.py", "tests/test_posthoc_single.py")
"""Test modules the ``tests`` section runs on CUDA: those whose bodies follow
``dist_harness.DEVICE_TYPE`` (FSDP2/HSDP at W = 1-4 with hostile orderings) plus the
single-process CUDA checks; the others build their meshes on CPU, which CI runs."""


def section_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The distributed test bodies on the device in a subprocess: on CUDA with every rank on
    the one GPU (``DTENSOR_EMA_TEST_BACKEND=gloo-cuda``), W = 1-4."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if args.device == "cuda":
        env["DTENSOR_EMA_TEST_BACKEND"] = "gloo-cuda"
        files, marker = list(args.tests_files or TESTS_CUDA), "distributed or cuda"
    else:
        env["DTENSOR_EMA_TEST_BACKEND"] = "gloo"
        files, marker = list(args.tests_files or ("tests/test_kernels.py",)), "not slow"
    files = [f for f in files if (ROOT / f).exists()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", marker, "-p", "no:cacheprovider"]
    cmd += files
    start = time.perf_counter()
    timeout = max(10.0, args.time_left() - 3)
    result: dict[str, Any] = {
        "command": " ".join(cmd),
        "backend": env["DTENSOR_EMA_TEST_BACKEND"],
        "timeout_s": round(timeout, 1),
    }
    args.progress.update(result)
    # Its own session, so a timeout (or this section's alarm) ends pytest and its ranks.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        output, _ = proc.communicate()
        result["timed_out"] = True
    except BaseException:
        _kill_session(proc)
        raise
    (args.out / "tests_output.txt").write_text(output)
    # pytest's last line: "3 passed, 1 skipped in 9.1s" (-q), or the same between "=" rules.
    summary = re.findall(
        r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected|warnings?)\b.*?)\s*=*$",
        output,
        re.M,
    )
    result.update(
        {
            "returncode": proc.returncode,
            "summary": summary[-1] if summary else "(no summary)",
            "seconds": round(time.perf_counter() - start, 1),
            "tail": output[-4000:] if proc.returncode else "",
        }
    )
    return result


def _kill_session(proc: subprocess.Popen[str]) -> None:
    import signal as _signal

    try:
        os.killpg(proc.pid, _signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def section_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Compiled and eager kernels against a reference written here, on the device."""
    from models import make_model

    from dtensor_ema import ModelEMA, MultiModelEMA

    device = torch.device(args.device)
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    cases = ("fp32", "bf16") if args.quick else ("fp32", "bf16", "mixed")
    for case in cases:
        model = make_model("edge")
        if case in ("bf16", "fp16"):
            model = model.to(torch.bfloat16 if case == "bf16" else torch.float16)
        if case == "mixed":  # fp32, bf16 and fp16 groups; a channels_last fp16 conv
            model.odd.data = model.odd.data.to(torch.bfloat16)
            model.conv.to(torch.float16, memory_format=torch.channels_last)
        model = model.to(device)
        kinds = {
            "eager": ModelEMA(model, decay=0.9, tau=2, kernel="eager", cuda_graph=False),
            "compiled": ModelEMA(model, decay=0.9, tau=2, kernel="compiled"),
            "capturable_compiled": ModelEMA(
                model, decay=0.9, tau=2, kernel="compiled", capturable=True
            ),
        }
        multi = MultiModelEMA(
            model,
            {"a": {"decay": 0.5, "tau": None}, "b": {"decay": 0.9, "tau": 2}},
            kernel="compiled",
        )
        ref = {
            k: v.detach()
            .to(torch.float64 if v.dtype == torch.float64 else torch.float32)
            .clone()
            .contiguous()
            for k, v in model.state_dict().items()
            if v.is_floating_point() and v.numel()
        }
        ref_a = {k: v.clone() for k, v in ref.items()}
        for step in range(4):
            _perturb(model, step)
            for ema in kinds.values():
                ema.update()
            multi.update()
            d = 0.9 * (1 - __import__("math").exp(-(step + 1) / 2))
            state = model.state_dict()
            for k, v in ref.items():
                v.lerp_(state[k].detach().to(v.dtype), 1 - d)
                ref_a[k].lerp_(state[k].detach().to(v.dtype), 0.5)
        row: dict[str, Any] = {"case": case}
        for name, ema in kinds.items():
            got = {k: v for k, v in full(ema).items() if v.numel()}
            row[name] = differing(got, ref) or "exact"
        got_b = {k: v for k, v in full(multi["b"]).items() if v.numel()}
        got_a = {k: v for k, v in full(multi["a"]).items() if v.numel()}
        row["multi"] = (differing(got_a, ref_a) + differing(got_b, ref)) or "exact"
        row["compile_s"] = compile_seconds(kinds["compiled"])
        rows.append(row)
    return {"rows": rows}


def _perturb(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) * 0.01)


def section_offload(args: argparse.Namespace) -> dict[str, Any]:
    """GPT-2 step time with no EMA, on-device EMAs and both offload updaters; exactness."""
    from gpu_checks import with_chunked
    from workloads import GPT

    from dtensor_ema import ModelEMA

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = (
        {"vocab": 50257, "ctx": 1024, "dim": 768, "heads": 12, "layers": 12}
        if cuda
        else {"vocab": 1000, "ctx": 64, "dim": 128, "heads": 4, "layers": 2}
    )
    batch, seq = (8, 1024) if cuda else (2, 64)
    torch.manual_seed(0)
    model = GPT(**shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(0, shape["vocab"], (batch, seq + 1), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step() -> None:
        with autocast:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    emas: dict[str, Any] = {
        "device_eager": ModelEMA(model, decay=DECAY, kernel="eager", cuda_graph=False),
        # offload=True as shipped: on CUDA the updater last proven on a GPU (CUDA_OFFLOAD).
        "offload": ModelEMA(model, decay=DECAY, offload=True),
    }
    not_run: dict[str, str] = {}
    if cuda:
        emas["device_graph"] = ModelEMA(model, decay=DECAY, cuda_graph=True)
        emas["offload_chunked"] = with_chunked(ModelEMA(model, decay=DECAY, offload=True))
    else:  # the CUDA-only rows
        not_run = {n: "skipped: no CUDA" for n in ("device_graph", "offload_chunked")}
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    out: dict[str, Any] = {
        "model": f"GPT {shape}, batch {batch} x {seq}, bf16 autocast",
        "params": sum(p.numel() for p in model.parameters()),
        "offload_updater": type(emas["offload"].engine.updater).__name__,
        "not_run": not_run,
        "rows": rows,
    }
    args.progress.update(out)
    # Same trajectory, >= 20 steps: every EMA restarts from the model and sees the same steps.
    for ema in emas.values():
        ema.set()
    for _ in range(args.offload_steps):
        step()
        for ema in emas.values():
            ema.update()
    expected = {k: v.cpu() for k, v in full(emas["device_eager"]).items()}
    for name, ema in emas.items():
        if name != "device_eager":
            out[f"{name}_differs"] = (
                differing({k: v.cpu() for k, v in full(ema).items()}, expected) or "exact"
            )
    out["exact_steps"] = args.offload_steps
    args.progress.update(out)
    # Bytes: host (the EMA shards; the worker's staging copy), device (chunked scratch),
    # and the device peak of one update above what the step left allocated.
    for name, ema in emas.items():
        updater = ema.engine.updater
        entry: dict[str, Any] = {"ema_bytes": ema.local_nbytes()}
        entry["ema_on"] = next(iter(ema.ema_tensors().values())).device.type
        entry.update({k: v for k, v in updater.buffer_nbytes().items() if v})
        if cuda:
            step()
            ema.flush()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ema.update()
            ema.flush()
            torch.cuda.synchronize()
            entry["update_peak_device_bytes"] = torch.cuda.max_memory_allocated() - base
        out.setdefault("bytes", {})[name] = entry
    args.progress.update(out)
    impls: dict[str, Callable[[], object]] = {"no_ema": step}
    for name, ema in emas.items():
        impls[name] = lambda ema=ema: (step(), ema.update())
    times = interleave(impls, device, warmup=2, reps=20 if cuda else 5)
    for ema in emas.values():
        ema.flush()
    base = times["no_ema"]
    rows += [
        {
            "variant": n,
            "step_ms": round(t * 1e3, 3),
            "overhead_ms": round((t - base) * 1e3, 3),
            "overhead_pct": round(100 * (t - base) / base, 2),
        }
        for n, t in times.items()
    ]
    # Issue 20's target: at most 2 ms per step or 5% of the step, whichever is larger.
    target_ms = max(2.0, 0.05 * base * 1e3)
    out["offload_target_ms"] = round(target_ms, 3)
    for name in ("offload", "offload_chunked"):
        if name in times:
            out[f"{name}_meets_target"] = (times[name] - base) * 1e3 <= target_ms
    for ema in emas.values():
        ema.close()
    return out


def section_cuda_graph(args: argparse.Namespace) -> dict[str, Any]:
    """Graph replay on the GPU: by hand, the library's opt-in path, FSDP2 at W=1."""
    if args.device != "cuda":
        return {"skipped": "no CUDA: graph replay needs a GPU"}
    device = torch.device("cuda", torch.cuda.current_device())
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    rows += _hand_captured_rows(device)
    rows += _opt_in_rows(device)
    for dt in ("fp32", "bf16"):
        rows.append(_fsdp2_graph_row(device, dt, args.out))
    return {"rows": rows}


def _hand_captured_rows(device: torch.device) -> list[dict[str, Any]]:
    """``capturable=True`` update captured with ``torch.cuda.graph`` by hand; six replays
    equal six eager capturable updates (eager kernel; the compiled one was proven exact on
    the H100 run and is not a CUDA default)."""
    from models import make_model

    from dtensor_ema import ModelEMA

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model("edge").to(device=device, dtype=dtype)
        kwargs = {"decay": 0.9, "tau": 2, "update_every": 2, "capturable": True}
        graphed = ModelEMA(model, kernel="eager", cuda_graph=False, **kwargs)
        plain = ModelEMA(model, kernel="eager", cuda_graph=False, **kwargs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside capture
                graphed.update()
                plain.update()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.update()
        g = torch.Generator(device=device).manual_seed(0)
        for _ in range(6):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, device=device, generator=g).to(dtype) * 0.1)
            graph.replay()
            plain.update()
        torch.cuda.synchronize()
        rows.append(
            {
                "path": "capturable, captured by hand",
                "dtype": str(dtype),
                "differs": differing(full(graphed), full(plain)) or "exact",
                "updates": [graphed.updates, plain.updates],
            }
        )
    return rows


def _reference_decay(updates: int, *, every: int, after: int) -> float:
    """Written here: the ramp ``0.9 * (1 - exp(-step / 2))`` raised to ``every``, from the
    ``after``-th call on (0: a copy)."""
    step = updates - after
    return 0.0 if step <= 0 else (0.9 * (1 - math.exp(-step / 2.0))) ** every


def _opt_in_rows(device: torch.device) -> list[dict[str, Any]]:
    """``cuda_graph=True`` against ``cuda_graph=False`` and a ``lerp_`` reference over 12
    calls (``update_every=2``), re-captured after a re-allocated parameter, ``build_module``
    and a load; fp32 and bf16 models (fp32 EMA). Also what ``cuda_graph=None`` decides."""
    from models import make_model

    from dtensor_ema import ModelEMA

    rows = []
    every, after = 2, 1
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model("edge").to(device=device, dtype=dtype)
        kwargs = {"decay": 0.9, "tau": 2.0, "update_every": every, "update_after_step": after}
        graphed = ModelEMA(model, cuda_graph=True, **kwargs)
        eager = ModelEMA(model, cuda_graph=False, **kwargs)
        auto = ModelEMA(model, **kwargs)
        ref = {
            k: v.detach().float().clone()
            for k, v in model.state_dict().items()
            if v.is_floating_point()
        }
        g = torch.Generator(device=device).manual_seed(0)
        first_ms = replay_ms = None
        for i in range(1, 13):
            with torch.no_grad():
                for t in model.state_dict().values():
                    if t.is_floating_point():
                        t.add_(torch.randn(t.shape, device=device, generator=g).to(t.dtype) * 0.1)
            if i == 4:
                first = next(model.parameters())
                first.data = first.data.clone()  # new storage: re-capture
            if i == 6:
                graphed.build_module()  # the shards move into the module: re-capture
            if i == 8:
                state = graphed.state_dict()
                graphed.load_state_dict(
                    {**state, "ema": {k: v.detach().clone() for k, v in state["ema"].items()}}
                )
            _sync(device)
            start = time.perf_counter()
            graphed.update()
            _sync(device)
            if i == 1:
                first_ms = (time.perf_counter() - start) * 1e3
            elif i == 12:
                replay_ms = (time.perf_counter() - start) * 1e3
            eager.update()
            auto.update()
            if i % every == 0:
                d = _reference_decay(i, every=every, after=after)
                for k, v in model.state_dict().items():
                    if k in ref:
                        ref[k].lerp_(v.detach().float(), 1 - d)
        _sync(device)
        graph = graphed.engine.graph
        got = full(graphed)
        rows.append(
            {
                "path": "cuda_graph=True (opt-in)",
                "dtype": str(dtype),
                "uses_graph": graphed.cuda_graph.use,
                "reason": graphed.cuda_graph.reason,
                "captures": None if graph is None else graph.captures,
                "expected_captures": 4,
                "first_call_ms": None if first_ms is None else round(first_ms, 2),
                "replay_ms": None if replay_ms is None else round(replay_ms, 3),
                "differs": differing(got, full(eager)) or "exact",
                "differs_from_reference": differing(got, ref) or "exact",
                "eager_differs_from_reference": differing(full(eager), ref) or "exact",
                "updates": [graphed.updates, eager.updates],
                "cuda_graph_None_decides": auto.cuda_graph.reason,
                "cuda_graph_None_differs": differing(full(auto), full(eager)) or "exact",
            }
        )
    return rows


def _init_one_rank_group(store_file: Path, device: torch.device) -> None:
    """A default process group of this process alone over a ``FileStore`` at
    ``store_file``: NCCL beside gloo on CUDA (as the H100 run's W=1 checks), gloo on CPU."""
    import torch.distributed as dist

    store_file.parent.mkdir(parents=True, exist_ok=True)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(store_file), 1), rank=0, world_size=1)


def _fsdp2_graph_row(device: torch.device, dt: str, out: Path) -> dict[str, Any]:
    """FSDP2 parameters (a one-rank group, NCCL on CUDA as in the H100 run's W=1 check): a
    graphed and an eager EMA over training steps with evaluation forwards between them,
    against a ``lerp_`` reference of the full parameters."""
    import torch.distributed as dist
    from gpu_checks import DTYPES, full_cpu, ramp
    from gpu_ranks import build, forward, train_step

    from dtensor_ema import ModelEMA

    row: dict[str, Any] = {"path": "cuda_graph=True, FSDP2 at W=1", "dtype": dt}
    _init_one_rank_group(out / "fsdp2_graph_store" / f"store-{dt}-{os.getpid()}", device)
    try:
        model = build("fsdp2", DTYPES[dt], device, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        graphed = ModelEMA(model, decay=0.9, tau=2.0, cuda_graph=True)
        eager = ModelEMA(model, decay=0.9, tau=2.0, cuda_graph=False)
        params = dict(model.state_dict(keep_vars=True))
        owners: dict[int, str] = {}
        keys = [k for k, v in params.items() if owners.setdefault(id(v), k) == k]
        ref = {k: full_cpu(params[k]).float() for k in keys}
        for step in range(1, 7):
            train_step(model, opt, step, device)
            if step % 2 == 0:
                forward(model, device)  # FSDP2 leaves the root unsharded after it
            graphed.update()
            eager.update()
            for k in keys:
                ref[k].lerp_(full_cpu(params[k]).float(), 1 - ramp(step))
        got = {k: v.cpu() for k, v in full(graphed).items()}
        graph = graphed.engine.graph
        row.update(
            {
                "uses_graph": graphed.cuda_graph.use,
                "reason": graphed.cuda_graph.reason,
                "captures": None if graph is None else graph.captures,
                "first_call_ms": None
                if graph is None or graph.capture_seconds is None
                else round(graph.capture_seconds * 1e3, 2),
                "differs": differing(got, {k: v.cpu() for k, v in full(eager).items()}) or "exact",
                "differs_from_reference": differing(got, ref) or "exact",
                "updates": [graphed.updates, eager.updates],
            }
        )
    finally:
        dist.destroy_process_group()
    return row


def section_float8(args: argparse.Namespace) -> dict[str, Any]:
    """torchao float8 training under FSDP2 with its float8 all-gather (a one-rank group,
    NCCL on CUDA): skipped with a note without torchao or below SM89."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return {"skipped": f"torchao not importable ({err}): pip install torchao==0.18.0"}
    if args.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return {"skipped": "float8 matmuls need SM89 or later"}
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    rows.append(_float8_row(device or torch.device("cpu"), args.out))
    return {"rows": rows}


def _float8_row(device: torch.device, out: Path) -> dict[str, Any]:
    """``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` (every local tensor a
    ``WeightWithDynamicFloat8CastTensor``) with ``precompute_float8_dynamic_scale_for_fsdp``
    after each AdamW step, the float8 matmuls on the device: an eager EMA (and on CUDA a
    graphed one) against a ``lerp_`` reference of the full weights every step; inside
    ``average_parameters()`` (the scales recomputed) the weights and a forward against an
    unsharded float8 model holding the reference; the weights restored."""
    import torch.distributed as dist
    from gpu_checks import full_cpu
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    from dtensor_ema import ModelEMA

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)
        ).to(device)
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        return convert_to_float8_training(model, config=config)

    def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        fulls = {k: full_cpu(v) for k, v in model.named_parameters()}
        return {k: getattr(v, "_tensor", v).detach().clone() for k, v in fulls.items()}

    row: dict[str, Any] = {"path": "float8 all-gather, FSDP2 at W=1", "dtype": "fp32"}
    _init_one_rank_group(out / "float8_store" / f"store-{os.getpid()}", device)
    try:
        model = net()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        row["local_type"] = type(model[0].weight.to_local()).__name__
        emas = {"eager": ModelEMA(model, decay=0.9, tau=None, cuda_graph=False)}
        if device.type == "cuda":
            emas["graph"] = ModelEMA(model, decay=0.9, tau=None, cuda_graph=True)
        ref = weights(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        bad: dict[str, list[str]] = {name: [] for name in emas}
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            model(torch.randn(32, 64, generator=gen).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(model)
            now = weights(model)
            for k, v in ref.items():
                v.lerp_(now[k], 0.1)
            for name, ema in emas.items():
                ema.update()
                got = {k: full_cpu(v) for k, v in ema.ema_tensors().items()}
                bad[name] += [f"step {step}: {k}" for k in differing(got, ref)]
        for name in emas:
            row[f"{name}_differs"] = bad[name] or "exact"
        if "graph" not in emas:
            row["graph_differs"] = "skipped: no CUDA"
        twin = net()
        twin.load_state_dict({k: v.to(device) for k, v in ref.items()})
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(99)).to(device)
        raw = weights(model)
        with torch.no_grad():
            expected = twin(x)
            with emas["eager"].average_parameters():
                precompute_float8_dynamic_scale_for_fsdp(model)
                row["weights"] = differing(weights(model), ref) or "exact"
                got = model(x)
        precompute_float8_dynamic_scale_for_fsdp(model)
        row["restored"] = differing(weights(model), raw) or "exact"
        diff = float((got - expected).abs().max())
        row["forward_max_abs_diff"] = diff
        row["ok"] = diff <= 1e-3 * max(float(expected.abs().max()), 1.0)
    finally:
        dist.destroy_process_group()
    return row


def section_multirank(args: argparse.Namespace) -> dict[str, Any]:
    """W = 4 and W = 2 ranks on the one device; fake process group at W = 8, 64."""
    import shutil

    import gpu_checks
    import gpu_ranks
    import gpu_zero3
    from dist_harness import outcomes, spawn_ranks

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = "gloo-cuda" if cuda else "gloo"
    root = args.out / "multirank"
    shutil.rmtree(root, ignore_errors=True)
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    errors: list[str] = args.progress.setdefault("errors", [])
    out: dict[str, Any] = {"backend": backend, "rows": rows, "errors": errors}
    args.progress["backend"] = backend
    ckpt = root / "ckpt"  # W = 4 saves there, W = 2 and this process load
    ckpt.mkdir(parents=True)
    for i, world in enumerate(args.multirank_worlds):
        run_dir = root / f"w{world}"
        run_dir.mkdir(parents=True)
        share = 0.6 if i + 1 < len(args.multirank_worlds) else 1.0
        deadline = max(10.0, (args.time_left() - args.multirank_reserve_s) * share)
        start = time.perf_counter()
        failures: list[str] = []
        try:
            _, failures = spawn_ranks(
                gpu_ranks.rank_body,
                world,
                run_dir,
                args.device,
                str(run_dir),
                str(ckpt),
                deadline_s=deadline,
                env=gpu_ranks.ranks_env(),
                backend=backend,
                start_method="spawn" if cuda else None,
            )
        finally:
            # What every rank finished, and why one failed, also when the budget stopped it.
            rows += _merge_rank_rows([gpu_ranks.read_rows(run_dir, r) for r in range(world)], world)
            if not failures:
                for spawned in run_dir.glob("ranks-*"):
                    failures = [f for f in outcomes(spawned, world)[1] if "raised" in f]
            for failure in failures:
                lines = failure.strip().splitlines()
                errors.append(f"W={world}: {lines[0]} ... {lines[-1]}"[:400])
                if len(lines) > 1:  # the traceback (not counted in the summary)
                    errors.append(failure[-1500:])
        out[f"w{world}_seconds"] = round(time.perf_counter() - start, 1)
    for layout in gpu_ranks.LAYOUTS[4]:
        for dt in gpu_checks.DTYPES:
            if (ckpt / f"{layout}_{dt}.ref.pt").exists():
                rows.append(gpu_checks.load_one_process(layout, dt, device, ckpt))
    for dt in gpu_checks.DTYPES:
        if (ckpt / f"zero3_{dt}.ref.pt").exists():
            rows.append(gpu_zero3.load_one_process(dt, device, ckpt))
    shutil.rmtree(ckpt, ignore_errors=True)
    model = args.multirank_fake_model or ("gpt2" if cuda else "llama-tiny")
    out["fake_world"] = gpu_ranks.fake_world_rows(
        model, args.multirank_fake_worlds, device, args.time_left
    )
    args.progress["fake_world"] = out["fake_world"]
    return out


def _merge_rank_rows(kept: list[list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """Rank 0's rows, each with every rank's EMA bytes (rows are in the same order on every
    rank) and the largest over total / W."""
    rows = []
    for i, row in enumerate(kept[0]):
        per_rank = [k[i].get("ema_bytes_rank") if i < len(k) else None for k in kept]
        row.pop("ema_bytes_rank", None)
        if any(b is not None for b in per_rank):
            row["ema_bytes_per_rank"] = per_rank
        total = row.get("ema_bytes_total")
        if total and all(isinstance(b, int) for b in per_rank):
            row["bytes_over_total_per_W"] = round(max(per_rank) / (total / world), 4)
            row["bytes_sum_equals_total"] = sum(per_rank) == total
        rows.append(row)
    return rows


SPEED_MODELS_GPU = ("resnet50", "gpt2", "llama3-8b-L4")
SPEED_MODELS_CPU = ("resnet50", "gpt2", "llama3-8b-L1")
SPEED_VARIANTS_GPU = ("eager", "graph", "titan", "timm")
"""The compiled kernel is left out on CUDA by default: 7-10x slower than eager there
(benchmarks/README.md), and each row pays a fresh compilation, the likely reason the Llama
rows did not finish in one call; ``--speed-variants eager,graph,compiled,combo,titan,timm``
brings it back."""
SPEED_VARIANTS_CPU = ("eager", "compiled", "titan", "timm")


def section_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Per-rank update time at W = 8, 64, 512 on this rank's real local tensors."""
    from shapes import count_params, fake_world, lay_out, materialize, meta_model
    from torch.distributed.tensor import DTensor

    from dtensor_ema import ModelEMA

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    models = args.speed_models or (SPEED_MODELS_GPU if cuda else SPEED_MODELS_CPU)
    wanted = set(args.speed_variants or (SPEED_VARIANTS_GPU if cuda else SPEED_VARIANTS_CPU))
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    errors: list[str] = args.progress.setdefault("errors", [])
    reps = 7 if args.device == "cpu" else 20
    # CPU: one thread and thread CPU time, so a shared machine's load cancels in the ratios.
    clock = "cpu" if args.device == "cpu" else "wall"
    if args.device == "cpu":
        torch.set_num_threads(1)
    replicated: dict[tuple[str, str], tuple[float, str] | None] = {}
    # Smallest W first for every model and dtype: a cut by the time budget drops large W.
    for world, name, dt in itertools.product(args.worlds, models, ("fp32", "bf16")):
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        if args.time_left() < (5 if args.device == "cpu" else 15):
            errors.append(f"{name} {dt} W={world}: skipped, out of time budget")
            continue
        if "timm" in wanted and (name, dt) not in replicated:
            try:
                replicated[name, dt] = _timm_replicated(name, dtype, device, reps, clock)
            except Exception as err:
                replicated[name, dt] = None
                errors.append(f"timm {name} {dt}: {type(err).__name__}: {err}")
        timm = replicated.get((name, dt))
        try:
            with fake_world(world):
                model, _ = lay_out(meta_model(name).to(dtype), "fsdp2", args.device)
                model = materialize(model, device)
                ours = ModelEMA(model, decay=DECAY, tau=None, kernel="eager", cuda_graph=False)
                impls: dict[str, Callable[[], object]] = {"eager": ours.update}
                row: dict[str, Any] = {"model": name, "dtype": dt, "world": world}
                if "graph" in wanted and cuda:
                    graphed = ModelEMA(model, decay=DECAY, tau=None, cuda_graph=True)
                    start = time.perf_counter()
                    graphed.update()  # one eager step on a side stream + the capture
                    _sync(device)
                    row["graph_first_call_ms"] = round((time.perf_counter() - start) * 1e3, 2)
                    impls["graph"] = graphed.update
                if "compiled" in wanted:
                    comp = ModelEMA(
                        model, decay=DECAY, tau=None, kernel="compiled", cuda_graph=False
                    )
                    start = time.perf_counter()
                    comp.update()
                    _sync(device)
                    row["first_compiled_update_s"] = round(time.perf_counter() - start, 2)
                    row["compile_s"] = compile_seconds(comp)
                    impls["compiled"] = comp.update
                if "combo" in wanted and cuda:
                    # Inductor's horizontal fusion: one launch for many tensors.
                    from dtensor_ema.update import compiled_lerp

                    saved = compiled_lerp.INDUCTOR_OPTIONS["cuda"]
                    compiled_lerp.INDUCTOR_OPTIONS["cuda"] = {"combo_kernels": True}
                    try:
                        combo = ModelEMA(
                            model, decay=DECAY, tau=None, kernel="compiled", cuda_graph=False
                        )
                        combo.update()
                        impls["compiled_combo"] = combo.update
                    finally:
                        compiled_lerp.INDUCTOR_OPTIONS["cuda"] = saved
                ours_names = list(impls)
                if "titan" in wanted:
                    params = [p for p in model.parameters() if isinstance(p, DTensor)]
                    clones = [p.detach().clone().float() for p in params]

                    def titan(
                        clones: list[Any] = clones,
                        params: list[Any] = params,
                        upcast: bool = dtype != torch.float32,
                    ) -> None:
                        ends = [p.float() for p in params] if upcast else params
                        torch._foreach_lerp_(clones, ends, 1 - DECAY)

                    impls["titan_dtensor_foreach"] = titan
                numel = ours.local_numel()
                nbytes = numel * BYTES_PER_VALUE[dt]
                src = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device=device)
                dst = torch.empty_like(src)
                impls["copy"] = lambda dst=dst, src=src: dst.copy_(src)
                times = interleave(impls, device, warmup=2, reps=reps, clock=clock)
                copy_bw = 2 * src.numel() * 4 / times["copy"]
                row.update(
                    {
                        "clock": clock,
                        "local_values": numel,
                        "params_total": count_params(model),
                        **{f"{k}_ms": round(v * 1e3, 4) for k, v in times.items()},
                        "copy_GBps": round(copy_bw / 1e9, 2),
                        **{
                            f"{k}_bw_vs_copy": round(nbytes / times[k] / copy_bw, 3)
                            for k in ours_names
                        },
                    }
                )
                if timm is not None:
                    timm_s, mode = timm
                    best = min(times[k] for k in ours_names)
                    row["timm_replicated_ms"] = round(timm_s * 1e3, 3)
                    row["timm_mode"] = mode
                    row["best_over_timm_per_W"] = round(best / (timm_s / world), 3)
                rows.append(row)
                del model, ours, impls, src, dst
        except Exception as err:
            errors.append(f"{name} {dt} W={world}: {type(err).__name__}: {err}")
            errors.append(traceback.format_exc()[-1500:])
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return {"rows": rows, "errors": errors}


def section_host(args: argparse.Namespace) -> dict[str, Any]:
    """Host time of one ``update()`` beside one bare ``_foreach_lerp_`` on the same tensors
    (``host_overhead.py``'s models and floor), at 161 and 1000 fp32 tensors: eager, and on
    CUDA with graph replay (``cuda_graph=True``). Host time: the device is synchronized
    before and after each block of calls, never inside it."""
    from host_overhead import Case, build_pair, median_block

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else None
    # CPU: one thread and thread CPU time, as in ``speed``; CUDA: the wall clock.
    clock = time.perf_counter if cuda else time.thread_time
    if not cuda:
        torch.set_num_threads(1)
    rows: list[dict[str, Any]] = args.progress.setdefault("rows", [])
    for tensors in (161, 1000):
        case = Case("fp32", tensors)
        floor, eager, _ = build_pair(case, device, cuda_graph=False)
        impls = {"floor": (floor, True), "update": (eager, False)}
        row: dict[str, Any] = {"tensors": tensors}
        graphed = None
        if cuda:
            _, replay, graphed = build_pair(case, device, cuda_graph=True)
            impls["graph"] = (replay, False)
        else:
            row["graph"] = "skipped: no CUDA"
        for fn, no_grad in impls.values():  # warm-up, and the graph's capture
            median_block(fn, 5, no_grad=no_grad, sync=sync, clock=clock)
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(9):
            for name, (fn, no_grad) in impls.items():
                samples[name].append(median_block(fn, 20, no_grad=no_grad, sync=sync, clock=clock))
        us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
        row.update(floor_us=round(us["floor"], 1), update_us=round(us["update"], 1))
        row["update_over_floor"] = round(us["update"] / us["floor"], 3)
        if graphed is not None:
            row.update(graph_us=round(us["graph"], 1), replays=graphed.engine.graph is not None)
            row["graph_over_floor"] = round(us["graph"] / us["floor"], 3)
        rows.append(row)
    return {"clock": "wall" if cuda else "thread CPU time, one thread", "rows": rows}


def make_timm_ema(cls: Any, model: torch.nn.Module) -> tuple[Any, str]:
    """A timm ``ModelEmaV3`` keeping a float32 EMA, with or without its ``dtype=`` argument.

    timm releases before ``dtype=`` keep the EMA in the model's dtype; the fallback casts
    the EMA module to float32 by hand (what ``dtype=`` does). Returns the EMA and which way
    it was built.
    """
    if "dtype" in inspect.signature(cls.__init__).parameters:
        return cls(model, decay=DECAY, dtype=torch.float32), "dtype=float32"
    ema = cls(model, decay=DECAY)
    if all(
        t.dtype == torch.float32 for t in ema.module.state_dict().values() if t.is_floating_point()
    ):
        return ema, "no dtype= (already float32)"
    ema.module.to(dtype=torch.float32)
    return ema, "no dtype=: module.to(float32)"


def _timm_replicated(
    name: str, dtype: torch.dtype, device: torch.device, reps: int, clock: str
) -> tuple[float, str]:
    """timm ModelEmaV3 on a full replica (what every rank updates without sharding)."""
    from shapes import meta_model, to_empty_tied
    from timm.utils.model_ema import ModelEmaV3

    model = to_empty_tied(meta_model(name).to(dtype=dtype), device)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.normal_()
    ema, mode = make_timm_ema(ModelEmaV3, model)
    try:
        ema.update(model)
    except RuntimeError as err:  # an old timm that cannot lerp mixed dtypes
        if "dtype" not in str(err).lower():
            raise
        ema, mode = ModelEmaV3(model, decay=DECAY), "no dtype=: EMA in the model's dtype"
    seconds = interleave(
        {"timm": lambda: ema.update(model)}, device, warmup=2, reps=reps, clock=clock
    )["timm"]
    return seconds, mode


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "kernels": section_kernels,
    "cuda_graph": section_cuda_graph,
    "offload": section_offload,
    "multirank": section_multirank,
    "speed": section_speed,
    "float8": section_float8,
    "host": section_host,
    "tests": section_tests,
}

PRESET = "cuda_graph:45,offload:70,multirank:165,speed:100,float8:15,host:20,tests:45"
"""The default sections and their pinned budgets (seconds; 460 in all, the default
``--budget-s 460``): the one command a GPU session runs, in at most 8 minutes. Most
important first: what decides the defaults (``cuda_graph``, ``offload``), then several
ranks, then speed, torchao float8 under FSDP2 (one small model) and the host time of one
update, then the test bodies on the GPU. Left out to fit (``benchmarks/README.md`` says
why): the ``kernels`` section (proven exact on the H100 run; the compiled kernel is no CUDA
default), W = 512 in ``speed`` (with the Llama-3-8B blocks it did not fit a 10-minute
call), the compiled kernel everywhere, and the test modules that build their meshes on CPU
(CI runs them)."""
BUDGET_S = 460.0


# --------------------------------------------------------------------------- verdict
def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """Whether this run allows flipping the defaults (issue 25), and the targets.

    ``cuda_graph``: every graph row exact (against eager and the reference) and captured,
    in the common cases: a plain fp32 model, bf16 parameters with an fp32 EMA, FSDP2
    parameters (W = 1 here; W = 2 and 4 in ``multirank``), all with offload off.
    ``offload``: the chunked pipeline exact over the offload section's steps (and in
    ``multirank``). A case that did not run keeps the default.
    """
    sections = results["sections"]

    def body(name: str) -> dict[str, Any]:
        entry = sections.get(name, {})
        out = entry.get("result", {})
        return out if isinstance(out, dict) else {}

    graph_rows = [
        r for r in body("cuda_graph").get("rows", []) if "cuda_graph=True" in r.get("path", "")
    ]
    multi = [
        r
        for r in body("multirank").get("rows", [])
        if "update_graph" in r and not str(r["update_graph"]).startswith("skipped")
    ]
    cases = {
        "fp32": [r for r in graph_rows if "float32" in r["dtype"] and "FSDP2" not in r["path"]],
        "bf16 params, fp32 EMA": [
            r for r in graph_rows if "bfloat16" in r["dtype"] and "FSDP2" not in r["path"]
        ],
        "FSDP2 parameters": [r for r in graph_rows if "FSDP2" in r["path"]],
    }
    problems = []
    for case, rows in cases.items():
        if not rows:
            problems.append(f"{case}: not run")
        for r in rows:
            ok = (
                r.get("uses_graph") is True
                and r.get("differs") == "exact"
                and r.get("differs_from_reference") == "exact"
                and isinstance(r.get("captures"), int)
                and r["captures"] >= 1
                and r.get("captures") == r.get("expected_captures", r.get("captures"))
            )
            if not ok:
                problems.append(f"{case} {r['dtype']}: {_brief(r)}")
    for r in multi:
        if r.get("update_graph") != "exact" or not (r.get("graph_captures") or 0) >= 1:
            problems.append(
                f"multirank W={r['world']} {r['layout']} {r['dtype']}: graph "
                f"{r.get('update_graph')}, captures {r.get('graph_captures')}"
            )
    offload = body("offload")
    chunked_problems = []
    if "offload_chunked_differs" not in offload:
        chunked_problems.append("offload section: chunked pipeline not run")
    elif offload["offload_chunked_differs"] != "exact":
        chunked_problems.append(f"offload section: {offload['offload_chunked_differs']}")
    for r in body("multirank").get("rows", []):
        chunked = r.get("update_offload_chunked", "exact")
        if chunked != "exact" and not str(chunked).startswith("skipped"):
            chunked_problems.append(
                f"multirank W={r['world']} {r['layout']} {r['dtype']}: {chunked}"
            )
    out: dict[str, Any] = {
        "cuda_graph_may_flip": not problems,
        "cuda_graph_problems": problems,
        "chunked_offload_may_flip": not chunked_problems,
        "chunked_offload_problems": chunked_problems,
        "offload_chunked_meets_target": offload.get("offload_chunked_meets_target"),
        "offload_worker_meets_target": offload.get("offload_meets_target"),
    }
    speed_rows = body("speed").get("rows", [])
    met, graded = [], 0
    for r in speed_rows:
        bw = r.get("graph_bw_vs_copy")
        if bw is None:
            continue
        graded += 1
        target = 0.6 if r.get("model") == "resnet50" else 0.85
        if bw >= target:
            met.append(f"{r['model']} {r['dtype']} W={r['world']}")
    out["graph_bandwidth_target"] = f"met on {len(met)}/{graded} speed rows"
    return out


def _brief(row: dict[str, Any]) -> str:
    keys = ("uses_graph", "captures", "differs", "differs_from_reference", "reason")
    return ", ".join(f"{k}={str(row.get(k))[:80]}" for k in keys if k in row)


def verdict_lines(v: dict[str, Any]) -> list[str]:
    """The ``defaults:`` lines of the summary."""
    graph = "FLIP ALLOWED" if v["cuda_graph_may_flip"] else "keep opt-in"
    lines = [f"defaults: cuda_graph=None -> replay (AUTO_REPLAY=True): {graph}"]
    lines += [f"  - {p}" for p in v["cuda_graph_problems"][:6]]
    chunked = "FLIP ALLOWED" if v["chunked_offload_may_flip"] else "keep 'worker'"
    lines.append(
        f"defaults: offload=True on CUDA -> chunked (CUDA_OFFLOAD='chunked'): {chunked}; "
        f"max(2 ms, 5% of the step) met: chunked {v['offload_chunked_meets_target']}, "
        f"worker {v['offload_worker_meets_target']}"
    )
    lines += [f"  - {p}" for p in v["chunked_offload_problems"][:6]]
    lines.append(
        f"targets: graph bandwidth >= 0.85 (ResNet-50 0.6) of copy_: {v['graph_bandwidth_target']}"
    )
    return lines


# --------------------------------------------------------------------------- report
def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "commit": _commit(),
    }
    from dtensor_ema.update import cuda_graph, updater

    env["defaults"] = {"AUTO_REPLAY": cuda_graph.AUTO_REPLAY, "CUDA_OFFLOAD": updater.CUDA_OFFLOAD}
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    return env


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _md_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)\n"
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k)) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(map(str, v))[:200] or "[]"
    return "" if v is None else str(v)


def render(results: dict[str, Any]) -> str:
    out = ["# dtensor_ema GPU suite\n", "```", json.dumps(results["env"], indent=1), "```\n"]
    for name, res in results["sections"].items():
        out.append(f"## {name} ({res.get('seconds', '?')} s)\n")
        if "error" in res:
            out.append(f"**FAILED**: `{res['error']}`\n\n```\n{res.get('traceback', '')}\n```\n")
            continue
        if "skipped" in res:
            out.append(f"skipped: {res['skipped']}\n")
            continue
        if "timeout" in res:
            out.append(f"**TIMED OUT**: {res['timeout']}; the rows it finished:\n")
        body = res.get("result", {})
        if "rows" in body:
            out.append(_md_table(body["rows"]))
        rest = {k: v for k, v in body.items() if k != "rows"}
        if rest:
            out.append("```\n" + json.dumps(rest, indent=1, default=str)[:6000] + "\n```\n")
    out.append("## summary\n")
    out += [f"- {line}" for line in summary_lines(results)]
    return "\n".join(out) + "\n"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per section: how it ended, rows, exactness checks, how long; then the
    ``defaults:`` lines (:func:`verdict`)."""
    lines = []
    for name, res in results["sections"].items():
        seconds = res.get("seconds", "?")
        body = res.get("result", {})
        body = body if isinstance(body, dict) else {}
        rows = len(body.get("rows", []))
        errors = len([e for e in body.get("errors", []) if "\n" not in e])
        if "error" in res:
            state = f"FAILED ({res['error'][:120]})"
        elif "skipped" in res:
            state = f"skipped ({res['skipped']})"
        elif "timeout" in res:
            state = f"TIMED OUT ({res['timeout']}), {rows} row(s) kept"
        else:
            state = f"ok, {rows} row(s)"
        good, bad = exactness(body)
        if good or bad:
            state += f", exact {good}/{good + len(bad)}"
            if bad:
                state += f" (not: {'; '.join(bad[:3])[:200]})"
        if errors:
            state += f", {errors} row error(s)/skip(s)"
        if "summary" in body:
            state += f", pytest: {body['summary']}"
            if body.get("timed_out"):
                state += f", TIMED OUT after {body.get('timeout_s')} s (output kept)"
            elif body.get("returncode"):
                state += f", exit code {body['returncode']}"
        lines.append(f"{name}: {state} in {seconds} s")
    if "verdict" in results:
        lines += verdict_lines(results["verdict"])
    return lines


EXACT_KEYS = re.compile(
    r"^(differs.*|.*_differs|update_.*|weights|restored|ema_sd|model_sd|dcp_load.*|failed_load_unchanged|local_shapes|"
    r"local_values_after_update|eager_differs_from_reference)$"
)
"""Fields that hold an exactness result: ``"exact"``, or what differs (a list, an error);
besides, ``ok`` booleans (forwards within ``build_module``'s bound) count."""


def exactness(body: Any, where: str = "") -> tuple[int, list[str]]:
    """``(exact results, the others)`` among :data:`EXACT_KEYS` fields anywhere in
    ``body`` (rows, nested dicts); ``"skipped: ..."`` values are not counted."""
    good, bad = 0, []
    if isinstance(body, list):
        for i, item in enumerate(body):
            g, b = exactness(item, f"{where}[{i}]")
            good, bad = good + g, bad + b
        return good, bad
    if not isinstance(body, dict):
        return 0, []
    label = " ".join(str(body[k]) for k in ("layout", "path", "dtype", "world") if k in body)
    for key, value in body.items():
        if key == "tracebacks":
            continue
        if (
            isinstance(value, (dict, list))
            and key not in ("differs",)
            and not (isinstance(value, list) and EXACT_KEYS.match(key))
        ):
            g, b = exactness(value, f"{label or where} {key}".strip())
            good, bad = good + g, bad + b
        elif key == "ok" and isinstance(value, bool):
            if value:
                good += 1
            else:
                bad.append(f"{label or where} not ok".strip())
        elif EXACT_KEYS.match(key) and not (isinstance(value, str) and value.startswith("skipped")):
            if value == "exact":
                good += 1
            elif isinstance(value, (list, str)):
                bad.append(f"{label or where} {key}: {str(value)[:60]}".strip())
    return good, bad


class SectionTimeout(BaseException):
    """A section ran past its budget (or the process got SIGTERM). A ``BaseException`` so
    that a section's own ``except Exception`` around one row does not swallow it."""


def _raise_timeout(signum: int, _frame: Any) -> None:
    raise SectionTimeout(
        "its time budget ran out" if signum == signal.SIGALRM else "SIGTERM received"
    )


def _parse_sections(spec: str) -> list[tuple[str, float | None]]:
    """``"kernels,speed:240"`` -> ``[("kernels", None), ("speed", 240.0)]``."""
    out: list[tuple[str, float | None]] = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, budget = item.partition(":")
        if budget:
            seconds = float(budget)
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"section budget must be > 0 seconds, got {item!r}")
            out.append((name, seconds))
        else:
            out.append((name, None))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=Path("gpu_suite_out"))
    p.add_argument(
        "--sections",
        default=PRESET,
        help="comma-separated sections, each with an optional budget in seconds "
        f"(default, the 8-minute preset: {PRESET}; also: kernels)",
    )
    p.add_argument("--worlds", default="8,64", help="fake world sizes for the speed section")
    p.add_argument("--speed-models", default=None, help="comma-separated model names")
    p.add_argument(
        "--speed-variants",
        default=None,
        help="comma-separated: eager,graph,compiled,combo,titan,timm "
        f"(default CUDA: {','.join(SPEED_VARIANTS_GPU)}; CPU: {','.join(SPEED_VARIANTS_CPU)})",
    )
    p.add_argument("--offload-steps", type=int, default=20, help="offload exactness steps")
    p.add_argument(
        "--multirank-worlds", default="4,2", help="spawned world sizes (4 saves, then 2 loads)"
    )
    p.add_argument("--multirank-fake-worlds", default="8,64", help="fake-group world sizes")
    p.add_argument(
        "--multirank-fake-model", default=None, help="default: gpt2 on CUDA, llama-tiny on CPU"
    )
    p.add_argument(
        "--multirank-reserve-s",
        type=float,
        default=20.0,
        help="seconds of the multirank budget kept for the one-process loads and fake worlds",
    )
    p.add_argument(
        "--tests-files",
        default=None,
        help=f"comma-separated test modules for the tests section (CUDA: {','.join(TESTS_CUDA)})",
    )
    p.add_argument("--quick", action="store_true", help="fewer kernel cases (CPU smoke test)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="overall time budget")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    args.deadline = deadline
    args.section_deadline = deadline
    args.time_left = lambda: min(deadline, args.section_deadline) - time.monotonic()
    args.progress = {}
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.multirank_worlds = [int(w) for w in args.multirank_worlds.split(",")]
    if not set(args.multirank_worlds) <= {2, 4}:
        p.error(f"--multirank-worlds takes 4 and/or 2, got {args.multirank_worlds}")
    args.multirank_fake_worlds = [int(w) for w in args.multirank_fake_worlds.split(",")]
    args.tests_files = tuple(args.tests_files.split(",")) if args.tests_files else None
    args.speed_models = tuple(args.speed_models.split(",")) if args.speed_models else None
    args.speed_variants = tuple(args.speed_variants.split(",")) if args.speed_variants else None
    try:
        args.sections = _parse_sections(args.sections)
    except ValueError as err:
        p.error(str(err))
    unknown = [s for s, _ in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"env": environment(args), "sections": {}}
    failed = 0
    handlers = {s: signal.signal(s, _raise_timeout) for s in (signal.SIGALRM, signal.SIGTERM)}
    try:
        for name, budget in args.sections:
            print(f"== {name}", flush=True)
            start = time.perf_counter()
            left = args.deadline - time.monotonic()
            limit = left if budget is None else min(budget, left)
            entry: dict[str, Any]
            args.progress = {}
            stop = False
            if left <= 1:
                entry = {"skipped": "out of the overall time budget (--budget-s)"}
            else:
                args.section_deadline = time.monotonic() + limit
                signal.setitimer(signal.ITIMER_REAL, limit)
                try:
                    entry = {"result": SECTIONS[name](args)}
                    if "skipped" in entry["result"]:
                        entry = {"skipped": entry["result"]["skipped"]}
                except SectionTimeout as err:
                    entry = {"timeout": f"{err} after {limit:.4g} s", "result": args.progress}
                    stop = "SIGTERM" in str(err)
                except Exception as err:
                    failed += 1
                    entry = {
                        "error": f"{type(err).__name__}: {err}",
                        "traceback": traceback.format_exc(),
                        "result": args.progress,
                    }
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            entry["seconds"] = round(time.perf_counter() - start, 1)
            results["sections"][name] = entry
            print(json.dumps(entry, default=str)[:3000], flush=True)
            # Write after every section so a crash or timeout keeps what finished.
            _write(args.out, results)
            if stop:
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for name, _ in args.sections:
            results["sections"].setdefault(name, {"skipped": "not run: SIGTERM", "seconds": 0})
        try:
            results["verdict"] = verdict(results)
        except Exception as err:  # the summary must still print
            results["verdict_error"] = f"{type(err).__name__}: {err}"
        _write(args.out, results)
    print("== summary")
    for line in summary_lines(results):
        print(line)
    if "verdict_error" in results:
        print(f"defaults: verdict failed: {results['verdict_error']}")
    print(f"wrote {args.out / 'gpu_suite.md'} and gpu_suite.json; {failed} section(s) failed")
    return 1 if failed else 0


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gpu_suite.md").write_text(render(results))


if __name__ == "__main__":
    sys.exit(main())
