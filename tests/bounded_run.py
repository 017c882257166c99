"""Run readers on crafted inputs, one after the other in this process, and report each
one's outcome, wall time and peak extra resident memory: the subprocess that
``tests/test_bounded_readers.py`` measures (issue 42).

Usage: ``python tests/bounded_run.py cases.json`` where each case is ``{"name", "call",
"args"}``; ``call`` names a function below. Prints one JSON line per case: ``name``,
``outcome`` (``"ok"``, or the exception's type), ``message``, ``value`` (what the call
returned, when JSON), ``seconds`` (wall), ``cpu_seconds`` (this process's CPU time: what a
quiet machine's wall time would be, on a shared one) and ``peak_mib`` (the high-water mark
of resident memory during the case, less the resident memory before it:
``/proc/self/clear_refs`` resets it).

Guards, so that a reader that is not bounded (today's ``main``) fails its case instead of
the machine: the address space is limited to what the process holds at start plus
:data:`HEADROOM` (a claim of gigabytes raises ``MemoryError``/``RuntimeError``), and a case
that runs past :data:`CASE_SECONDS` is interrupted (``SIGALRM``) and reported as
``"Timeout"``.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HEADROOM = 3 << 30
CASE_SECONDS = 30


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``, ``VmSize``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start a new high-water mark of resident memory (``VmHWM``)."""
    Path("/proc/self/clear_refs").write_text("5")


class Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Timeout(f"still running after {CASE_SECONDS} s")


# ------------------------------------------------------------------------ the calls
def load(path: str, verify: Any = True) -> dict[str, Any]:
    """``load_checkpoint`` into a fresh EMA of the tests' small model; on failure, whether
    the EMA was left as it was."""
    import torch
    from models import reader_model

    from dtensor_ema import ModelEMA, load_checkpoint

    ema = ModelEMA(reader_model(), decay=0.5, tau=None)
    before = {k: v.clone() for k, v in ema.ema_tensors().items()}
    try:
        load_checkpoint({"ema": ema}, path, verify=verify)
    except BaseException as e:
        untouched = ema.updates == 0 and all(
            torch.equal(ema.ema_tensors()[k], v) for k, v in before.items()
        )
        e.add_note(f"untouched={untouched}")
        raise
    return {"updates": ema.updates}


def convert(path: str, out: str, verify: Any = True) -> dict[str, Any]:
    """``convert_checkpoint``; returns the names, shapes and a checksum of what it wrote."""
    from dtensor_ema import convert_checkpoint

    got = convert_checkpoint(path, out, verify=verify)
    return {k: [list(v.shape), float(v.double().sum())] for k, v in got.items()}


def synthesize(path: str, sigma_rel: float) -> dict[str, Any]:
    from dtensor_ema import synthesize as run

    got = run(path, sigma_rel)
    return {k: [list(v.shape), float(v.double().sum())] for k, v in got.items()}


def cli(argv: list[str]) -> dict[str, Any]:
    """``python -m dtensor_ema.posthoc`` in this process: its exit status and stderr."""
    from dtensor_ema.posthoc.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
    return {"rc": rc, "stderr": err.getvalue(), "stdout_lines": out.getvalue().count("\n")}


def coverage(shape: list[int], chunks: list[list[list[int]]]) -> str | None:
    from dtensor_ema.checkpoint.reader import coverage_problem

    return coverage_problem(shape, [(o, s) for o, s in chunks])


CALLS = {"load": load, "convert": convert, "synthesize": synthesize, "cli": cli}
CALLS["coverage"] = coverage


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (imported before the baseline: not counted in any case)

    import dtensor_ema
    import dtensor_ema.posthoc.cli  # noqa: F401

    limit = proc_status("VmSize") + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    for case in cases:
        reset_peak()
        before = proc_status("VmRSS")
        start, cpu = time.perf_counter(), time.process_time()
        signal.alarm(CASE_SECONDS)
        report: dict[str, Any] = {"name": case["name"]}
        try:
            value = CALLS[case["call"]](*case["args"])
            report.update(outcome="ok", message="", value=value)
        except BaseException as e:  # everything is reported: what raised is the finding
            notes = " ".join(getattr(e, "__notes__", []))
            report.update(outcome=type(e).__name__, message=str(e)[:2000], notes=notes)
        finally:
            signal.alarm(0)
        report["seconds"] = time.perf_counter() - start
        report["cpu_seconds"] = time.process_time() - cpu
        report["peak_mib"] = (proc_status("VmHWM") - before) / 2**20
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
