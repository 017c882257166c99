"""Run a function on W ranks (processes; CPU gloo by default) and hand the results back to
pytest.

One spawn costs ~5-15 s (every rank imports torch), so a test module runs one *scenario
body* per world size, which performs many checks and returns plain values; the test
functions then assert on those values in the pytest process. Ranks never assert on their
own, so no rank can leave the others hanging in a collective: a rank that raises reports
its traceback, and the harness terminates the rest.

Guarantees: fresh processes (:data:`START_METHOD`); a fresh ``FileStore`` under
``tmp_path`` (no ports, so parallel runs cannot collide); ``destroy_process_group`` in
``finally``; an overall deadline after which every rank is terminated and the test fails
naming the stuck ranks.

``DTENSOR_EMA_TEST_BACKEND`` picks the ranks' devices and group (:data:`BACKENDS`):

* ``gloo`` (default): CPU ranks, a ``gloo`` group.
* ``nccl`` (set by ``nox -s tests_nccl``): one rank per GPU, rank ``r`` on ``cuda:r``, the
  group ``cpu:gloo,cuda:nccl`` (CPU tensors keep working); a world size larger than the
  visible GPU count is skipped.
* ``gloo-cuda``: any number of ranks sharing the visible GPUs, rank ``r`` on
  ``cuda:(r % count)`` (all on one device with one GPU), the group ``cpu:gloo,cuda:gloo``:
  gloo copies CUDA tensors through pinned host memory where it supports the collective on
  CUDA (torch's ``ProcessGroupGloo``: all-reduce, broadcast, all-gather and the flat
  all-gather built on it, gather, scatter; reduce-scatter as an all-reduce of a copy),
  so several ranks' CUDA paths run on one GPU, where NCCL refuses two ranks per device.
  Skipped without CUDA.

Test bodies that want to follow the backend build their meshes and tensors on
:data:`DEVICE_TYPE`. :func:`spawn_ranks` is the same machinery without pytest (for
``benchmarks/gpu_suite.py``): it returns the failures instead of failing a test.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("gloo", "nccl", "gloo-cuda")
BACKEND = os.environ.get("DTENSOR_EMA_TEST_BACKEND", "gloo")
if BACKEND not in BACKENDS:
    raise ValueError(f"DTENSOR_EMA_TEST_BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
DEVICE_TYPE = "cpu" if BACKEND == "gloo" else "cuda"
"""Device type of the ranks' tensors and meshes: ``cpu`` on gloo, ``cuda`` otherwise."""

GROUP_BACKEND = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl", "gloo-cuda": "cpu:gloo,cuda:gloo"}
"""The ``init_process_group`` backend string of each :data:`BACKENDS` entry."""

