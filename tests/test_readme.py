"""Every ``python`` code block of README.md and of the docs pages (``docs/**/*.md``) runs as
written, on CPU.

The blocks are extracted the way ``.ci/run`` extracts the test command, written to a
scratch directory and run there: with ``torchrun`` when the block's first line says so
(``# torchrun --standalone --nproc_per_node=N file.py``), else as ``python snippet.py``
would (a fresh ``__main__`` forked from the test ranks' preloaded server,
``dist_harness.run_script``: the same globals, path and environment, without paying the
imports again). A snippet
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
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import aborted_at_exit, run_script

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
_EXTRAS = {
    "lightning": "lightning",
    "transformers": "transformers",
    "peft": "transformers",
    "timm": "bench",
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
    command = [sys.executable, name]
    if launch:
        nproc = launch.group(1)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={nproc}", name]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for attempt in range(2):
        if launch:
            result = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
        else:  # one process: a fresh __main__ forked from the preloaded rank server
            returncode, stdout, stderr = run_script([name], tmp_path, env, timeout_s=300)
        if attempt or not aborted_at_exit(returncode, stderr):
            break
    assert returncode == 0, (
        f"block {key} ({' '.join(command[1:])}) failed:\n{code}\n"
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
    test folder is not on the path, ``sys.exit`` codes and tracebacks come back."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cases = {
        "uses_torch_unimported.py": ("x = torch.zeros(1)\n", 1, "NameError: name 'torch'"),
        "imports_a_test_helper.py": ("import models\n", 1, "No module named 'models'"),
        "exits.py": ("import sys\nprint('out')\nsys.exit(3)\n", 3, ""),
        "works.py": ("import sys, torch\nprint(sys.argv[1:], torch.ones(2).sum().item())", 0, ""),
    }
    for name, (code, want_code, want_err) in cases.items():
        (tmp_path / name).write_text(code)
        returncode, stdout, stderr = run_script([name, "--flag"], tmp_path, env, timeout_s=120)
        assert returncode == want_code and want_err in stderr, (name, returncode, stderr)
    assert stdout == "['--flag'] 2.0\n" and stderr == ""
