"""Host overhead of ``update()``: against a bare fused lerp, the code before a change beside it.

    python benchmarks/host_overhead.py                     # the table (about 3 minutes here)
    python benchmarks/host_overhead.py --quick             # smoke run: 10 tensors, one process
    python benchmarks/host_overhead.py --baseline cee6376  # which commit is "before"
    python benchmarks/host_overhead.py --primitives        # what each candidate check costs

One torch thread, CPU, fp32 ``Linear(4, 4)`` tensors (one bias-free layer when the count is
odd), a constant decay. Each row times ``ema.update()`` against the floor: one bare
``torch._foreach_lerp_(ema, params, 1 - d)`` over the same local tensors, inside
``torch.no_grad()`` (so the floor pays nothing per call but the kernel's own dispatch;
``update()`` is called as a training loop does, grad mode on). Rows:

* ``fp32`` at 10, 161 (ResNet-50's parameter count), 1000 and 10,000 tensors;
* ``bf16``: bf16 parameters, fp32 EMA; the floor is ``_foreach_copy_`` into a kept fp32
  scratch then ``_foreach_lerp_`` (the cast included);
* ``multi x3``: ``MultiModelEMA`` with three decays; the floor is three bare calls;
* the same on FSDP2 at W=2: ``fully_shard`` on a fake process group (this process is rank
  0 of 2, its local shards are real), the floor over ``p.to_local()``.

"before" is the ``dtensor_ema`` of ``--baseline`` (extracted with ``git archive`` into a
temporary folder), "after" this checkout's. Every (tree, W) pair runs in its own worker
process with its own model; the workers take turns block by block (each block runs the
floor then ``update()``, in an order that alternates), and each number is the median per
call over the blocks. The ratio is ``update() / floor`` of the same worker.

:func:`make_model`, :func:`build_pair` and :func:`median_block` are what the GPU suite's
``host`` section reuses (``benchmarks/gpu_suite.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "cee6376"
"""main before issue 48: the commit whose ``update()`` the table compares against."""
DECAY = 0.999
DECAYS = (0.99, 0.999, 0.9999)


@dataclass(frozen=True)
class Case:
    kind: str
    """``"fp32"``, ``"bf16"`` (bf16 model, fp32 EMA) or ``"multi"`` (three decays)."""
    tensors: int
    world: int = 1
    """1: one process; 2: FSDP2 on a fake process group, rank 0 of 2."""

    @property
    def name(self) -> str:
        label = {"fp32": "fp32", "bf16": "bf16 -> fp32 EMA", "multi": "MultiModelEMA x3"}
        where = "FSDP2 W=2" if self.world == 2 else "one process"
        return f"{where}, {label[self.kind]}, {self.tensors} tensors"


def cases(quick: bool) -> list[Case]:
    if quick:  # one process only: two workers start, not four (the smoke test's budget)
        return [Case("fp32", 10), Case("bf16", 10), Case("multi", 10)]
    one = [Case("fp32", n) for n in (10, 161, 1000, 10_000)]
    one += [Case("bf16", 161), Case("bf16", 1000), Case("multi", 161)]
    return one + [Case(c.kind, c.tensors, 2) for c in one]


def make_model(tensors: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``tensors`` parameters: ``Linear(4, 4)`` weights and biases, the last layer without
    a bias when the count is odd."""
    layers = [nn.Linear(4, 4) for _ in range(tensors // 2)]
    if tensors % 2:
        layers.append(nn.Linear(4, 4, bias=False))
    return nn.Sequential(*layers).to(dtype)


def build_pair(
    case: Case, device: torch.device, **ema_options: Any
) -> tuple[Callable[[], None], Callable[[], None], Any]:
    """``(floor, update, ema)`` for ``case`` on ``device``: the bare kernel calls over this
    rank's local tensors and the EMA's ``update``. ``ema_options`` go to ``ModelEMA``
    (e.g. ``cuda_graph=``). With ``case.world == 2`` a process group of that size must
    exist (a fake one will do)."""
    from dtensor_ema import ModelEMA, MultiModelEMA

    dtype = torch.bfloat16 if case.kind == "bf16" else torch.float32
    model = make_model(case.tensors, dtype).to(device)
    if case.world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh(device.type, (case.world,)))
    sources = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in model.parameters()]
    ema_list = [s.float().clone() for s in sources]
    floor: Callable[[], None]
    if case.kind == "multi":
        ema: Any = MultiModelEMA(
            model, {f"d{i}": {"decay": d, "tau": None} for i, d in enumerate(DECAYS)}
        )
        lists = [ema_list, *([s.clone() for s in ema_list] for _ in DECAYS[1:])]

        def floor() -> None:
            for emas, decay in zip(lists, DECAYS, strict=True):
                torch._foreach_lerp_(emas, sources, 1 - decay)

    elif case.kind == "bf16":
        ema = ModelEMA(model, decay=DECAY, tau=None, ema_dtype=torch.float32, **ema_options)
        scratch = [s.float() for s in sources]

        def floor() -> None:
            torch._foreach_copy_(scratch, sources)
            torch._foreach_lerp_(ema_list, scratch, 1 - DECAY)

    else:
        ema = ModelEMA(model, decay=DECAY, tau=None, **ema_options)

        def floor() -> None:
            torch._foreach_lerp_(ema_list, sources, 1 - DECAY)

    return floor, ema.update, ema


