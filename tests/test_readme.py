"""Every ``python`` code block of README.md runs as written, on CPU.

The blocks are extracted the way ``.ci/run`` extracts the test command, written to a
scratch directory and run there: with ``torchrun`` when the block's first line says so
(``# torchrun --standalone --nproc_per_node=N file.py``), else with ``python``. A README
snippet that needs a GPU, a variable it never defines, or a process group it never
creates fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
_TORCHRUN = re.compile(r"^# torchrun .*--nproc_per_node=(\d+) (\S+\.py)")


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        indent = len(match.group(1))
        blocks.append("\n".join(line[indent:] for line in match.group(2).splitlines()))
    return blocks


BLOCKS = readme_blocks()
_EXTRAS = {"lightning": "lightning", "transformers": "transformers"}
"""Blocks that import these need the project's extra of the same name."""


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_written(index: int, tmp_path: Path) -> None:
    code = BLOCKS[index]
    for module, extra in _EXTRAS.items():
        if re.search(rf"^(import|from) {module}\b", code, re.MULTILINE):
            pytest.importorskip(module, reason=f"needs the {extra} extra")
    first = code.splitlines()[0] if code else ""
    launch = _TORCHRUN.match(first)
    name = launch.group(2) if launch else f"snippet{index}.py"
    (tmp_path / name).write_text(code + "\n")
    command = [sys.executable, name]
    if launch:
        nproc = launch.group(1)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={nproc}", name]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (
        f"README block {index} ({' '.join(command[1:])}) failed:\n{code}\n"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
