"""torchtitan's own ``Trainer`` with the EMA of ``--module dtensor_ema.integrations.torchtitan``.

Every run builds its trainer from this package's ``config_registry`` (torchtitan's
``llama3_debugmodel`` / ``deepseek_v3_debugmodel`` with the ``ema`` section) and calls
torchtitan's ``train()``; no training loop is written here. The CPU switches torchtitan
needs live in ``titan_models`` (test setup, never the library).

* W=4 (one spawn): llama3 HSDP 2x2 (checkpoints every 2 steps with ``async_mode="async"``,
  the final one model-only), llama3 FSDP2 2 x TP 2 (HF export of the EMA and of the raw
  weights), llama3 PP 2 x FSDP2 2 (one EMA per stage over the stage's mesh), deepseek_v3
  (MoE, ``expert_bias_E`` averaged through ``buffer_patterns``) HSDP 2x2 and FSDP2 2 x TP 2.
* W=2 (one spawn): llama3 FSDP2 resumed from the W=4 HSDP step-2 checkpoint, then a
  model-only load; deepseek_v3 FSDP2.
* One process: the W=4 checkpoint's EMA into a plain model's EMA (no process group), the
  EMA written beside the model-only final checkpoint, and the HF export into
  ``transformers``' Llama.

Checks: every EMA equals, bit for bit, a reference written here (torchtitan's EMA rule,
``lerp_`` on full tensors) fed the trained weights by an optimizer post-hook of the test's
own; every EMA element sits on exactly one rank; the validator's EMA loss (logged under its
own key) equals the loss of an unsharded model holding the EMA (and the raw loss that of
one holding the raw weights); checkpoints resume the EMA bit for bit at W=2 and in one
process; the HF export gives ``transformers``' logits close to torchtitan's forward.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_harness import require_extra, run_ranks
from titan_models import build_cpu_trainer, cpu_trainer_config
from torch import nn
from torch.distributed.tensor import DTensor

require_extra("torchtitan", "zoo")

from dtensor_ema.model_keys import canonical_fqn  # noqa: E402

pytestmark = pytest.mark.distributed

DEADLINE_S = 900.0
HSDP_DECAYS = [0.9, 0.5]
MOE_BUFFERS = ["*.expert_bias_E"]


# ------------------------------------------------------------------ the reference (ours)
def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


class Reference:
    """torchtitan's EMA rule on full tensors, written here: after every optimizer step (a
    post-hook registered after the trainer's), the trained weights are gathered and each EMA
    is ``lerp_``-ed towards them on the steps the rule fires. Collective (gathers)."""

    def __init__(self, trainer: Any) -> None:
        import fnmatch

        self.trainer = trainer
        self.c = trainer.config.ema
        self.names = list(trainer.ema.names)
        self.keys: list[str] = []
        for part in trainer.model_parts:
            for name, p in part.named_parameters():
                if p.requires_grad:
                    self.keys.append(canonical_fqn(name))
            for name, _ in part.named_buffers():
                fqn = canonical_fqn(name)
                if any(fnmatch.fnmatch(fqn, pattern) for pattern in self.c.buffer_patterns):
                    self.keys.append(fqn)
        start = self.weights()
        self.emas = {n: {k: v.clone() for k, v in start.items()} for n in self.names}
        self.snapshots: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self.weights_at: dict[int, dict[str, torch.Tensor]] = {}
        self.fired: list[int] = []
        trainer.optimizers.register_step_post_hook(lambda *args, **kwargs: self.step())

    def weights(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for part in self.trainer.model_parts:
            for name, t in [*part.named_parameters(), *part.named_buffers()]:
                if canonical_fqn(name) in self.keys:
                    tensors[canonical_fqn(name)] = t
        return {k: _full(tensors[k]) for k in self.keys}

    def decay(self, index: int, num_updates: int) -> float:
        if self.c.decays:
            return self.c.decays[index]
        return 2.0 ** (-1.0 / (self.c.half_life_fractions[index] * num_updates))

    @torch.no_grad()
    def step(self) -> None:
        step = self.trainer.step
        weights = self.weights()
        elapsed = step - self.c.start_step
        if step >= self.c.start_step and elapsed % self.c.update_every_n_steps == 0:
            self.fired.append(step)
            num_updates = max((elapsed + self.c.step_bias) // self.c.update_every_n_steps, 1)
            for i, name in enumerate(self.names):
                weight = 1.0 - self.decay(i, num_updates)
                for k in self.keys:
                    self.emas[name][k].lerp_(weights[k], weight)
        self.snapshots[step] = {
            n: {k: v.clone() for k, v in e.items()} for n, e in self.emas.items()
        }
        self.weights_at[step] = weights


def _ema_full(trainer: Any, name: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """EMA ``name`` of every local part as full tensors (collective over each EMA's mesh)."""
    out: dict[str, torch.Tensor] = {}
    for emas in trainer.ema.parts:
        for k, t in emas[name].ema_tensors().items():
            if k in keys:
                out[k] = _full(t)
    return out


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])]