def median_block(
    fn: Callable[[], None],
    reps: int,
    *,
    no_grad: bool,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.thread_time,
) -> float:
    """Seconds per call of ``reps`` calls of ``fn`` in a row, by ``clock`` (default: this
    thread's CPU time, which leaves out the time other processes hold the core). Host time:
    ``sync``, if given, runs before the clock starts and after it stops."""
    if sync is not None:
        sync()
    with torch.no_grad() if no_grad else torch.enable_grad():
        start = clock()
        for _ in range(reps):
            fn()
        seconds = clock() - start
    if sync is not None:
        sync()
    return seconds / reps


# --------------------------------------------------------------------------- worker
def worker(world: int) -> None:
    """Build cases on demand and time blocks; commands and answers are JSON lines."""
    warnings.simplefilter("ignore")
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the library prints goes to stderr, not into the protocol
    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    import dtensor_ema

    answers.write(json.dumps({"ready": dtensor_ema.__file__}) + "\n")
    answers.flush()
    built: dict[Case, tuple[list[tuple[str, Callable[[], Any], bool]], int]] = {}
    for line in sys.stdin:
        command = json.loads(line)
        case = Case(**command["case"])
        if case not in built:
            floor, update, ema = build_pair(case, torch.device("cpu"))
            for _ in range(3):
                update()
                with torch.no_grad():
                    floor()
            impls = [("floor", floor, True), ("update", update, False)]
            if case.kind != "multi":  # the model check alone (update() runs it first)
                impls.append(("check", ema.engine.plan.sync, True))
            one = median_block(update, 3, no_grad=False)
            built[case] = (impls, max(3, min(2000, int(command["block_s"] / one))))
        impls, reps = built[case]
        order = impls if command["block"] % 2 == 0 else impls[::-1]
        clock = time.perf_counter if command["clock"] == "wall" else time.thread_time
        result = {name: median_block(fn, reps, no_grad=ng, clock=clock) for name, fn, ng in order}
        answers.write(json.dumps(result) + "\n")
        answers.flush()


