"""The example scripts, run end to end as a user would, with tiny flags.

Each test launches the real script with this checkout first on ``PYTHONPATH``, then checks
the exit code and the lines the README promises. The README's command (``torchrun
--standalone --nproc_per_node=2 examples/train_ddp_resnet.py``) runs under the real
``torchrun``; the other multi-rank runs get what torchrun gives each rank (its environment,
a rendezvous store, a fresh ``__main__``) from ``dist_harness.run_torchrun``, forked from the
preloaded rank server instead of paying torchrun's and every rank's imports per launch.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
from pathlib import Path
from types import ModuleType

import pytest
from dist_harness import BACKEND, aborted_at_exit, run_script, run_torchrun
from models import HAS_TORCHVISION

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240
# The training examples follow the suite's backend: gloo on CPU, or NCCL on 2 GPUs under
# ``nox -s tests_nccl`` (DTENSOR_EMA_TEST_BACKEND=nccl); the examples choose NCCL for CUDA,
# which refuses two ranks on one GPU, so under gloo-cuda they stay on CPU.
# resume_reshard.py is CPU-only.
DEVICE_TYPE = "cuda" if BACKEND == "nccl" else "cpu"
BACKEND_LINE = f"2 x {DEVICE_TYPE} ({'nccl' if DEVICE_TYPE == 'cuda' else 'gloo'})"


def _run(
    args: list[str],
    cwd: Path,
    *,
    nproc: int | None = 2,
    expect_ok: bool = True,
    env_extra: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
    real_torchrun: bool = False,
) -> str:
    """Run an example with ``nproc`` ranks as ``torchrun --standalone`` would launch it, or
    for ``None`` as plain python would; return its combined output, failing the test with
    the output's tail if the exit code is not what ``expect_ok`` says. Both fork from the
    preloaded rank server (``dist_harness.run_torchrun`` / ``run_script``: the script sees
    what torchrun or python gives it); ``real_torchrun`` launches the real ``torchrun``
    (the README's command). ``env_extra``: more environment variables; a ``PYTHONPATH``
    there goes after this checkout's. ``timeout``: seconds per launch."""
    env = dict(os.environ)
    extra = dict(env_extra or {})
    paths = [str(ROOT), extra.pop("PYTHONPATH", None), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update(extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    for attempt in range(2):
        if nproc is None:
            returncode, out, _ = run_script(args, cwd, env, timeout_s=timeout, merge_output=True)
        else:
            returncode, out, _ = run_torchrun(
                args, nproc, cwd, env, timeout_s=timeout, merge_output=True, real=real_torchrun
            )
        if not (expect_ok and attempt == 0 and aborted_at_exit(returncode, out)):
            break
    if (returncode == 0) != expect_ok:
        pytest.fail(f"{args[0]} exited {returncode}; output tail:\n{out[-4000:]}")
    return out


def _script(name: str) -> str:
    return str(EXAMPLES / name)


def _needs(module: str) -> pytest.MarkDecorator:
    """Skip where an optional package is missing (an older torch without its extras)."""
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f"needs {module}")


SCRIPTS = [
    "train_ddp_resnet.py",
    "train_fsdp_lm.py",
    "resume_reshard.py",
    pytest.param("lightning_ema.py", marks=_needs("lightning")),
    pytest.param("hf_trainer_ema.py", marks=_needs("transformers")),
]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{Path(name).stem}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_explains_every_flag(name: str, tmp_path: Path) -> None:
    parser = _load(name).build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 5
    undocumented = [a.option_strings[0] for a in flags if len((a.help or "").strip()) < 10]
    assert not undocumented, f"{name}: flags without help: {undocumented}"
    # The script's own parser, formatted in this process: a subprocess per script would
    # import torch (and Lightning, transformers) again for every --help. The other smoke
    # tests run each script's entry point for real.
    out = parser.format_help()
    assert out.startswith("usage:")
    for action in flags:
        assert action.option_strings[0] in out


def test_ddp_resnet_two_ranks(tmp_path: Path) -> None:
    plot = tmp_path / "curves.png"
    out = _run(
        [
            _script("train_ddp_resnet.py"),
            f"--device={DEVICE_TYPE}",
            "--epochs=2",
            "--train-size=256",
            "--test-size=100",
            "--batch-size=32",
            f"--plot={plot}",
        ],
        tmp_path,
        real_torchrun=True,  # the README's first command, as typed
    )
    assert "synthetic CIFAR-like data (offline)" in out
    assert f"on {BACKEND_LINE}" in out
    share = re.search(r"\((\d\.\d\d) of the full EMA\)", out)
    assert share and 0.4 <= float(share[1]) <= 0.6, out  # 1/W of the EMA per rank
    assert re.search(r"epoch \| train loss \| raw acc \| EMA acc", out)
    rows = re.findall(r"^\s+(\d+) \|\s+[\d.]+ \|\s+([\d.]+)% \|\s+([\d.]+)% \|", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2], out
    for _, raw, ema in rows:
        assert 0.0 <= float(raw) <= 100.0 and 0.0 <= float(ema) <= 100.0
    # 256 images / 2 ranks / 32 per step = 4 steps per epoch.
    assert re.search(r"final: raw [\d.]+%  EMA [\d.]+% .*EMA updates: 8$", out, re.MULTILINE), out
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.is_file() and plot.stat().st_size > 1000


def test_ddp_resnet_one_process_without_process_group(tmp_path: Path) -> None:
    out = _run(
        [
            _script("train_ddp_resnet.py"),
            "--device=cpu",
            "--epochs=1",
            "--train-size=128",
            "--test-size=64",
            "--batch-size=32",
            "--plot=",
        ],
        tmp_path,
        nproc=None,
    )
    assert "on 1 x cpu (no process group)" in out
    assert "(1.00 of the full EMA)" in out
    assert re.search(r"EMA updates: 4$", out, re.MULTILINE), out


@pytest.mark.skipif(not HAS_TORCHVISION, reason="the --data-dir path needs torchvision")
def test_ddp_resnet_missing_cifar_is_a_clear_error(tmp_path: Path) -> None:
    args = [_script("train_ddp_resnet.py"), f"--data-dir={tmp_path / 'none'}", "--device=cpu"]
    out = _run(args, tmp_path, nproc=None, expect_ok=False)
    assert "cifar-10-batches-py" in out and "never downloads" in out
    assert not (tmp_path / "none").exists()  # nothing was downloaded or created


def test_ddp_resnet_reads_cifar10_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The --data-dir path on a tiny fake CIFAR-10 in torchvision's on-disk format (real
    files cannot be shipped or downloaded; only their md5 checks are bypassed), in process."""
    np = pytest.importorskip("numpy")
    cifar = pytest.importorskip("torchvision.datasets.cifar")
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8)}
        batch["labels"] = rng.integers(0, 10, 20).tolist()
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": list("abcdefghij")}))
    monkeypatch.setattr(cifar, "check_integrity", lambda *args, **kwargs: True)
    monkeypatch.setattr(cifar.CIFAR10, "_check_integrity", lambda self: True)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    example = _load("train_ddp_resnet.py")
    args = [f"--data-dir={tmp_path / 'cifar'}", "--epochs=1", "--train-size=64"]
    args += ["--test-size=0", "--batch-size=16", "--label-noise=0.5", "--plot=", "--device=cpu"]
    example.main(args)
    out = capsys.readouterr().out
    assert f"CIFAR-10 from {tmp_path / 'cifar'}: 64 train / 20 test images, label noise 50%" in out
    assert "on 1 x cpu (no process group)" in out
    assert re.search(r"EMA updates: 4$", out, re.MULTILINE), out  # 64 images / 16 per step


def test_fsdp_lm_two_ranks(tmp_path: Path) -> None:
    out = _run(
        [
            _script("train_fsdp_lm.py"),
            f"--device={DEVICE_TYPE}",
            "--steps=4",
            "--eval-every=2",
            "--batch-size=2",
            "--context=16",
            "--dim=32",
            "--layers=1",
            "--heads=2",
            "--val-sequences=9",  # rounded down to 8 so both ranks run equal batches
            "--plot=",
        ],
        tmp_path,
    )
    assert f"(bfloat16), fully_shard over {BACKEND_LINE}" in out
    assert "EMA (float32)" in out
    rows = re.findall(r"^\s+(\d+) \|\s+[\d.]+ \|\s+([\d.]+) \|\s+([\d.]+) \|", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [2, 4], out
    assert re.search(
        r"final: raw val loss [\d.]+  EMA val loss [\d.]+ .*EMA updates: 4$", out, re.M
    )


def test_resume_reshard_three_to_two_ranks(tmp_path: Path) -> None:
    """The FSDP2 path (the DDP path reshards the same DCP checkpoint; DDP W=3 -> 2 resumes are
    tested in tests/test_checkpoint_distributed.py without the example's subprocesses)."""
    common = ["--ckpt-dir", str(tmp_path / "ckpt"), "--steps=3", "--total-steps=6"]
    common += ["--batch-size=6", "--fsdp"]
    script = _script("resume_reshard.py")

    out = _run([script, "--phase=train", *common], tmp_path, nproc=3)
    saved = re.search(r"\[train W=3\] saved step 3 .*EMA updates=3, (.*); rank 0", out)
    assert saved, out

    out = _run([script, "--phase=resume", *common], tmp_path, nproc=2)
    assert re.search(
        r"\[resume W=2\] loaded step 3 saved at W=3: EMA updates=3, (.*) \(identical to the "
        r"saved EMA\)",
        out,
    ), out
    assert saved[1] in out  # the same fingerprint, read back at the other world size
    diff = re.search(r"continued to step 6: EMA updates=6; max \|EMA - .*\| = (\S+)", out)
    assert diff and float(diff[1]) < 1e-4, out
    assert (tmp_path / "ckpt" / "ema_final.pt").is_file()

    out = _run([script, "--phase=load", *common], tmp_path, nproc=None)
    assert "loaded with strict=True; bit-identical to the DCP checkpoint's EMA (updates=6)" in out


@_needs("lightning")
def test_lightning_ema_two_ranks_then_resume_in_one_process(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    common = ["--train-size=128", "--val-size=64", "--batch-size=16", f"--ckpt-dir={ckpt}"]
    out = _run([_script("lightning_ema.py"), "--epochs=2", *common], tmp_path)
    assert "ddp on 2 x cpu" in out, out
    rows = re.findall(r"^epoch\s+(\d+) \| step\s+(\d+) \|", out, re.MULTILINE)
    assert rows == [("0", "4"), ("1", "8")], out  # 128 samples / 2 ranks / 16 per step
    final = re.search(
        r"final: raw val loss ([\d.]+)  EMA val loss ([\d.]+)  \(EMA updates: 8; "
        r"this rank holds (\d\.\d\d) of the EMA\)",
        out,
    )
    assert final and 0.4 <= float(final[3]) <= 0.6, out
    assert (ckpt / "last.ckpt").is_file()
    # The 2-rank checkpoint resumes in one process, EMA counter and all.
    args = ["--epochs=3", f"--resume={ckpt / 'last.ckpt'}", *common]
    out = _run([_script("lightning_ema.py"), *args], tmp_path, nproc=None)
    assert "ddp on 1 x cpu" in out, out
    assert re.search(r"EMA updates: 16; this rank holds 1.00 of the EMA", out), out


@_needs("transformers")
def test_hf_trainer_ema_two_ranks(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    args = ["--steps=4", "--eval-every=2", "--train-size=64", "--val-size=16"]
    args += ["--batch-size=4", "--context=8", "--dim=16", "--layers=1", f"--output-dir={out_dir}"]
    out = _run([_script("hf_trainer_ema.py"), *args], tmp_path)
    assert "on 2 rank(s)" in out, out
    assert re.search(r"final: raw val loss [\d.]+  EMA val loss [\d.]+  .*EMA updates: 4\)", out)
    assert "logits identical to the EMA's: True" in out, out
    for step in (2, 4):
        assert (out_dir / f"checkpoint-{step}" / "ema" / ".metadata").is_file()
    assert (out_dir / "ema" / "config.json").is_file()


@_needs("torchtitan")
def test_torchtitan_entry_point_two_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    """``examples/torchtitan_llama.py`` (torchtitan's entry point with ``--module
    dtensor_ema.integrations.torchtitan``) on CPU ranks, run through ``python -m
    titan_models`` (the suite's CPU switches, SDPA as a torchtitan override): the llama3
    debugmodel on TP at W=2 with two EMAs (``--ema.decays 0.9,0.5``, the list flags as
    documented), the validator and a checkpoint at step 2; resumed in one process for step
    3 (the log says the EMA was restored, from step 2, with each EMA's updates); and
    resumed with the Q/K/V projections unfused (a torchtitan override): the EMA's fused
    ``wqkv`` converted to ``wq``/``wk``/``wv`` bit for bit (logged). (Every layout, and W=4
    to 2 to 1, through torchtitan's own Trainer: ``tests/test_integration_torchtitan.py``;
    here, the launcher.)"""
    import torch
    import torch.distributed.checkpoint as dcp
    from titan_models import trainer_assets

    tokenizer, data = trainer_assets(tmp_path / "assets")
    out_dir = tmp_path / "out"
    flags = [
        "--override.imports", "titan_models.sdpa_on_cpu",
        f"--hf_assets_path={tokenizer}",
        f"--dataloader.dataset_path={data}",
        f"--validator.dataloader.dataset_path={data}",
        "--validator.dataloader.dataset=c4_test",
        "--validator.enable", "--validator.freq=2", "--validator.steps=1",
        f"--dump_folder={out_dir}",
        "--training.seq_len=16", "--training.local_batch_size=2",
        "--training.mixed_precision_param=float32", "--training.disable_cuda_graphs",
        "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
        "--checkpoint.enable", "--checkpoint.interval=2",
        "--checkpoint.exclude_from_loading", "dataloader",  # torchtitan reshards no dataloader
        "--ema.decays", "0.9,0.5", "--ema.buffer_patterns", "*.no_such_buffer,*.nor_this",
    ]  # fmt: skip
    env = {
        "PYTHONPATH": str(ROOT / "tests"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    launch = ["-m", "titan_models", _script("torchtitan_llama.py")]
    w2 = ["--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"]
    out = _run(
        [*launch, *flags, *w2, "--training.steps=2"], tmp_path, nproc=2, env_extra=env, timeout=600
    )
    names = r"EMA \['decay_0_9', 'decay_0_5'\]: "
    share = re.findall(names + r"(\d+) elements on this rank per EMA \((\d+) in all over 2 EMAs; "
                       r"1 model part\)", out)  # fmt: skip
    assert len(share) == 2, out[-3000:]
    assert all(int(total) == 2 * int(each) for each, total in share), share
    ema_losses = re.findall(r"validate step (\d+): EMA loss decay_0_9 +([\d.]+)  decay_0_5", out)
    assert [s for s, _ in ema_losses][:1] == ["1"] and ("2", ema_losses[-1][1]) in ema_losses
    checkpoint = out_dir / "checkpoint"
    keys = dcp.FileSystemReader(str(checkpoint / "step-2")).read_metadata().state_dict_metadata
    assert any(k.startswith("ema.decay_0_5.ema.layers.0.") for k in keys), sorted(keys)[:20]
    assert "restored" not in out  # a fresh start

    resume = [f.replace("freq=2", "freq=1") for f in flags]
    out = _run([*launch, *resume, "--training.steps=3"], tmp_path, nproc=1, env_extra=env,
               timeout=600)  # fmt: skip
    assert "Training starts at step 3" in out, out[-3000:]
    restored = re.findall(r"EMA restored from (\S+) \(step (\d+)\): (.*)", out)
    assert restored == [
        (str(checkpoint / "step-2"), "2", "decay_0_9 2 updates, decay_0_5 2 updates")
    ], (restored, out[-3000:])
    total = re.findall(names + r"(\d+) elements on this rank per EMA", out)
    assert len(total) == 1 and int(total[0]) == sum(int(n) for n, _ in share), (total, share)
    assert re.search(r"validate step 3: EMA loss decay_0_9", out), out[-3000:]
    assert (checkpoint / "step-3" / ".metadata").is_file()

    # The same checkpoint into the unfused model: torchtitan converts its model entry, the
    # EMA's is converted too (logged); torchtitan does not convert its optimizer's state, so
    # the optimizer starts afresh, as for a fine-tune. The EMA starts late (no update in
    # steps 3-4), so the final (full) checkpoint holds the converted step-2 EMA exactly.
    unfused = [
        "dataloader,optimizer,lr_scheduler" if f == "dataloader" else
        f.replace("titan_models.sdpa_on_cpu", "titan_models.sdpa_on_cpu,titan_models.unfused_qkv")
        for f in resume
    ]  # fmt: skip
    out = _run([*launch, *unfused, "--training.steps=4", "--checkpoint.load_step=2",
                "--ema.start_step=100"], tmp_path, nproc=1, env_extra=env, timeout=600)  # fmt: skip
    converted = re.findall(r"EMA (decay_0_\d): converted (\d+) Q/K/V projection\(s\)", out)
    assert converted == [("decay_0_9", "6"), ("decay_0_5", "6")], out[-3000:]  # 6 layers
    assert "Training starts at step 3" in out, out[-3000:]
    fused = checkpoint / "step-2"
    for name in ("decay_0_9", "decay_0_5"):
        key = f"ema.{name}.ema.layers.1.attention.qkv_linear.wqkv.weight"
        saved = {key: torch.empty(3 * 256, 256)}
        dcp.load(saved, checkpoint_id=str(fused))
        # torchtitan's fused layout, per head (16 heads, 16 KV heads, head_dim 16): q, k, v
        rows = saved[key].reshape(16, 3, 16, 256)
        want = {w: rows[:, i].reshape(256, 256) for i, w in enumerate(("wq", "wk", "wv"))}
        got = {f"ema.{name}.ema.layers.1.attention.qkv_linear.{w}.weight": torch.empty(256, 256)
               for w in want}  # fmt: skip
        dcp.load(got, checkpoint_id=str(checkpoint / "step-4"))  # a full one: the EMA in it
        for w, value in want.items():
            assert torch.equal(got[f"ema.{name}.ema.layers.1.attention.qkv_linear.{w}.weight"],
                               value), (name, w)  # fmt: skip