DEFAULT_DEADLINE_S = 300.0
_GRACE_AFTER_FAILURE_S = 10.0


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    deadline_s: float = DEFAULT_DEADLINE_S,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results.

    ``fn`` must be a module-level function (it is pickled by reference) and return a
    picklable value. With ``init_process_group`` each rank joins a group of
    :data:`BACKEND` first. A failing or stuck rank fails the calling test with its rank and
    traceback.
    """
    if BACKEND != "gloo" and init_process_group:
        gpus = torch.cuda.device_count()
        if BACKEND == "nccl" and gpus < world_size:
            pytest.skip(f"W={world_size} on nccl needs {world_size} GPUs, {gpus} visible")
        if gpus == 0:
            pytest.skip(f"no CUDA: DTENSOR_EMA_TEST_BACKEND={BACKEND} needs a GPU")
    results, failures = spawn_ranks(
        fn,
        world_size,
        tmp_path,
        *args,
        deadline_s=deadline_s,
        init_process_group=init_process_group,
        env=env,
    )
    if failures:
        pytest.fail(f"{fn.__name__} at W={world_size} failed:\n" + "\n".join(failures))
    return results


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    deadline_s: float = DEFAULT_DEADLINE_S,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    backend: str | None = None,
    start_method: str | None = None,
    timeout_s: float = 120.0,
) -> tuple[list[Any], list[str]]:
    """:func:`run_ranks` without pytest: ``(results of the ranks that returned, failures)``.

    ``backend`` (default :data:`BACKEND`) and ``start_method`` (default
    :data:`START_METHOD`) override the environment's; ``timeout_s`` is the process group's
    collective timeout. Every rank still alive when this returns or raises (a deadline, a
    failed rank's grace period, a ``KeyboardInterrupt`` or a caller's alarm) is terminated.
    """
    backend = backend or BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    run_dir = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    ctx = _context(start_method or START_METHOD, backend)
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(
                fn,
                rank,
                world_size,
                str(run_dir),
                init_process_group,
                env or {},
                backend,
                timeout_s,
                args,
            ),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        late = _wait(procs, run_dir, deadline_s)
    finally:
        _terminate(procs)
    results, failures = outcomes(run_dir, world_size, [p.exitcode for p in procs])
    return results, ([late] if late else []) + failures


def outcomes(
    run_dir: Path, world_size: int, exitcodes: list[int | None] | None = None
) -> tuple[list[Any], list[str]]:
    """``(results, failures)`` the ranks of one spawn left in ``run_dir`` (the
    ``ranks-*`` folder :func:`spawn_ranks` makes under its ``tmp_path``): also readable
    after a caller's alarm interrupted :func:`spawn_ranks`."""
    results, failures = [], []
    for rank in range(world_size):
        path = Path(run_dir) / f"result{rank}.pkl"
        if not path.exists():
            code = exitcodes[rank] if exitcodes else "?"
            failures.append(f"rank {rank}: exited with code {code} and no result")
            continue
        with path.open("rb") as f:
            ok, value = pickle.load(f)
        if ok:
            results.append(value)
        else:
            failures.append(f"rank {rank} raised:\n{value}")
    return results, failures


def _terminate(procs: list[Any]) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


START_METHOD = os.environ.get("DTENSOR_EMA_TEST_START", "forkserver")
"""How ranks start: ``forkserver`` (default) forks every rank from one server process that
imported torch (and the extras the compat tests import) once, so a spawn costs a fork
instead of W fresh imports; ``spawn`` starts each rank from scratch (set
``DTENSOR_EMA_TEST_START=spawn``). Neither shares the pytest process's state with the
ranks."""

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "dtensor_ema",
    "dist_harness",
]
_PRELOAD_GLOO = [
    "lightning.pytorch",
    "diffusers.training_utils",
    "timm.utils",
    "torchtitan.trainer",
]
"""On gloo only, the extras' heavy imports (~1-2 s each per rank otherwise: the compat and
Lightning test modules import them at module level, so every rank does; torchtitan's
``Trainer`` ~3 s per rank of the torchtitan tests, which import it in the rank). A missing one is
skipped (the forkserver ignores ImportError). Not on CUDA backends: diffusers' import counts
CUDA devices, which must not happen in the process the ranks fork from."""


def _context(start_method: str, backend: str) -> Any:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"DTENSOR_EMA_TEST_START must be 'forkserver' or 'spawn', got {start_method!r}"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD + (_PRELOAD_GLOO if backend == "gloo" else []))
    return ctx


