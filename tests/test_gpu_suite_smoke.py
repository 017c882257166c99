"""``benchmarks/gpu_suite.py --device cpu`` runs end to end and writes a report whose
correctness checks pass (kernels exact, offload equal over 20 steps, every multirank row
exact against its CPU reference, DCP W=4 -> W=2 -> one process, per-rank shapes at fake
W=8/64) and whose timings are numbers; the CUDA-only rows (graph replay, the chunked
offload pipeline) are skipped with the reason "no CUDA". Timings themselves are not
asserted. The section budgets (a section that runs out keeps its finished rows), the
``defaults:`` verdict, the harness's ``spawn_ranks`` (a stuck rank is named and ended) and
the timm fallback are checked in process."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from dist_harness import run_script
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """``PYTHONPATH=.``, as the GPU session runs the suite."""
    return dict(os.environ, PYTHONPATH=str(ROOT))


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
        "--offload-steps=20",
        "--worlds=8,64",
        "--speed-models=llama-tiny",
        "--speed-variants=eager,titan,timm",  # the kernels section compiles already
        "--budget-s=1100",  # not the GPU preset's 460: compiling takes minutes on a busy CPU
        f"--out={tmp_path}",
    ]
    code, stdout, stderr = run_script(cmd[1:], tmp_path, _env(), timeout_s=1200)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    report = (tmp_path / "gpu_suite.md").read_text()
    assert report.startswith("# dtensor_ema GPU suite")
    summary = stdout.split("== summary\n", 1)[1].splitlines()
    assert [line.split(":")[0] for line in summary[:4]] == [
        "kernels",
        "cuda_graph",
        "offload",
        "speed",
    ]
    assert summary[3].startswith("speed: ok, 4 row(s)"), summary
    assert "## summary" in report and summary[3] in report
    sections = results["sections"]
    assert sections["cuda_graph"]["skipped"] == "no CUDA: graph replay needs a GPU"
    for row in sections["kernels"]["result"]["rows"]:
        assert [row[k] for k in ("eager", "compiled", "capturable_compiled", "multi")] == [
            "exact"
        ] * 4, row
    offload = sections["offload"]["result"]
    assert offload["offload_differs"] == "exact" and offload["exact_steps"] == 20
    assert offload["offload_updater"] == "OffloadUpdater"
    assert offload["not_run"] == {
        "device_graph": "skipped: no CUDA",
        "offload_chunked": "skipped: no CUDA",
    }
    assert {r["variant"] for r in offload["rows"]} == {"no_ema", "device_eager", "offload"}
    assert offload["bytes"]["offload"]["ema_on"] == "cpu"
    assert offload["bytes"]["offload"]["staging_host_bytes"] > 0
    defaults = [line for line in summary if line.startswith("defaults:")]
    assert len(defaults) == 2 and "keep opt-in" in defaults[0] and "keep 'worker'" in defaults[1]
    assert results["verdict"]["cuda_graph_may_flip"] is False
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


@pytest.mark.slow
@pytest.mark.distributed
def test_multirank_section_runs_on_cpu(tmp_path: Path) -> None:
    """W=4 then W=2 gloo ranks (DDP, FSDP2, HSDP 2x2; fp32 and bf16 with an fp32 EMA): every
    update, swap, materialization, ``ema.module`` forward and DCP load equals the CPU
    reference; fake-group shapes at W=8 and 64; the graph and chunked rows say no CUDA."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_suite.py"),
        "--device=cpu",
        "--sections=multirank:800",
        "--budget-s=800",
        f"--out={tmp_path}",
    ]
    code, stdout, stderr = run_script(cmd[1:], tmp_path, _env(), timeout_s=900)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = stdout.split("== summary\n", 1)[1].splitlines()
    assert summary[0].startswith("multirank: ok, 30 row(s), exact "), summary
    assert "(not:" not in summary[0], summary[0]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]["multirank"]
    body = result["result"]
    assert body["errors"] == [] and body["backend"] == "gloo"
    cases = [r for r in body["rows"] if not r["layout"].startswith(("load", "zero3"))]
    assert [(r["world"], r["layout"], r["dtype"]) for r in cases] == [
        (w, layout, dt)
        for w, layouts in ((4, ("ddp", "fsdp2", "hsdp")), (2, ("ddp", "fsdp2")))
        for layout in layouts
        for dt in ("fp32", "bf16")
    ]
    for row in cases:
        assert "error" not in row and "tracebacks" not in row and row["training"] == "sgd", row
        assert row["update_eager"] == row["update_offload"] == "exact", row
        assert row["update_graph"] == row["update_offload_chunked"] == "skipped: no CUDA"
        assert row["swap"]["weights"] == row["swap"]["restored"] == "exact", row
        assert row["swap"]["forward"]["ok"] and row["module_forward"]["ok"], row
        assert row["materialize"] == {"ema_sd": "exact", "model_sd": "exact"}, row
        assert row["bytes_sum_equals_total"] and row["bytes_over_total_per_W"] < 1.01, row
        assert row.get("dcp_save", "ok") == "ok" and ("dcp_save" in row) == (row["world"] == 4)
    zero3 = [r for r in body["rows"] if r["layout"].startswith("zero3")]
    assert [(r["world"], r["dtype"]) for r in zero3] == [
        (4, "fp32"),
        (4, "bf16"),
        (2, "fp32"),
        (2, "bf16"),
    ]
    for row in zero3:  # DeepSpeed's partitions: every update, swap and gather exact, 1/W
        assert "error" not in row and "tracebacks" not in row, row
        assert row["update_eager"] == row["update_offload"] == "exact", row
        assert row["swap"] == {"weights": "exact", "restored": "exact"}, row
        assert row["materialize"] == {"ema_sd": "exact", "model_sd": "exact"}, row
        assert row["bytes_sum_equals_total"] and row["bytes_over_total_per_W"] == 1.0, row
    loads = [r for r in body["rows"] if r["layout"].startswith("load")]
    assert len(loads) == 16 and all(r["dcp_load"] == "exact" for r in loads), loads
    assert sum(r["world"] == 1 for r in loads) == 8
    assert sum("zero3" in r["layout"] for r in loads) == 4  # W=4 -> W=2, W=4 -> one process
    for row in (r for r in loads if r["world"] == 2):  # background saves; a failed load
        assert row["dcp_load_async"] == row["failed_load_unchanged"] == "exact", row
        assert row["failed_load_raised"].startswith("ChecksumError"), row
    for row in (r for r in cases + zero3 if r["world"] == 4):
        assert row["dcp_save_async"] == "ok", row
    fake = body["fake_world"]
    assert {(r["world"], r["layout"], r["rank"]) for r in fake} == {
        (w, layout, r) for w in (8, 64) for layout in ("ddp", "fsdp2", "hsdp") for r in (0, w - 1)
    }
    for row in fake:
        assert row["local_shapes"] == row["local_values_after_update"] == "exact", row


