"""``benchmarks/gpu_suite.py --device cpu`` runs end to end and writes a report whose
correctness checks pass (kernels exact, offload equal) and whose timings are numbers.
Timings themselves are not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm", reason="benchmark extra: pip install '.[bench]'")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_runs_on_cpu(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_suite.py"),
        "--device=cpu",
        "--quick",
        "--sections=kernels,cuda_graph,offload,speed",
        "--worlds=8,64",
        "--speed-models=llama-tiny",
        f"--out={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert (tmp_path / "gpu_suite.md").read_text().startswith("# dtensor_ema GPU suite")
    sections = results["sections"]
    assert sections["cuda_graph"]["skipped"]
    for row in sections["kernels"]["result"]["rows"]:
        assert {row[k] for k in ("eager", "compiled", "capturable_compiled", "multi")} == {
            "exact"
        }, row
    assert sections["offload"]["result"]["offload_differs"] == "exact"
    speed = sections["speed"]["result"]
    assert speed["errors"] == []
    assert {(r["dtype"], r["world"]) for r in speed["rows"]} == {
        (d, w) for d in ("fp32", "bf16") for w in (8, 64)
    }
    for row in speed["rows"]:
        for key in ("eager_ms", "compiled_ms", "copy_ms", "titan_dtensor_foreach_ms"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
