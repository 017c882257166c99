"""The docs site builds in strict mode: a broken link, anchor, nav entry or API reference
(``::: dtensor_ema.X`` naming nothing, a docstring whose ``Args`` name no parameter) fails.

Needs the ``docs`` extra; under CI a missing extra fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dist_harness import require_extra

require_extra("mkdocs", "docs")

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    command += ["-f", str(ROOT / "docs" / "mkdocs.yml"), "-d", str(site)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-5000:]}"
    assert (site / "index.html").is_file()
    api = (site / "api" / "model_ema" / "index.html").read_text()
    assert "average_parameters" in api, "the API reference lost ModelEMA's members"