# ------------------------------------------------------------------ validation, unsharded
def _plain_model(trainer: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """An unsharded model of the trainer's config holding ``state`` (model keys)."""
    with torch.device("meta"):
        model = trainer.model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def _validation_loss(trainer: Any, model: nn.Module) -> float:
    """The validator's loss recomputed in one process: each data-parallel rank's first
    validation batch (torchtitan's validation dataloader, rebuilt per rank), summed
    next-token cross-entropy over the valid tokens of all of them."""
    v = trainer.config.validator
    dims = trainer.parallel_dims
    dp = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    loader = replace(v.dataloader, infinite=v.steps != -1)
    total, tokens = 0.0, 0
    for rank in range(dp):
        batches = loader.build(
            dp_world_size=dp,
            dp_rank=rank,
            tokenizer=trainer.tokenizer,
            seq_len=trainer.config.training.seq_len,
            local_batch_size=trainer.config.training.local_batch_size,
        )
        input_dict, labels = next(iter(batches))
        extra = {k: t for k, t in input_dict.items() if k != "input"}
        logits = model(input_dict["input"], **extra).float()
        total += float(
            F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
            )
        )
        tokens += int((labels != -100).sum())
    return total / tokens


def _check_validation(trainer: Any) -> dict[str, Any]:
    """The validator's last losses and the unsharded ones (computed on rank 0; every rank
    takes part in the gathers)."""
    raw_state = {k: _full(v) for k, v in trainer.model_parts[0].state_dict().items()}
    ema_states = {n: trainer.ema.get_ema_state_dict(n, cpu_offload=True) for n in trainer.ema}
    out: dict[str, Any] = {"logged": dict(trainer.validator.last_losses)}
    if dist.get_rank() == 0:
        out["unsharded"] = {"raw": _validation_loss(trainer, _plain_model(trainer, raw_state))}
        for name, state in ema_states.items():
            out["unsharded"][name] = _validation_loss(trainer, _plain_model(trainer, state))
    return out


# ------------------------------------------------------------------ one run
def _config(root: Path, model: str, **kw: Any) -> Any:
    from dtensor_ema.integrations.torchtitan import config_registry

    config = getattr(config_registry, f"{model}_debugmodel")()
    return cpu_trainer_config(config, root, **kw)


def _logged(trainer: Any) -> list[tuple[int, dict[str, float]]]:
    """Record what the trainer's metrics logger receives (rank 0's is torchtitan's)."""
    calls: list[tuple[int, dict[str, float]]] = []
    logger = trainer.metrics_processor.logger
    original = logger.log

    def log(metrics: dict[str, Any], step: int) -> None:
        calls.append((step, {k: v for k, v in metrics.items() if "loss" in k}))
        original(metrics, step)

    logger.log = log
    return calls


def _train(trainer: Any) -> dict[str, Any]:
    """torchtitan's ``train()``; the checks every run shares."""
    reference = Reference(trainer)
    calls = _logged(trainer)
    trainer.train()
    names = trainer.ema.names
    parts = trainer.ema.parts
    return {
        "differ": {
            n: _differ(_ema_full(trainer, n, reference.keys), reference.emas[n]) for n in names
        },
        "moved": {
            n: _differ(reference.snapshots[min(reference.snapshots)][n], reference.emas[n]) != []
            for n in names
        },
        "fired": reference.fired,
        "local_numel": sum(e.local_numel() for emas in parts for e in emas.values()) // len(names),
        "model_numel": sum(v.numel() for v in reference.emas[names[0]].values()),
        "stage": trainer.parallel_dims.get_mesh("pp").get_local_rank()
        if trainer.parallel_dims.pp_enabled
        else 0,
        "parts": len(parts),
        "keys": sorted(reference.keys),
        "validation_logs": [(s, m) for s, m in calls if any("ema_loss" in k for k in m)],
        "reference": reference,
    }


