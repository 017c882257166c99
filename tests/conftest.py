"""Session setup: start the rank forkserver while pytest collects.

The forkserver (``dist_harness``) imports torch, this package and the extras once, ~10-20 s
of one core; collecting the suite imports the same libraries in this process for about as
long. Started at session start, the two run side by side on two cores instead of one after
the other. Only when the paths pytest was given hold a test that launches processes through
the harness (a run of single-process tests starts no server). What the server's imports
print goes to ``dtensor-ema-forkserver-<pid>.log`` in the temporary folder, kept when the
session fails.

Also a quiet log: torch's profiler (``torch.profiler.profile``, which several tests use to
count collectives) runs Kineto, whose C++ logger writes ``USDT: ...
SyncActivityProfilerHandler.cpp ... profiler_start`` / ``profiler_stop`` (and, with no GPU,
``ERROR: ... gpuGetDeviceCount failed``) to the process's stderr on every profile, from
every rank: hundreds of lines between pytest's dots. Kineto reads ``KINETO_LOG_LEVEL``
when the first profile starts (0 verbose ... 5 USDT, its highest; 6 lets nothing through).
Set here, before any test runs and before the rank forkserver starts, it reaches this
process and every rank; a value already in the environment is kept. Libraries overwrite it
with 5 (USDT lines on) when they are imported or set up (``ultralytics.utils``, torchtitan's
``init_logger``), and every process launched later copies the overwritten value, so it is
set again before each test.

And a share of the cores per pytest worker: under ``pytest -n N`` each worker (and what it
launches: the rank forkserver, scripts, through ``OMP_NUM_THREADS``) gets ``cores // N``
threads (at least one), unless ``OMP_NUM_THREADS`` is set. torch's default, one OpenMP thread
per core in every process, puts two threads per core with ``-n 2`` on 2 cores, and each
parallel region then waits for a thread the OS descheduled: a ResNet-18 test took 32 s
instead of 3.9 s on a busy 2-core machine.

And the longest modules first: with ``--dist loadfile`` xdist hands a worker the next whole
module when it runs low, in the order the workers collected them (its own reordering, by
number of tests, is turned off here: it put the two heaviest few-test modules last, and the
other worker finished minutes earlier). :data:`LONGEST_FIRST` lists the slow modules by
their measured time; the rest follow, most tests first. A stale list costs time, never a
result: every module still runs whole on one worker.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

_KINETO_LOG_LEVEL = os.environ.setdefault("KINETO_LOG_LEVEL", "6")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set in xdist's workers
if _WORKERS:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_CORES or 1) // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

_LAUNCHES = re.compile(r"\b(run_ranks|spawn_ranks|run_script|run_torchrun)\(")


LONGEST_FIRST = (
    "test_gpu_suite_smoke.py",
    "test_benchmarks_smoke.py",
    "test_core_distributed.py",
    "test_fsdp_distributed.py",
    "test_model_zoo.py",
    "test_deepspeed_distributed.py",
    "test_integration_torchtitan.py",
    "test_examples_smoke.py",
    "test_subclass_distributed.py",
    "test_checkpoint_object_storage.py",
    "test_readme.py",
    "test_compat_upstream.py",
    "test_checkpoint_distributed.py",
    "test_integration_deepspeed.py",
    "test_compat_posthoc.py",
    "test_ema_module.py",
    "test_ema_module_tp_distributed.py",
    "test_checkpoint_trust.py",
    "test_nd_mesh_distributed.py",
    "test_fuzz.py",
)
"""The modules that take longest under ``-n 2`` (``--durations``, 2 cores), longest first."""


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False  # xdist keeps the order below


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """:data:`LONGEST_FIRST`, then the other modules, most tests first; a module's tests
    stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    count = Counter(item.path for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path], item.path))


def _launches(paths: list[Path]) -> bool:
    for path in paths:
        files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        for file in files:
            if file.suffix == ".py" and file.is_file() and _LAUNCHES.search(file.read_text()):
                return True
    return False


_FORKSERVER_LOG = pytest.StashKey[Path]()


def pytest_sessionstart(session: pytest.Session) -> None:
    args = session.config.args or [str(session.config.rootpath)]
    paths = [Path(session.config.invocation_params.dir, a.split("::")[0]) for a in args]
    if _launches(paths):
        import tempfile

        import dist_harness

        log = Path(tempfile.gettempdir(), f"dtensor-ema-forkserver-{os.getpid()}.log")
        session.config.stash[_FORKSERVER_LOG] = log
        dist_harness.start_forkserver(log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The forkserver's log is kept for a failed session only (one file per session would
    pile up in the temporary folder)."""
    log = session.config.stash.get(_FORKSERVER_LOG, None)
    if log is not None and exitstatus == 0:
        log.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _quiet_profiler() -> None:
    """The session's ``KINETO_LOG_LEVEL`` again, whatever an import since changed it to."""
    os.environ["KINETO_LOG_LEVEL"] = _KINETO_LOG_LEVEL
