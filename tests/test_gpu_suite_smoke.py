"""``benchmarks/gpu_suite.py --device cpu`` runs end to end and writes a report whose
correctness checks pass (kernels exact, offload equal) and whose timings are numbers.
Timings themselves are not asserted. The section budgets (a section that runs out keeps
its finished rows) and the timm fallback are checked in process."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_suite_runs_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("timm", reason="benchmark extra: pip install '.[bench]'")
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_suite.py"),
        "--device=cpu",
        "--quick",
        "--sections=kernels,cuda_graph,offload,speed:400",
        "--worlds=8,64",
        "--speed-models=llama-tiny",
        "--speed-variants=eager,titan,timm",  # the kernels section compiles already
        f"--out={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    report = (tmp_path / "gpu_suite.md").read_text()
    assert report.startswith("# dtensor_ema GPU suite")
    summary = proc.stdout.split("== summary\n", 1)[1].splitlines()
    assert [line.split(":")[0] for line in summary[:4]] == [
        "kernels",
        "cuda_graph",
        "offload",
        "speed",
    ]
    assert summary[3].startswith("speed: ok, 4 row(s)"), summary
    assert "## summary" in report and summary[3] in report
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
        for key in ("eager_ms", "copy_ms", "titan_dtensor_foreach_ms", "timm_replicated_ms"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["eager_bw_vs_copy"] > 0 and row["timm_mode"] == "dtype=float32"
        assert "compiled_ms" not in row and "graph_ms" not in row  # not asked / no CUDA


def test_a_section_out_of_time_keeps_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = _suite()

    def slow(args: Any) -> dict[str, Any]:
        rows = args.progress.setdefault("rows", [])
        for i in range(1000):
            try:  # a section's own per-row handler must not swallow the timeout
                rows.append({"i": i})
                time.sleep(0.05)
            except Exception:
                pass
        return {"rows": rows}

    def fast(args: Any) -> dict[str, Any]:
        return {"rows": [{"ok": 1}]}

    monkeypatch.setattr(suite, "SECTIONS", {"slow": slow, "fast": fast})
    code = suite.main(["--device=cpu", "--sections=slow:0.6,fast", f"--out={tmp_path}"])
    assert code == 0
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    slow_entry = results["sections"]["slow"]
    assert "time budget ran out after 0.6 s" in slow_entry["timeout"]
    assert 3 <= len(slow_entry["result"]["rows"]) < 100
    assert results["sections"]["fast"]["result"]["rows"] == [{"ok": 1}]
    out = capsys.readouterr().out.split("== summary\n", 1)[1].splitlines()
    assert out[0].startswith("slow: TIMED OUT (its time budget ran out after 0.6 s), ")
    assert " row(s) kept in " in out[0]
    assert out[1].startswith("fast: ok, 1 row(s) in ")
    assert "**TIMED OUT**" in (tmp_path / "gpu_suite.md").read_text()
    with pytest.raises(SystemExit):
        suite.parse_args(["--device=cpu", "--sections=slow:-1"])


def test_timm_fallback_without_dtype_argument() -> None:
    suite = _suite()

    class NewTimm:
        def __init__(self, model: nn.Module, decay: float = 0.9, dtype: Any = None) -> None:
            self.module, self.dtype = model, dtype

    class OldTimm:
        def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
            self.module = nn.Linear(2, 2).to(next(model.parameters()).dtype)

    ema, mode = suite.make_timm_ema(NewTimm, nn.Linear(2, 2))
    assert mode == "dtype=float32" and ema.dtype == torch.float32
    ema, mode = suite.make_timm_ema(OldTimm, nn.Linear(2, 2).to(torch.bfloat16))
    assert mode == "no dtype=: module.to(float32)"
    assert {p.dtype for p in ema.module.parameters()} == {torch.float32}
    ema, mode = suite.make_timm_ema(OldTimm, nn.Linear(2, 2))
    assert mode == "no dtype= (already float32)"