def test_host_section_runs_on_cpu() -> None:
    """The ``host`` section (issue 48), in process: the floor and ``update()`` timed at 161
    and 1000 tensors with ``host_overhead.py``'s code; the graph rows skipped without CUDA."""
    suite = _suite()
    threads = torch.get_num_threads()
    try:
        result = suite.section_host(argparse.Namespace(device="cpu", progress={}))
    finally:
        torch.set_num_threads(threads)
    assert [r["tensors"] for r in result["rows"]] == [161, 1000]
    for row in result["rows"]:
        assert row["graph"] == "skipped: no CUDA" and "graph_us" not in row, row
        assert row["floor_us"] > 0 and row["update_us"] > 0 and row["update_over_floor"] > 0


def test_verdict_flips_only_when_every_common_case_is_exact_and_captured() -> None:
    suite = _suite()

    def graph_row(path: str, dtype: str, **change: Any) -> dict[str, Any]:
        row = {
            "path": path,
            "dtype": dtype,
            "uses_graph": True,
            "captures": 4,
            "expected_captures": 4,
            "differs": "exact",
            "differs_from_reference": "exact",
        }
        return {**row, **change}

    def results(graph_rows: list[dict[str, Any]], chunked: Any = "exact") -> dict[str, Any]:
        multi = {"world": 4, "layout": "fsdp2", "dtype": "bf16", "update_graph": "exact"}
        multi.update(graph_captures=1, update_offload_chunked=chunked)
        return {
            "sections": {
                "cuda_graph": {"result": {"rows": graph_rows}},
                "offload": {"result": {"offload_chunked_differs": chunked}},
                "multirank": {"result": {"rows": [multi]}},
            }
        }

    fsdp2 = "cuda_graph=True, FSDP2 at W=1"
    good = [
        graph_row("cuda_graph=True (opt-in)", "torch.float32"),
        graph_row("cuda_graph=True (opt-in)", "torch.bfloat16"),
        *(
            {k: v for k, v in graph_row(fsdp2, dt, captures=1).items() if k != "expected_captures"}
            for dt in ("fp32", "bf16")
        ),
    ]
    v = suite.verdict(results(good))
    assert v["cuda_graph_may_flip"] and v["chunked_offload_may_flip"], v
    lines = suite.verdict_lines(v)
    assert "FLIP ALLOWED" in lines[0] and "FLIP ALLOWED" in lines[1]
    # One re-capture missed, a bf16 row off by a bit, FSDP2 not run, chunked not exact.
    for rows in (
        [good[0], {**good[1], "captures": 3}, *good[2:]],
        [good[0], {**good[1], "differs_from_reference": ["odd"]}, *good[2:]],
        good[:2],
    ):
        assert not suite.verdict(results(rows))["cuda_graph_may_flip"]
    v = suite.verdict(results(good, chunked=["wte.weight"]))
    assert v["cuda_graph_may_flip"] and not v["chunked_offload_may_flip"]
    assert "keep 'worker'" in suite.verdict_lines(v)[1]