class Worker:
    def __init__(self, tree: Path, world: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(world)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),  # no dtensor_ema/ folder beside the working directory
        )
        self.package = ""

    def ready(self) -> None:
        """Wait for the worker's imports (started together, the workers import at once)."""
        self.package = self._read()["ready"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with code {self.proc.wait()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def block(self, case: Case, block: int, block_s: float, clock: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        command = {"case": case.__dict__, "block": block, "block_s": block_s, "clock": clock}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def baseline_tree(ref: str, into: Path) -> Path:
    """``dtensor_ema/`` of commit ``ref``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, "dtensor_ema"],
        capture_output=True,
        check=False,
    )
    if archive.returncode:
        raise SystemExit(f"git archive {ref} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


# --------------------------------------------------------------------------- primitives
def _guard_tree(containers: list[dict[str, Any]], tensor_match: bool) -> Callable[[], bool] | None:
    """A dynamo ``RootGuardManager`` over ``containers`` (the model's ``_parameters``
    dictionaries): an ``ID_MATCH`` guard per registered tensor, with ``tensor_match`` a
    ``TENSOR_MATCH`` too (dtype, device, sizes, strides, requires_grad), evaluated in C++.
    ``None`` where this torch's private guard API differs (it changes between releases)."""
    try:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType

        kind = GuardManagerType.GUARD_MANAGER
        root = RootGuardManager()
        for i, held in enumerate(containers):
            manager = root.list_getitem_manager(i, f"c[{i}]", held, kind)
            for name, tensor in held.items():
                if tensor is None:
                    continue
                leaf = manager.dict_getitem_manager(name, f"c[{i}][{name!r}]", tensor, kind)
                leaf.add_id_match_guard(id(tensor), ["id"], None)
                if tensor_match:
                    leaf.add_tensor_match_guard(
                        tensor, list(tensor.shape), list(tensor.stride()), name, ["tensor"],
                        None, type(tensor), torch._C._dispatch_keys(tensor),
                    )  # fmt: skip
        if not root.check(containers):
            return None
    except Exception:  # a private API: any mismatch means "not available in this torch"
        return None
    return lambda: root.check(containers)


def primitives(tensors: int, blocks: int) -> list[tuple[str, float | None]]:
    """Nanoseconds per tensor of each way to look at every tracked tensor once per call
    (the candidates for ``update()``'s model check), beside the floor, on the fp32 model of
    :func:`make_model`. One process, one thread; median of ``blocks`` blocks."""
    import operator

    torch.set_num_threads(1)
    model = make_model(tensors)
    params = list(model.parameters())
    emas = [p.detach().clone() for p in params]
    registered = [
        (m._parameters, n)
        for m in model.modules()
        for n, t in m._parameters.items()
        if t is not None
    ]
    containers, names = [c for c, _ in registered], [n for _, n in registered]
    assert [c[n] for c, n in registered] == params
    pointers = [p.data_ptr() for p in params]
    storages = [p.untyped_storage() for p in params]
    dtypes = [p.dtype for p in params]
    indices = list(range(len(params)))
    unique = [m._parameters for m in model.modules() if m._parameters]
    same_ptrs = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    candidates: dict[str, Callable[[], object] | None] = {
        "floor: torch._foreach_lerp_": lambda: torch._foreach_lerp_(emas, params, 1 - DECAY),
        "registered objects by identity (dict.get, is)": lambda: all(
            map(operator.is_, map(dict.get, containers, names), params)
        ),
        "data_ptr() of each tensor, compared (today's probe)": lambda: (
            list(map(torch.Tensor.data_ptr, params)) == pointers
        ),
        "untyped_storage() of each tensor, by identity": lambda: all(
            map(operator.is_, map(torch.Tensor.untyped_storage, params), storages)
        ),
        "dtype of each tensor (any tensor attribute)": lambda: (
            list(map(operator.attrgetter("dtype"), params)) == dtypes
        ),
        "torch._C._tensors_data_ptrs_at_indices_equal (pybind)": (
            (lambda: same_ptrs(params, pointers, indices)) if same_ptrs else None
        ),
        "dynamo C++ guards: ID_MATCH": _guard_tree(unique, tensor_match=False),
        "dynamo C++ guards: ID_MATCH + TENSOR_MATCH": _guard_tree(unique, tensor_match=True),
    }
    rows: list[tuple[str, float | None]] = []
    reps = max(20, 20_000 // tensors)
    for name, fn in candidates.items():
        if fn is None:
            rows.append((name, None))
            continue
        times = [median_block(fn, reps, no_grad=True) for _ in range(blocks)]
        rows.append((name, statistics.median(times) / tensors * 1e9))
    return rows


def report_primitives(rows: list[tuple[str, float | None]], tensors: int) -> str:
    floor = rows[0][1]
    assert floor is not None
    lines = [
        f"{tensors} fp32 Linear(4, 4) tensors, one thread: ns per tensor per call. The 1.2x "
        f"bound leaves {0.2 * floor:.0f} ns per tensor for everything update() adds.",
        "",
        "| primitive | ns per tensor | share of the 1.2x budget |",
        "|---|---|---|",
    ]
    for name, ns in rows:
        cells = "not available in this torch | -" if ns is None else f"{ns:.1f} | "
        if ns is not None:
            cells += "-" if ns is floor else f"{ns / (0.2 * floor):.0%}"
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- report
def bound(case: Case, floor: float, update: float) -> tuple[str, bool]:
    """Issue 48's bound for the row and whether ``update`` meets it (seconds per call)."""
    if case.kind == "fp32" and case.tensors <= 10:
        return "<= floor + 5 us", update - floor <= 5e-6
    return "<= 1.2x floor", update <= 1.2 * floor


def report(rows: list[dict[str, Any]]) -> str:
    head = (
        "| case | before: floor us | before: update() us | before: ratio | after: floor us "
        "| after: update() us | after: ratio | after: extra us | bound | met |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['case']} | {b['floor'] * 1e6:.1f} | {b['update'] * 1e6:.1f} | "
            f"{b['update'] / b['floor']:.2f}x | {a['floor'] * 1e6:.1f} | "
            f"{a['update'] * 1e6:.1f} | {a['update'] / a['floor']:.2f}x | "
            f"{(a['update'] - a['floor']) * 1e6:.1f} | {r['bound']} | "
            f"{'yes' if r['met'] else 'NO'} |"
        )
    curve = [r for r in rows if r["kind"] == "fp32"]
    if curve:
        lines += [
            "",
            "Per tensor (fp32 rows): ns per tensor of the floor and of update(), the extra "
            "update() costs over the floor, and the model check alone (`EmaPlan.sync()`, "
            "timed by itself: the cache it finds is warmer than inside update()).",
            "",
            "| where | tensors | floor ns/tensor | before: update() | before: extra | "
            "before: check | after: update() | after: extra | after: check |",
            "|" + "---|" * 9,
        ]
        for r in curve:
            n, b, a = r["tensors"], r["before"], r["after"]
            lines.append(
                f"| {'FSDP2 W=2' if r['world'] == 2 else 'one process'} | {n} | "
                f"{a['floor'] / n * 1e9:.0f} | {b['update'] / n * 1e9:.0f} | "
                f"{(b['update'] - b['floor']) / n * 1e9:.0f} | {b['check'] / n * 1e9:.0f} | "
                f"{a['update'] / n * 1e9:.0f} | {(a['update'] - a['floor']) / n * 1e9:.0f} | "
                f"{a['check'] / n * 1e9:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--baseline", default=BASELINE, help="the commit timed as 'before'")
    p.add_argument("--quick", action="store_true", help="10 tensors, one process, 3 blocks")
    p.add_argument("--blocks", type=int, default=None, help="blocks per row (default 15)")
    p.add_argument("--block-ms", type=float, default=None, help="length of one block")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the timing thread's CPU time (default); wall: perf_counter",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument(
        "--primitives",
        type=int,
        nargs="?",
        const=1000,
        default=None,
        metavar="TENSORS",
        help="time the per-tensor primitives a model check could use (default 1000 tensors)",
    )
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    if args.primitives is not None:
        print(report_primitives(primitives(args.primitives, args.blocks or 9), args.primitives))
        return 0
    blocks = args.blocks or (3 if args.quick else 15)
    block_s = (args.block_ms or (5 if args.quick else 40)) / 1e3
    todo = cases(args.quick)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": baseline_tree(args.baseline, Path(tmp)), "after": ROOT}
        worlds = sorted({c.world for c in todo})
        workers = {(label, w): Worker(tree, w) for label, tree in trees.items() for w in worlds}
        try:
            for w in workers.values():
                w.ready()
            samples: dict[tuple[str, Case], list[dict[str, float]]] = {}
            for block in range(blocks):
                for case in todo:
                    labels = list(trees) if block % 2 == 0 else list(reversed(trees))
                    for label in labels:
                        worker_ = workers[label, case.world]
                        result = worker_.block(case, block, block_s, args.clock)
                        samples.setdefault((label, case), []).append(result)
        finally:
            for w in workers.values():
                w.close()
    rows = []
    for case in todo:
        row: dict[str, Any] = {"case": case.name, **case.__dict__}
        for label in trees:
            got = samples[label, case]
            row[label] = {k: statistics.median(s[k] for s in got) for k in got[0]}
        row["bound"], row["met"] = bound(case, row["after"]["floor"], row["after"]["update"])
        rows.append(row)
    packages = {f"{label} W={w}": wk.package for (label, w), wk in workers.items()}
    print(
        f"before = {args.baseline}, after = this checkout; {blocks} blocks of ~"
        f"{block_s * 1e3:g} ms per row and tree, {args.clock} clock, median per call"
    )
    print(f"packages: {packages}\n")
    print(report(rows))
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"baseline": args.baseline, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
