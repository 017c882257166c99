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
naming the stuck ranks, with each one's Python stack (:mod:`faulthandler`, on
:data:`STACK_SIGNAL`). A rank's stdout and stderr go to ``output<rank>`` in its spawn's
folder: :func:`run_ranks` hands them to pytest's capture, which shows them with a failing
test only, and the failure of a rank that left no result ends with its output.

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

Scripts (the examples, the README's blocks, the benchmark drivers) run as a user types them,
forked from the same preloaded server: :func:`run_script` as ``python script.py`` and
:func:`run_torchrun` as ``torchrun --standalone --nproc_per_node=N script.py`` (each rank
with torchrun's environment and rendezvous store); ``run_torchrun(real=True)`` launches the
real ``torchrun`` where the launcher itself is under test.
"""

from __future__ import annotations

import faulthandler
import io
import os
import pickle
import shutil
import signal
import sys
import tempfile
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
_OUTPUT_TAIL = 6000
"""Characters of a rank's output that its failure message ends with."""

STACK_SIGNAL = signal.SIGUSR1
"""On this signal a rank writes every thread's Python stack to its output; :func:`spawn_ranks`
sends it to the ranks still running at the deadline before it terminates them."""


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
        on_output=_show_output,
    )
    if failures:
        pytest.fail(f"{fn.__name__} at W={world_size} failed:\n" + "\n".join(failures))
    return results


def _show_output(run_dir: Path, world_size: int) -> None:
    """Every rank's output, written to this process's stderr, which pytest captures and
    shows only for a failing test."""
    for rank in range(world_size):
        text = _output(run_dir, rank)
        if text:
            sys.stderr.write(f"----- {run_dir.name} rank {rank}'s output -----\n{text}")


def _output(run_dir: Path, rank: int) -> str:
    path = Path(run_dir) / f"output{rank}"
    return path.read_text(errors="replace") if path.exists() else ""


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
    on_output: Callable[[Path, int], None] | None = None,
) -> tuple[list[Any], list[str]]:
    """:func:`run_ranks` without pytest: ``(results of the ranks that returned, failures)``.

    ``backend`` (default :data:`BACKEND`) and ``start_method`` (default
    :data:`START_METHOD`) override the environment's; ``timeout_s`` is the process group's
    collective timeout. Every rank still alive when this returns or raises (a deadline, a
    failed rank's grace period, a ``KeyboardInterrupt`` or a caller's alarm) is terminated;
    those still running at the deadline first write their stacks to their output. The
    ranks' output stays in the spawn's folder (``output<rank>``); ``on_output(folder,
    world_size)`` is called once they have ended, also when this raises.
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
        if on_output is not None:
            on_output(run_dir, world_size)
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
            message = f"rank {rank}: exited with code {code} and no result"
            output = _output(run_dir, rank)[-_OUTPUT_TAIL:]
            failures.append(f"{message}; its output ends:\n{output}" if output else message)
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
    "olmo_core.train",
    "torchao.float8",
]
"""On gloo only, the extras' heavy imports (~1-2 s each per rank otherwise: the compat and
Lightning test modules import them at module level, so every rank does; torchtitan's
``Trainer`` ~3 s per rank of the torchtitan tests, which import it in the rank; OLMo-core's
trainer, also for the worker processes its datasets start from the rank; torchao's float8,
~5 s per rank of the tensor-subclass tests). A missing one is
skipped (the forkserver ignores ImportError). Not on CUDA backends: diffusers' import counts
CUDA devices, which must not happen in the process the ranks fork from. Nor in a script that
:func:`run_script` forked (a benchmark spawning its own ranks starts its own server, and
its rank bodies import none of them)."""

_in_forked_script = False
"""Set in the child of :func:`run_script` / :func:`run_torchrun`."""


def start_forkserver(log: Path | None = None) -> None:
    """Start the rank forkserver now, with :data:`BACKEND`'s preloads (it imports them in
    the background; the first rank or script waits for it then). Nothing under
    ``DTENSOR_EMA_TEST_START=spawn``. ``tests/conftest.py`` calls this at session start.

    ``log``: the file the server's own stdout and stderr go to (what its imports print)
    instead of this process's (ranks and scripts write to files of their own)."""
    if START_METHOD != "forkserver":
        return
    import multiprocessing.forkserver

    _context("forkserver", BACKEND)
    if log is None:
        multiprocessing.forkserver.ensure_running()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        multiprocessing.forkserver.ensure_running()  # the server inherits fds 1 and 2
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def _context(start_method: str, backend: str) -> Any:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(
            f"DTENSOR_EMA_TEST_START must be 'forkserver' or 'spawn', got {start_method!r}"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        extras = backend == "gloo" and not _in_forked_script
        ctx.set_forkserver_preload(_PRELOAD + (_PRELOAD_GLOO if extras else []))
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
            _dump_stacks(procs, run_dir)
            _terminate(procs)
            if late:
                return f"ranks {stuck} still running after the {deadline_s:.0f} s deadline"
            return None
        time.sleep(0.05)
    for p in procs:
        p.join()
    return None


def _dump_stacks(procs: list[Any], run_dir: Path, wait_s: float = 5.0) -> None:
    """Have every rank still alive write its stack to its output (:data:`STACK_SIGNAL`);
    return once each output has grown and stopped growing (``wait_s`` at most)."""
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    paths = [run_dir / f"output{r}" for r in alive]

    def sizes() -> list[int]:
        return [p.stat().st_size if p.exists() else 0 for p in paths]

    before, last = sizes(), None
    for r in alive:
        os.kill(procs[r].pid, STACK_SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = sizes()
        if now == last and all(n > b for n, b in zip(now, before, strict=True)):
            return
        last = now


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
    output = os.open(os.path.join(run_dir, f"output{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
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
    sys.stdout.flush()
    sys.stderr.flush()
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
    (``merge_output``: stderr is written into stdout, ``stderr`` is empty). ``argv`` may
    also start ``["-m", module]``, as ``python -m module`` would.

    What the script sees is what ``python script.py`` gives it: its own globals and
    ``__main__`` module (``__file__`` absolute), ``sys.argv``, the working directory,
    the environment, and ``sys.path`` = the script's folder (``-m``: the working
    directory), ``PYTHONPATH``, then the interpreter's own paths (not the test folder). An
    uncaught exception prints its traceback and exits 1. At the end its non-daemon threads
    are joined, as the interpreter's exit does, and it ends with ``os._exit`` after
    flushing, without the interpreter's exit handlers. Modules the server preloaded were
    imported once, with the server's environment (an import-time read of a variable the
    script's ``env`` changes sees the old value). ``DTENSOR_EMA_TEST_START=spawn`` runs a new
    interpreter instead. A run past ``timeout_s`` fails the calling test.
    """
    if START_METHOD != "forkserver":
        return _subprocess([sys.executable, *argv], cwd, env, timeout_s, merge_output)
    return _forked(argv, cwd, [env], timeout_s, merge_output)


FORKED_TORCHRUN = START_METHOD == "forkserver" and BACKEND == "gloo"
"""Whether :func:`run_torchrun` forks its ranks (else it launches the real ``torchrun``)."""


def run_torchrun(
    argv: list[str],
    nproc: int,
    cwd: Path,
    env: dict[str, str],
    *,
    timeout_s: float = 300.0,
    merge_output: bool = False,
    real: bool = False,
) -> tuple[int, str, str]:
    """What ``torchrun --standalone --nproc_per_node=nproc argv...`` does, in ``cwd`` with
    ``env``: ``nproc`` ranks of ``python -u argv...`` (``argv`` a script and its arguments,
    or ``["-m", module, ...]``), each a fresh ``__main__`` forked from the rank forkserver
    as :func:`run_script` runs one (the same globals, ``sys.argv``, ``sys.path``, working
    directory, exit codes and tracebacks), without torchrun's own interpreter and the ranks'
    imports (~10-20 s per launch on 2 busy cores). Returns ``(exit code, stdout, stderr)``
    with every rank's output in one stream each, as torchrun's (``merge_output``: one
    stream), line by line: a line (up to 8 KiB) is never cut by another rank's output,
    where torchrun's unbuffered ranks may cut one between its text and its newline.

    Each rank gets torchrun's environment: ``env`` plus ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
    ``ROLE_RANK``, ``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
    ``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_SIGNALS_TO_HANDLE``,
    ``TORCHELASTIC_ERROR_FILE`` (a file per rank in a scratch folder, for torch's
    ``@record``) and ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, and
    ``OMP_NUM_THREADS=1`` when ``env`` has none and ``nproc > 1``. As under torchrun, a
    ``TCPStore`` is served at ``MASTER_ADDR:MASTER_PORT`` by the launcher (here, this
    process, on a port the OS picks: parallel runs cannot collide) and every rank's
    ``init_process_group`` (``env://``) joins it as a client.

    The exit code is 0 when every rank exits 0, else 1, as torchrun's; when a rank fails
    (a nonzero exit or a signal) the others are terminated, as torchrun's agent does, and
    a line ``run_torchrun: rank R (local_rank: R) exited with code C`` per failed rank
    ends the error stream (the first one is the root cause). A launch past ``timeout_s``
    fails the calling test, naming the ranks still running.

    ``real`` (and ``DTENSOR_EMA_TEST_START=spawn``, or a backend other than gloo, where the
    examples choose CUDA) launches the real ``python -m torch.distributed.run`` instead:
    tests about the launcher itself (the README's ``torchrun`` command) keep it.
    """
    if real or not FORKED_TORCHRUN:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={nproc}", *argv]
        return _subprocess(command, cwd, env, timeout_s, merge_output)
    errors = Path(tempfile.mkdtemp(prefix="torchelastic_"))  # each rank's @record file
    store = dist.TCPStore(
        "localhost",
        0,
        None,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    try:
        base = dict(env)
        if nproc > 1:
            base.setdefault("OMP_NUM_THREADS", "1")
        run_id = str(uuid.uuid4())
        envs = [
            {
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1",
                "ROLE_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "localhost",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                "TORCHELASTIC_ERROR_FILE": str(errors / str(rank) / "error.json"),
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            }
            for rank in range(nproc)
        ]
        for rank in range(nproc):
            (errors / str(rank)).mkdir(parents=True)
        return _forked(argv, cwd, envs, timeout_s, merge_output, as_ranks=True)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _subprocess(
    command: list[str], cwd: Path, env: dict[str, str], timeout_s: float, merge_output: bool
) -> tuple[int, str, str]:
    """``command`` as a new process group (so a timeout ends it and every process it
    started), failing the calling test with its output's tail past ``timeout_s``."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tail = (out + (err or ""))[-4000:]
        pytest.fail(f"{' '.join(command[1:])} ran past {timeout_s} s; output tail:\n{tail}")
    return proc.returncode, out, err or ""


def _forked(
    argv: list[str],
    cwd: Path,
    envs: list[dict[str, str]],
    timeout_s: float,
    merge_output: bool,
    as_ranks: bool = False,
) -> tuple[int, str, str]:
    """One forked ``__main__`` per entry of ``envs`` (rank ``r`` gets ``envs[r]``), all
    writing to one stdout and one stderr file; see :func:`run_script` and
    :func:`run_torchrun` (``as_ranks``: its exit code, termination and summary lines)."""
    out_dir = Path(tempfile.mkdtemp(prefix="dtensor-ema-run-"))
    out, err = out_dir / "stdout", out_dir / "stderr"
    ctx = _context("forkserver", BACKEND)
    procs = [
        ctx.Process(
            target=_script_entry,
            args=(argv, str(cwd), env, str(out), str(out if merge_output else err)),
            name=f"rank{rank}",
        )
        for rank, env in enumerate(envs)
    ]
    failed: list[int] = []  # ranks in the order their failure was seen
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs):
            failed += [r for r, p in enumerate(procs) if p.exitcode and r not in failed]
            if as_ranks and failed:
                break  # torchrun's agent ends the other ranks once one failed
            if time.monotonic() > deadline:
                stuck = [p.name for p in procs if p.is_alive()]
                _terminate(procs)
                tail = "".join(p.read_text(errors="replace") for p in {out, err} if p.exists())
                tail = tail[-4000:]
                pytest.fail(
                    f"{' '.join(argv)[:300]} ({stuck} still running) ran past {timeout_s} s; "
                    f"output tail:\n{tail}"
                )
            time.sleep(0.05)
    finally:
        _terminate(procs)
    ended = [r for r, p in enumerate(procs) if p.exitcode and r not in failed]
    if not failed:  # every rank had exited when the loop looked last
        failed, ended = ended, []
    texts = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
    shutil.rmtree(out_dir, ignore_errors=True)
    if merge_output:
        texts[1] = ""
    if not as_ranks:
        code = procs[0].exitcode
        return (code if code is not None else -1), texts[0], texts[1]
    summary = "".join(
        f"run_torchrun: rank {r} (local_rank: {r}) exited with code {procs[r].exitcode}\n"
        for r in failed
    ) + "".join(f"run_torchrun: rank {r} terminated after rank {failed[0]} failed\n" for r in ended)
    texts[0 if merge_output else 1] += summary
    return (1 if failed or ended else 0), texts[0], texts[1]


def _script_entry(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked child of :func:`run_script` and :func:`run_torchrun`."""
    global _in_forked_script
    _in_forked_script = True
    import builtins
    import importlib.machinery
    import runpy
    import threading
    import types

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    os.dup2(os.open(out, flags), 1)
    os.dup2(os.open(err, flags), 2)
    # Ranks share the files, as torchrun's ranks share its streams: each line goes out in one
    # write (up to 8 KiB), so the lines of two ranks never mix (``print`` writes the text and
    # the newline separately, which an unbuffered stream passes on as two writes).
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)
    module = argv[1] if argv[0] == "-m" else None
    script = os.path.abspath(argv[0])  # unused with -m
    tests = os.path.dirname(os.path.abspath(__file__))
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    own = [p for p in sys.path if p and os.path.abspath(p) != tests and p != cwd]
    sys.path[:] = [cwd if module else os.path.dirname(script), *python_path, *own]
    sys.argv[:] = list(argv[1:] if module else argv)
    if env.get("OMP_NUM_THREADS"):  # else torch's default, as in a new interpreter
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:  # what the interpreter does for `python script.py` (argv[0] as typed)
            main = types.ModuleType("__main__")
            main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins)
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
            sys.modules["__main__"] = main
            with open(script, "rb") as f:
                source = f.read()
            exec(compile(source, script, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # the traceback from the script's frame on, as python's
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 1
    # What the interpreter's exit does first: threading's exit hooks run (concurrent.futures
    # tells its idle worker threads to stop; an executor the script never shut down would
    # otherwise wait forever), then the non-daemon threads are joined.
    threading._shutdown()  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