def _no_sleep() -> None:
    """torchtitan's ``train()`` ends with rank 0 sleeping 2 s; not here (test speed)."""
    import time

    import torchtitan.trainer as titan_trainer

    class _Time:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            pass

    titan_trainer.time = _Time()  # type: ignore[assignment]


# ------------------------------------------------------------------ W=4
def _w4_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    _no_sleep()
    base = Path(root)
    out: dict[str, Any] = {}

    # llama3 HSDP 2x2: async checkpoints at steps 2 and 4 (model-only), validation at 4.
    config = _config(base / "hsdp", "llama3", replicate=2, shard=2, steps=4,
                     validate_every=4, checkpoint_every=2)  # fmt: skip
    config.ema.decays = list(HSDP_DECAYS)
    config.checkpoint.async_mode = "async"
    config.checkpoint.last_save_model_only = True
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run["validation"] = _check_validation(trainer)
    reference = run.pop("reference")
    if rank == 0:
        saved = {"ema": reference.snapshots, "weights": reference.weights_at}
        torch.save(saved, base / "hsdp" / "reference.pt")
    run["ema_folder"] = trainer.checkpointer.ema_checkpoint_id(4, "decay_0_9")
    trainer.close()
    out["llama_hsdp"] = run

    # llama3 FSDP2 2 x TP 2: half-life EMA from step 2; HF export of the EMA and raw weights.
    config = _config(base / "tp", "llama3", shard=2, tp=2, steps=3, validate_every=3)
    config.ema.decays = []
    config.ema.half_life_fractions = [0.5]
    config.ema.start_step = 2
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run["validation"] = _check_validation(trainer)
    run.pop("reference")
    trainer.export_hf(base / "tp" / "hf_ema", name="hlf_0_5")
    trainer.export_hf(base / "tp" / "hf_raw", raw=True)
    ema_state = trainer.ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
    raw_state = {k: _full(v) for k, v in trainer.model_parts[0].state_dict().items()}
    if rank == 0:
        torch.save({"ema": ema_state, "raw": raw_state}, base / "tp" / "states.pt")
    trainer.close()
    out["llama_tp"] = run

    # llama3 PP 2 x FSDP2 2: one EMA per stage, over the stage's own 2-rank mesh.
    config = _config(base / "pp", "llama3", pp=2, shard=2, steps=2)
    config.ema.decays = [0.9]
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run.pop("reference")
    run["ema_mesh"] = [e.mesh.size() for emas in trainer.ema.parts for e in emas.values()]
    trainer.close()
    out["llama_pp"] = run

    # deepseek_v3 (MoE) HSDP 2x2 and FSDP2 2 x TP 2, the expert bias averaged too.
    for layout, degrees in (("hsdp", {"replicate": 2, "shard": 2}), ("tp", {"shard": 2, "tp": 2})):
        config = _config(base / f"moe_{layout}", "deepseek_v3", steps=2, validate_every=2,
                         **degrees)  # fmt: skip
        config.ema.decays = [0.9]
        config.ema.buffer_patterns = list(MOE_BUFFERS)
        trainer = build_cpu_trainer(config)
        run = _train(trainer)
        run["validation"] = _check_validation(trainer)
        run.pop("reference")
        trainer.close()
        out[f"moe_{layout}"] = run
    dist.barrier()
    return out