def _wait(procs: list[Any], run_dir: Path, deadline_s: float) -> str | None:
    """Wait for the ranks; a message naming the stuck ranks if the deadline passed."""
    start = time.monotonic()
    first_failure: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if first_failure is None and any(
            (run_dir / f"failed{r}").exists() for r in range(len(procs))
        ):
            first_failure = now
        late = now - start > deadline_s
        abandoned = first_failure is not None and now - first_failure > _GRACE_AFTER_FAILURE_S
        if late or abandoned:
            stuck = [p.name for p in procs if p.is_alive()]
            _terminate(procs)
            if late:
                return f"ranks {stuck} still running after the {deadline_s:.0f} s deadline"
            return None
        time.sleep(0.05)
    for p in procs:
        p.join()
    return None


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    run_dir: str,
    init_process_group: bool,
    env: dict[str, str],
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    result: tuple[bool, Any]
    try:
        if init_process_group:
            store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
            if backend == "nccl":
                torch.cuda.set_device(rank)
            elif backend == "gloo-cuda":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                GROUP_BACKEND[backend],
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        result = (True, fn(rank, world_size, *args))
    except BaseException:
        result = (False, traceback.format_exc())
        Path(run_dir, f"failed{rank}").touch()
    with open(os.path.join(run_dir, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def aborted_at_exit(returncode: int, output: str) -> bool:
    """Whether a subprocess that ran a script died of torch 2.14 + gloo's abort at interpreter
    exit: a gloo worker thread drops an all-gather's tensors after the main thread began
    finalizing, and its GIL acquire ends in ``std::terminate`` (pytorch/pytorch#190489;
    ``../shared/NOTES.md``). The subprocess tests run such a script once more: a second
    failure fails the test."""
    return returncode != 0 and "terminate called without an active exception" in output


def require_extra(module: str, extra: str) -> None:
    """Skip the calling test module when ``module`` is not installed, except under CI
    (``CI`` set), where a missing extra must fail rather than hide the tests."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return
    message = f"needs the {extra!r} extra: pip install -e '.[test,{extra}]'"
    if os.environ.get("CI"):
        raise RuntimeError(f"{message} (CI must run these tests, not skip them)")
    pytest.skip(message, allow_module_level=True)


def run_script(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    *,
    timeout_s: float = 300.0,
    merge_output: bool = False,
) -> tuple[int, str, str]:
    """Run ``python argv[0] argv[1:]`` in ``cwd`` with ``env`` as a fresh ``__main__``
    forked from the rank forkserver (torch, this package and the extras already imported:
    ~4-8 s less per run than a new interpreter). Returns ``(exit code, stdout, stderr)``
    (``merge_output``: stderr is written into stdout, ``stderr`` is empty).

    What the script sees is what ``python script.py`` gives it: its own globals,
    ``sys.argv`` (``argv[0]`` made absolute, as ``__file__`` is), the working directory,
    the environment, and ``sys.path`` = the script's folder, ``PYTHONPATH``, then the
    interpreter's own paths (not the test folder). An uncaught exception prints its
    traceback and exits 1. It ends with ``os._exit`` after flushing, without the
    interpreter's exit handlers. ``DTENSOR_EMA_TEST_START=spawn``
    runs a new interpreter instead.
    """
    if START_METHOD != "forkserver":
        import subprocess

        result = subprocess.run(
            [sys.executable, *argv],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        return result.returncode, result.stdout, result.stderr
    out_dir = Path(cwd) / f".run-{uuid.uuid4().hex[:8]}"
    out_dir.mkdir()
    out, err = out_dir / "stdout", out_dir / "stderr"
    ctx = _context("forkserver", "gloo")
    proc = ctx.Process(
        target=_script_entry,
        args=(argv, str(cwd), env, str(out), str(out if merge_output else err)),
    )
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        tail = out.read_text(errors="replace")[-4000:] if out.exists() else ""
        pytest.fail(f"{argv[0]} ran past {timeout_s} s; output tail:\n{tail}")
    code = proc.exitcode if proc.exitcode is not None else -1
    texts = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
    if merge_output:
        texts[1] = ""
    for p in (out, err):
        p.unlink(missing_ok=True)
    out_dir.rmdir()
    return code, texts[0], texts[1]


def _script_entry(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked child of :func:`run_script`."""
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    os.dup2(os.open(out, flags), 1)
    os.dup2(os.open(err, flags), 2)
    script = os.path.abspath(argv[0])
    tests = os.path.dirname(os.path.abspath(__file__))
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    own = [p for p in sys.path if p and os.path.abspath(p) != tests and p != cwd]
    sys.path[:] = [os.path.dirname(script), *python_path, *own]
    sys.argv[:] = list(argv)
    if env.get("OMP_NUM_THREADS"):  # else torch's default, as in a new interpreter
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