def test_exactness_counts_nested_results_and_skips() -> None:
    suite = _suite()
    body = {
        "rows": [
            {"layout": "ddp", "update_eager": "exact", "update_graph": "skipped: no CUDA"},
            {"layout": "fsdp2", "swap": {"weights": ["a"], "forward": {"ok": True}}},
            {"layout": "x", "model": "llama-tiny", "materialize": {"ema_sd": "exact"}},
        ],
        "offload_differs": "exact",
    }
    good, bad = suite.exactness(body)
    assert good == 4 and bad == ["fsdp2 swap weights: ['a']"], (good, bad)


class _FakeGraph:
    """Like a CUDA graph: runs the step once when captured, then replays *that* function
    (bound to the tensors of capture time), so a missed re-capture reads stale tensors."""

    def __init__(self, fn: Any, device: torch.device) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtensor_ema.update import cuda_graph as graphs

    real = graphs.decide

    def on_cuda(**kwargs: Any) -> Any:
        kwargs.update(device_type="cuda", cuda_available=True, graphs_supported=True)
        return real(**kwargs)

    monkeypatch.setattr(graphs, "decide", on_cuda)
    monkeypatch.setattr(graphs, "_CudaGraph", _FakeGraph)


def test_graph_rows_with_a_fake_cuda(fake_cuda: None, tmp_path: Path) -> None:
    """The ``cuda_graph`` section's opt-in and FSDP2 rows, run on CPU with a stand-in graph
    (the decision told the model is on CUDA): the row code cannot rot between GPU runs, and
    its expectations (exact, 4 captures after the re-bind, ``build_module`` and load) hold
    for the library's bookkeeping."""
    suite = _suite()
    cpu = torch.device("cpu")
    rows = suite._opt_in_rows(cpu)
    assert [r["dtype"] for r in rows] == ["torch.float32", "torch.bfloat16"]
    for row in rows:
        assert row["uses_graph"] and row["captures"] == row["expected_captures"] == 4, row
        assert row["differs"] == row["differs_from_reference"] == "exact", row
        assert row["eager_differs_from_reference"] == "exact", row
        assert row["updates"] == [12, 12] and row["cuda_graph_None_differs"] == "exact"
        assert "opt-in until proven on hardware" in row["cuda_graph_None_decides"]
    for dt in ("fp32", "bf16"):
        row = suite._fsdp2_graph_row(cpu, dt, tmp_path)
        assert row["uses_graph"] and row["captures"] == 1, row
        assert row["differs"] == row["differs_from_reference"] == "exact", row
        assert row["updates"] == [6, 6]
    verdict = suite.verdict(
        {
            "sections": {
                "cuda_graph": {"result": {"rows": [*rows, row]}},
                "offload": {"result": {"offload_chunked_differs": "exact"}},
            }
        }
    )
    assert verdict["cuda_graph_may_flip"], verdict


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_spawn_ranks_names_and_ends_a_stuck_rank(tmp_path: Path) -> None:
    """A rank still running at the deadline is named, ended, and its failure ends with its
    Python stack (where it was stuck)."""
    from dist_harness import spawn_ranks

    start = time.monotonic()
    results, failures = spawn_ranks(
        _sleep_on_rank_1, 2, tmp_path, deadline_s=8, init_process_group=False
    )
    assert time.monotonic() - start < 120
    assert results == [0]
    assert failures[0] == "ranks ['rank1'] still running after the 8 s deadline", failures
    assert failures[1].startswith("rank 1: exited with code"), failures
    stack = failures[1].split("; its output ends:\n", 1)[1]  # the stuck rank's stack
    assert 'test_gpu_suite_smoke.py", line' in stack and "in _sleep_on_rank_1" in stack, stack


def test_float8_section_runs_on_cpu_and_skips_without_torchao(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``float8`` section in this process on CPU: torchao's float8 all-gather under
    FSDP2 (a one-rank gloo group), every exactness check exact; without torchao it is
    skipped with the install line."""
    from dist_harness import require_extra

    require_extra("torchao", "torchao")
    suite = _suite()
    assert suite.main(["--device=cpu", "--sections=float8:300", f"--out={tmp_path}"]) == 0
    (row,) = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]["float8"]["result"][
        "rows"
    ]
    assert row["local_type"] == "WeightWithDynamicFloat8CastTensor"
    assert [row[k] for k in ("eager_differs", "weights", "restored", "ok")] == ["exact"] * 3 + [
        True
    ]
    assert row["graph_differs"] == "skipped: no CUDA"
    assert "\nfloat8: ok, 1 row(s), exact 4/4 in " in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert suite.main(["--device=cpu", "--sections=float8", f"--out={tmp_path}"]) == 0
    entry = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]["float8"]
    assert entry["skipped"].startswith("torchao not importable (")
    assert entry["skipped"].endswith("pip install torchao==0.18.0")


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
