"""Every ``python`` code block of README.md and of the docs pages (``docs/**/*.md``) runs as
written, on CPU.

The blocks are extracted the way ``.ci/run`` extracts the test command, written to a
scratch directory and run there: with ``torchrun`` when the block's first line says so
(``# torchrun --standalone --nproc_per_node=N file.py``), else as ``python snippet.py``
would. The first torchrun block runs under the real ``torchrun``; every other block is a
fresh ``__main__`` forked from the test ranks' preloaded server (``dist_harness.run_script``,
or ``run_torchrun`` with torchrun's environment and rendezvous store for each rank: the
same globals, path and environment, without paying the imports again). A snippet
that needs a GPU, a variable it never defines, or a process group it never creates fails
here. A block that appears in several pages (the README's layout examples are repeated in
``docs/sharding.md``) runs once.

A block that cannot run here (it needs a GPU, a download, another library's training
script) is marked on the line right before it with ``<!-- not-run: <reason> -->``; such
blocks are counted, never silently dropped.

Every ``from dtensor_ema... import ...`` written in backticks in those pages (the migration
one-liners, for instance) must import: a page cannot name a module or class that does not
exist.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

import pytest
from dist_harness import FORKED_TORCHRUN, aborted_at_exit, run_script, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
_NOT_RUN = re.compile(r"<!-- not-run: .+ -->\s*$")
_TORCHRUN = re.compile(r"^# torchrun .*--nproc_per_node=(\d+) (\S+\.py)")
_IMPORT = re.compile(r"`(from (dtensor_ema[\w.]*) import ([\w, ]+))`")


def _blocks(path: Path) -> tuple[list[str], int]:
    """The runnable blocks of one page, and how many it marks not-run."""
    text = path.read_text()
    blocks, not_run = [], 0
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if _NOT_RUN.search(before):
            not_run += 1
            continue
        indent = len(match.group(1))
        blocks.append("\n".join(line[indent:] for line in match.group(2).splitlines()))
    return blocks, not_run


def collect() -> tuple[dict[str, str], int]:
    """``{"page:index": code}`` over every page, identical blocks once; and the not-run count."""
    unique: dict[str, str] = {}
    seen: set[str] = set()
    not_run = 0
    for path in PAGES:
        blocks, skipped = _blocks(path)
        not_run += skipped
        for index, code in enumerate(blocks):
            if code not in seen:
                seen.add(code)
                unique[f"{path.relative_to(ROOT)}:{index}"] = code
    return unique, not_run


BLOCKS, NOT_RUN = collect()
REAL_TORCHRUN = next((k for k, code in BLOCKS.items() if _TORCHRUN.match(code)), None)
"""The first ``torchrun`` block runs under the real ``torchrun``; the others get what it
gives each rank from ``dist_harness.run_torchrun`` (forked from the preloaded server)."""
_EXTRAS = {
    "lightning": "lightning",
    "transformers": "transformers",
    "peft": "transformers",
    "timm": "bench",
    "deepspeed": "deepspeed",
}
"""Blocks that import these modules need the named extra of the project."""


def test_pages_have_python_blocks() -> None:
    readme, _ = _blocks(ROOT / "README.md")
    assert len(readme) >= 3, "the README keeps one example per layout"
    assert len(BLOCKS) >= 10
    print(f"{len(BLOCKS)} distinct python blocks run; {NOT_RUN} marked not-run")


@pytest.mark.parametrize("key", list(BLOCKS))
def test_block_runs_as_written(key: str, tmp_path: Path) -> None:
    code = BLOCKS[key]
    for module, extra in _EXTRAS.items():
        if re.search(rf"^(import|from) {module}\b", code, re.MULTILINE):
            pytest.importorskip(module, reason=f"needs the {extra} extra")
    first = code.splitlines()[0] if code else ""
    launch = _TORCHRUN.match(first)
    name = launch.group(2) if launch else "snippet.py"
    (tmp_path / name).write_text(code + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = ["python", name]
    if launch:
        command = ["torchrun", "--standalone", f"--nproc_per_node={launch.group(1)}", name]
    for attempt in range(2):
        if launch:  # the first torchrun block under the real torchrun, the others forked
            returncode, stdout, stderr = run_torchrun(
                [name],
                int(launch.group(1)),
                tmp_path,
                env,
                timeout_s=300,
                real=key == REAL_TORCHRUN,
            )
        else:  # one process: a fresh __main__ forked from the preloaded rank server
            returncode, stdout, stderr = run_script([name], tmp_path, env, timeout_s=300)
        if attempt or not aborted_at_exit(returncode, stderr):
            break
    assert returncode == 0, (
        f"block {key} ({' '.join(command)}) failed:\n{code}\n"
        f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}"
    )


def _imports() -> dict[str, tuple[str, list[str]]]:
    """``{import line: (module, names)}`` of every backticked dtensor_ema import."""
    found = {}
    for path in PAGES:
        for match in _IMPORT.finditer(path.read_text()):
            names = [n.strip() for n in match.group(3).split(",") if n.strip()]
            found[match.group(1)] = (match.group(2), names)
    return found


IMPORTS = _imports()


@pytest.mark.parametrize("line", sorted(IMPORTS))
def test_documented_import_exists(line: str) -> None:
    module, names = IMPORTS[line]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and not error.name.startswith("dtensor_ema"):
            pytest.skip(f"{line!r} needs {error.name}")
        raise
    missing = [name for name in names if not hasattr(mod, name)]
    assert not missing, f"{line!r}: {module} has no {missing}"


def test_a_forked_block_fails_as_python_would(tmp_path: Path) -> None:
    """``run_script`` gives a block what ``python snippet.py`` would: a name it never
    imported is undefined (torch is loaded in the server, not in the block's globals), the
    test folder is not on the path, ``sys.exit`` codes and tracebacks come back, and a
    thread pool left open ends at exit as python ends it (an offloaded EMA's worker)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cases = {
        "uses_torch_unimported.py": ("x = torch.zeros(1)\n", 1, "NameError: name 'torch'"),
        "imports_a_test_helper.py": ("import models\n", 1, "No module named 'models'"),
        "exits.py": ("import sys\nprint('out')\nsys.exit(3)\n", 3, ""),
        "leaves_an_executor.py": (  # python's exit stops its idle workers; so must ours
            "from concurrent.futures import ThreadPoolExecutor\n"
            "pool = ThreadPoolExecutor(max_workers=1)\npool.submit(int).result()\n",
            0,
            "",
        ),
        "works.py": ("import sys, torch\nprint(sys.argv[1:], torch.ones(2).sum().item())", 0, ""),
    }
    for name, (code, want_code, want_err) in cases.items():
        (tmp_path / name).write_text(code)
        returncode, stdout, stderr = run_script([name, "--flag"], tmp_path, env, timeout_s=120)
        assert returncode == want_code and want_err in stderr, (name, returncode, stderr)
    assert stdout == "['--flag'] 2.0\n" and stderr == ""


_PROBE = """\
import json, os, sys, time

rank = os.environ.get("RANK", "?")
seen = {"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0]}
seen["name"], seen["file"] = __name__, __file__
with open(f"seen-{sys.argv[-1]}-{rank}.json", "w") as f:
    json.dump(seen, f)
if sys.argv[-1] == "collective":
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {rank}: sum {t.item()}")
    dist.destroy_process_group()
if sys.argv[-1] == "fail" and rank == "1":
    raise ValueError("rank 1 fails")
if sys.argv[-1] == "hang" and rank == "1":
    time.sleep(120)
"""


def test_forked_ranks_get_what_torchrun_gives(tmp_path: Path) -> None:
    """``run_torchrun`` gives each rank what the real ``torchrun --standalone`` gives it
    (compared on one real launch): the same added environment variables (the rendezvous
    port, run id and error file aside, which change per launch), ``sys.argv``, working
    directory, ``sys.path[0]`` and ``__main__``; ``-m module`` as ``python -m`` runs it; a
    working rendezvous store for ``init_process_group``; a failing rank fails the launch,
    named, with its traceback; a hung rank is named when the launch runs out of time."""
    if not FORKED_TORCHRUN:
        pytest.skip("run_torchrun launches the real torchrun here: nothing forked to compare")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)

    def seen(tag: str, rank: int) -> dict:
        found = json.loads((tmp_path / f"seen-{tag}-{rank}.json").read_text())
        found["added"] = {k: v for k, v in found.pop("env").items() if env.get(k) != v}
        return found

    assert run_torchrun(["probe.py", "real"], 2, tmp_path, env, real=True)[0] == 0
    code, stdout, stderr = run_torchrun(["probe.py", "collective"], 2, tmp_path, env)
    assert code == 0, stderr
    assert sorted(stdout.splitlines()) == ["rank 0: sum 3.0", "rank 1: sum 3.0"], stdout
    varying = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    for rank in (0, 1):
        real, forked = seen("real", rank), seen("collective", rank)
        assert forked["added"].keys() == real["added"].keys(), (forked["added"], real["added"])
        assert {k: v for k, v in forked["added"].items() if k not in varying} == {
            k: v for k, v in real["added"].items() if k not in varying
        }
        assert forked["added"]["RANK"] == forked["added"]["LOCAL_RANK"] == str(rank)
        assert real["argv"][:-1] == forked["argv"][:-1] == ["probe.py"]
        for key in ("cwd", "path0", "name", "file"):
            assert forked[key] == real[key], key
    assert real["name"] == "__main__" and real["path0"] == str(tmp_path)
    assert real["file"] == str(script)

    (tmp_path / "probe_mod.py").write_text(_PROBE)
    code, _, stderr = run_torchrun(["-m", "probe_mod", "module"], 2, tmp_path, env)
    assert code == 0, stderr
    module = seen("module", 1)
    assert module["argv"] == [str(tmp_path / "probe_mod.py"), "module"]
    assert module["path0"] == str(tmp_path) and module["name"] == "__main__"

    code, stdout, stderr = run_torchrun(["probe.py", "fail"], 2, tmp_path, env)
    assert code == 1 and "ValueError: rank 1 fails" in stderr, stderr
    assert "run_torchrun: rank 1 (local_rank: 1) exited with code 1" in stderr, stderr
    with pytest.raises(pytest.fail.Exception, match=r"'rank1'\] still running"):
        run_torchrun(["probe.py", "hang"], 2, tmp_path, env, timeout_s=2)


_PROFILE = """
import torch
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU]):
    torch.ones(3).add_(1)
print("profiled")
"""


def test_the_suite_log_has_no_profiler_lines(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """torch's profiler in this process and in a process forked for a rank (as the tests
    that count collectives run it) writes nothing to stderr: Kineto's ``USDT: ...
    profiler_start/stop`` lines (hundreds in a run of the README's test command) are off
    (``tests/conftest.py`` sets ``KINETO_LOG_LEVEL``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    capfd.readouterr()
    with profile(activities=[ProfilerActivity.CPU]):
        torch.ones(3).add_(1)
    here = capfd.readouterr()
    assert "USDT" not in here.err and "profiler_start" not in here.err, here.err[-2000:]
    script = tmp_path / "profile_once.py"
    script.write_text(_PROFILE)
    code, out, err = run_script([str(script)], tmp_path, dict(os.environ))
    assert code == 0 and out.strip() == "profiled", (out, err)
    assert err == "", err[-2000:]