# ------------------------------------------------------------------ W=2
def _w2_body(rank: int, world_size: int, root: str, w4_root: str) -> dict[str, Any]:
    _no_sleep()
    base = Path(root)
    step2 = Path(w4_root) / "hsdp" / "outputs" / "checkpoint" / "step-2"
    out: dict[str, Any] = {}

    # llama3 FSDP2: resume the W=4 HSDP run's async step-2 checkpoint, train steps 3-4.
    config = _config(base / "resume", "llama3", shard=2, steps=4, validate_every=4,
                     checkpoint_every=10)  # fmt: skip
    config.ema.decays = list(HSDP_DECAYS)
    config.checkpoint.initial_load_path = str(step2)
    config.checkpoint.initial_load_model_only = False
    config.checkpoint.exclude_from_loading = ["dataloader"]  # torchtitan reshards no dataloader
    config.checkpoint.last_save_model_only = False
    trainer = build_cpu_trainer(config)
    reference = Reference(trainer)
    saved = torch.load(Path(w4_root) / "hsdp" / "reference.pt")
    trainer.checkpointer.load()  # what train() does first; checked before training on
    keys = reference.keys
    run: dict[str, Any] = {
        "loaded_step": trainer.step,
        "loaded": {
            n: _differ(_ema_full(trainer, n, keys), saved["ema"][2][n]) for n in trainer.ema
        },
    }
    reference.emas = {
        n: {k: v.clone() for k, v in saved["ema"][2][n].items()} for n in reference.names
    }
    calls = _logged(trainer)
    trainer.train()
    run["differ"] = {
        n: _differ(_ema_full(trainer, n, keys), reference.emas[n]) for n in trainer.ema
    }
    run["fired"] = reference.fired
    run["validation"] = _check_validation(trainer)
    run["validation_logs"] = [(s, m) for s, m in calls if any("ema_loss" in k for k in m)]
    # A model-only load (initial_load_model_only) restarts the EMA from the loaded weights.
    checkpointer = trainer.checkpointer
    checkpointer.folder = str(base / "resume" / "no-checkpoints-here")
    checkpointer.initial_load_model_only = True
    checkpointer.load()
    weights = reference.weights()
    run["reseeded"] = {n: _differ(_ema_full(trainer, n, keys), weights) for n in trainer.ema}
    run["reseeded_to_step2"] = _differ(weights, saved["weights"][2])
    trainer.close()
    out["llama_resume"] = run

    # deepseek_v3 (MoE) FSDP2.
    config = _config(base / "moe", "deepseek_v3", shard=2, steps=3, validate_every=3)
    config.ema.decays = [0.9]
    config.ema.buffer_patterns = list(MOE_BUFFERS)
    trainer = build_cpu_trainer(config)
    run = _train(trainer)
    run["validation"] = _check_validation(trainer)
    run.pop("reference")
    trainer.close()
    out["moe_fsdp"] = run
    dist.barrier()
    return out


# ------------------------------------------------------------------ fixtures
def _env(root: Path) -> dict[str, str]:
    return {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("titan-w4")
    return root, run_ranks(_w4_body, 4, root, str(root), env=_env(root), deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def w2(
    w4: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("titan-w2")
    return run_ranks(
        _w2_body, 2, root, str(root), str(w4[0]), env=_env(root), deadline_s=DEADLINE_S
    )


# ------------------------------------------------------------------ assertions
def _assert_run(results: list[dict[str, Any]], key: str, fired: list[int]) -> None:
    for rank, result in enumerate(results):
        run = result[key]
        assert run["fired"] == fired, (key, rank, run["fired"])
        for name, differ in run["differ"].items():
            assert differ == [], (key, rank, name, differ[:5])
            assert run["moved"][name], (key, rank, name, "the EMA never moved")
    # Every EMA element on exactly one rank (per stage with pipeline parallelism).
    stages: dict[int, int] = {}
    for result in results:
        stages[result[key]["stage"]] = result[key]["model_numel"]
    assert sum(r[key]["local_numel"] for r in results) == sum(stages.values()), key


def _assert_validation(results: list[dict[str, Any]], key: str, step: int) -> None:
    logged = results[0][key]["validation"]["logged"]
    unsharded = results[0][key]["validation"]["unsharded"]
    assert set(logged) == set(unsharded) and len(logged) >= 2, (logged, unsharded)
    for name, loss in unsharded.items():
        assert math.isclose(logged[name], loss, rel_tol=2e-5), (key, name, logged, unsharded)
    for result in results:  # every rank logged the same losses
        assert result[key]["validation"]["logged"] == logged
    ema_names = [n for n in logged if n != "raw"]
    assert all(abs(logged[n] - logged["raw"]) > 1e-3 for n in ema_names), logged
    logs = dict(results[0][key]["validation_logs"])
    assert step in logs, results[0][key]["validation_logs"]
    assert logs[step]["validation_metrics/loss"] == logged["raw"]
    for name in ema_names:
        assert logs[step][f"validation_metrics/ema_loss/{name}"] == logged[name]


def test_w4_ema_bit_exact_on_every_layout(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = w4
    _assert_run(results, "llama_hsdp", [1, 2, 3, 4])
    _assert_run(results, "llama_tp", [2, 3])
    _assert_run(results, "llama_pp", [1, 2])
    _assert_run(results, "moe_hsdp", [1, 2])
    _assert_run(results, "moe_tp", [1, 2])
    assert [r["llama_pp"]["stage"] for r in results] == [0, 0, 1, 1]
    assert all(r["llama_pp"]["ema_mesh"] == [2] for r in results)  # the stage's 2 ranks
    assert any(k.endswith("expert_bias_E") for k in results[0]["moe_hsdp"]["keys"])


def test_w4_validator_logs_the_ema_loss(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = w4
    _assert_validation(results, "llama_hsdp", 4)
    _assert_validation(results, "llama_tp", 3)
    _assert_validation(results, "moe_hsdp", 2)
    _assert_validation(results, "moe_tp", 2)


def test_w2_resumes_the_w4_checkpoint(w2: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(w2):
        run = result["llama_resume"]
        assert run["loaded_step"] == 2
        assert run["loaded"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["fired"] == [3, 4]
        assert run["differ"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["reseeded"] == {"decay_0_9": [], "decay_0_5": []}, rank
        assert run["reseeded_to_step2"] == [], rank
    _assert_validation(w2, "llama_resume", 4)
    _assert_run(w2, "moe_fsdp", [1, 2, 3])
    _assert_validation(w2, "moe_fsdp", 3)


# ------------------------------------------------------------------ one process
def _plain_llama() -> nn.Module:
    """The trainers' llama3 debugmodel (2 blocks, SDPA), unsharded, in this process."""
    from titan_models import llama3_debugmodel

    return llama3_debugmodel(layers=2, seed=0)


def test_one_process_loads_the_w4_checkpoints(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """No process group: the async step-2 checkpoint's EMA into a plain model's EMA, and the
    EMA written beside the model-only final checkpoint (model keys: ``wq``/``wk``/``wv``)."""
    from dtensor_ema.integrations.torchtitan import TorchtitanEMA

    root, results = w4
    assert not dist.is_initialized()
    saved = torch.load(root / "hsdp" / "reference.pt")
    folder = root / "hsdp" / "outputs" / "checkpoint"
    model = _plain_llama()
    ema = TorchtitanEMA(TorchtitanEMA.Config(enable=True, decays=HSDP_DECAYS), model_parts=[model])
    dcp.load({"ema": ema}, checkpoint_id=str(folder / "step-2"))
    for name in ema:
        assert _differ(ema[name].ema_tensors(), saved["ema"][2][name]) == [], name

    final = dcp.FileSystemReader(str(folder / "step-4")).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in final and not any(k.startswith("ema") for k in final)
    assert results[0]["llama_hsdp"]["ema_folder"] == str(folder / "step-4" / "ema" / "decay_0_9")
    for name in ("decay_0_9", "decay_0_5"):
        state = model.state_dict()  # torchtitan's hook: fresh wq/wk/wv tensors to load into
        dcp.load(state, checkpoint_id=str(folder / "step-4" / "ema" / name))
        model.load_state_dict(state)  # its pre-hook fuses them into wqkv
        weights = {canonical_fqn(n): p.detach() for n, p in model.named_parameters()}
        assert _differ(weights, saved["ema"][4][name]) == [], name


def test_hf_export_loads_into_transformers(w4: tuple[Path, list[dict[str, Any]]]) -> None:
    """``EMATrainer.export_hf`` (EMA and raw weights) at W=4 FSDP2+TP: ``transformers``'
    Llama loaded from the files gives torchtitan's logits (the adapter permutes Q/K for
    RoPE, so not bit for bit)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    root, _ = w4
    states = torch.load(root / "tp" / "states.pt")
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kind in ("ema", "raw"):
        titan = _plain_llama()
        titan.load_state_dict(states[kind])
        hf = transformers.LlamaForCausalLM(config).eval()
        hf.load_state_dict(load_file(root / "tp" / f"hf_{kind}" / "model.safetensors"), strict=True)
        with torch.no_grad():
            want, got = titan.eval()(tokens), hf(tokens).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        logits[kind] = got
    assert not torch.allclose(logits["ema"], logits["raw"], atol=1e-3)
