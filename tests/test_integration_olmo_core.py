"""dtensor_ema.integrations.olmo_core: the EMA callback through OLMo-core's own ``Trainer``.

A tiny ``TransformerConfig.llama_like`` model trains with OLMo-core 2.x's ``Trainer`` on
FSDP2 (its ``TransformerTrainModule``, ``fully_shard`` with ``lm_head`` kept unsharded after
a forward) from a local token file (numpy ``uint16`` written with ``tofile``: no download),
its ``CheckpointerCallback`` saving asynchronously every 2 steps and its
``LMEvaluatorCallback`` evaluating every 2 steps. No training loop is written here.

* W=2 (one spawn): an uninterrupted run of 4 steps with two EMAs (decays 0.9 and 0.5),
  then a second run resumed from its step-2 checkpoint to step 4.
* W=1 (one spawn): the W=2 run's step-2 checkpoint resumed to step 3 (another world size:
  OLMo-core's per-rank pickles fall back to ``rank0.pt``; the EMA comes from DCP).
* A URL ``save_folder`` (``s3://``, moto's S3 server started here on 127.0.0.1:
  ``tests/object_store.py``; OLMo-core's boto3 and the EMA's s3fs reach it through
  ``AWS_ENDPOINT_URL``): in the same spawns, a W=2 run of 2 steps, resumed from its step-2
  checkpoint at W=2 and at W=1 to step 3.

Checks: after every optimizer step both EMAs equal, bit for bit, a reference written here
(a plain ``lerp_`` of the gathered full weights; no EMA code of the library); the EMA
update runs before the checkpointer's save (the checkpoint holds the EMA of the step it
saves, not the step before); each EMA is evaluated by the trainer's own evaluator callback
under ``eval/ema/<name>`` and every weight the model holds after the evaluations (also
``lm_head``'s, left unsharded by the forward) is the training weight, bit for bit; the EMA
lies in ``step<N>/ema/`` (DCP), the per-rank pickles hold no tensor; the resumed W=2 run
ends bit-identical to the uninterrupted one (model and EMAs), and the W=1 resume loads the
EMA bit for bit and continues it exactly. With the URL folder: the EMA is written in the
background (the checkpointer saves asynchronously), lies in ``step2/ema/`` in the bucket
beside OLMo-core's files (nothing left staged), and both resumes load it bit for bit.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import require_extra, run_ranks

require_extra("olmo_core", "olmo")
require_extra("s3fs", "test")
require_extra("moto", "test")

from object_store import LocalS3, serving_bucket  # noqa: E402

from dtensor_ema.model_keys import canonical_fqn  # noqa: E402

VOCAB = 128
SEQ = 16
DECAYS = [0.9, 0.5]
NAMES = ["decay_0_9", "decay_0_5"]
DEADLINE_S = 300.0
CLOUD = "s3://olmo-ckpts/run"


def _tokens(root: Path) -> None:
    """Token files as OLMo-core's numpy datasets read them: raw ``uint16``, documents
    ended by the EOS id (``VOCAB - 1``)."""
    rng = np.random.default_rng(0)
    for name, n in (("train", 4096), ("val", 256)):
        tokens = rng.integers(0, VOCAB - 2, n, dtype=np.uint16)
        tokens[19::20] = VOCAB - 1
        tokens.tofile(root / f"{name}.npy")


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.clone()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every float parameter and buffer of ``model`` as a full tensor (collective)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {canonical_fqn(k): _full(v) for k, v in tensors if v.is_floating_point()}


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in set(got) | set(want)
                  if k not in got or k not in want or not torch.equal(got[k], want[k]))  # fmt: skip


def _probes(start: dict[str, dict[str, torch.Tensor]] | None) -> tuple[Any, Any]:
    """Two OLMo-core callbacks of the test's own: the reference EMA (after the EMA
    callback's update, before the checkpointer) and the check that evaluations leave the
    training weights in the model (after every evaluator). The trainer runs copies of
    them: read them from ``trainer.callbacks``."""
    from olmo_core.train.callbacks import Callback
    from torch.distributed.tensor import DTensor

    def ema_full(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
        emas = trainer.callbacks["ema"].emas
        return {n: {k: _full(v) for k, v in emas[n].ema_tensors().items()} for n in NAMES}

    def mismatches(trainer: Any, want: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        got = ema_full(trainer)
        return [f"{n}:{k}" for n in NAMES for k in _differ(got[n], want[n])]

    class Reference(Callback):
        priority = 2  # added after the EMA callback: runs after it, before the checkpointer

        def __init__(self) -> None:
            self.emas = start
            self.loaded: list[str] | None = None
            self.differ: dict[int, list[str]] = {}
            self.snapshots: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
            self.trained: dict[str, torch.Tensor] = {}
            self.restored: dict[int, list[str]] = {}
            self.unsharded: dict[int, list[str]] = {}
            self.staged: dict[int, int] = {}

        def pre_train(self) -> None:
            if self.emas is None:  # the EMAs start as the weights the run starts from
                weights = _weights(self.trainer.train_module.model)
                self.emas = {n: {k: v.clone() for k, v in weights.items()} for n in NAMES}
            else:  # resumed: the EMAs loaded from the checkpoint
                self.loaded = mismatches(self.trainer, self.emas)

        def post_train_batch(self) -> None:
            assert self.emas is not None
            self.trained = _weights(self.trainer.train_module.model)
            for name, decay in zip(NAMES, DECAYS, strict=True):
                for k, v in self.emas[name].items():
                    v.lerp_(self.trained[k], 1.0 - decay)
            self.differ[self.step] = mismatches(self.trainer, self.emas)
            self.snapshots[self.step] = {
                n: {k: v.clone() for k, v in e.items()} for n, e in self.emas.items()
            }

    class AfterEvals(Callback):
        priority = -10  # after every evaluator callback

        def post_step(self) -> None:
            from dtensor_ema.checkpoint.background import staging_nbytes

            model = self.trainer.train_module.model
            reference = self.trainer.callbacks["reference"]
            # The CPU copy a background save of the EMA keeps (after a checkpoint started).
            reference.staged[self.step] = staging_nbytes()
            now = _weights(model)
            reference.restored[self.step] = _differ(now, reference.trained)
            reference.unsharded[self.step] = sorted(
                canonical_fqn(k) for k, p in model.named_parameters() if not isinstance(p, DTensor)
            )

    return Reference(), AfterEvals()


def _fit(
    root: Path,
    save: Path | str,
    steps: int,
    *,
    load: Path | str | None = None,
    start: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Build OLMo-core's trainer (FSDP2 train module, numpy data loader, checkpointer every
    2 steps, async; LM evaluator every 2 steps) with the EMA callback and the probes; fit
    to ``steps`` (from ``load`` with its trainer and optimizer state, when given); then
    evaluate, with the same evaluator, a model holding each reference EMA."""
    import olmo_core.distributed.parallel as parallel
    from olmo_core.config import DType
    from olmo_core.data import (
        NumpyDataLoaderConfig,
        NumpyFSLDatasetConfig,
        NumpyPaddedFSLDatasetConfig,
        TokenizerConfig,
    )
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback, LMEvaluatorCallbackConfig
    from olmo_core.train.train_module import (
        TransformerDataParallelConfig,
        TransformerTrainModuleConfig,
    )
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import distribute_tensor

    from dtensor_ema.integrations.olmo_core import EMACallback

    parallel._WORLD_MESH = None  # OLMo-core builds one world mesh per process; a 2nd run here
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 2)
    work = str(root / "work")
    model_config = TransformerConfig.llama_like(
        d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=4, hidden_size_multiple_of=16
    )
    torch.manual_seed(0)
    dp = TransformerDataParallelConfig(
        name=DataParallelType.fsdp, param_dtype=DType.float32, reduce_dtype=DType.float32
    )
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-2),
        dp_config=dp,
    ).build(model_config.build(init_device="meta"), device=torch.device("cpu"))  # fmt: skip
    dataset = NumpyFSLDatasetConfig(
        paths=[str(root / "train.npy")], sequence_length=SEQ, tokenizer=tokenizer, work_dir=work
    ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=4 * SEQ, seed=0, work_dir=work).build(
        dataset, dp_process_group=train_module.dp_process_group
    )
    evaluator = LMEvaluatorCallbackConfig(
        eval_dataset=NumpyPaddedFSLDatasetConfig(
            paths=[str(root / "val.npy")], metadata=[{"label": "val"}], sequence_length=SEQ,
            tokenizer=tokenizer, work_dir=work,
        ),
        eval_interval=2, eval_duration=Duration.steps(1),
    )  # fmt: skip
    reference, after_evals = _probes(start)
    config = TrainerConfig(
        save_folder=str(save), work_dir=work, device="cpu", metrics_collect_interval=1,
        max_duration=Duration.steps(steps), load_path=None if load is None else str(load),
        load_trainer_state=True, load_optim_state=True,
    )  # fmt: skip
    config = (
        config.with_callback("ema", EMACallback(decays=list(DECAYS)))
        .with_callback("reference", reference)
        .with_callback("checkpointer", CheckpointerCallback(save_interval=2, save_async=True))
        .with_callback("lm_evaluator", evaluator)
        .with_callback("after_evals", after_evals)
    )
    trainer = config.build(train_module, loader)
    metrics: dict[str, float] = {}
    record = trainer.record_metric

    def recorded(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if "CE loss" in name:
            metrics[f"{trainer.global_step}:{name}"] = float(value)
        # OLMo-core 2.6 records an async save's duration from its save thread, at whatever
        # step each rank has reached: the ranks can then reduce different metric sets in
        # gloo and deadlock (seen under load once the EMA's background write runs beside
        # the save). This test keeps that one metric out.
        if threading.current_thread() is threading.main_thread():
            record(name, value, *args, **kwargs)

    trainer.record_metric = recorded  # type: ignore[method-assign]
    trainer.fit()
    reference = trainer.callbacks["reference"]  # the trainer's copy of the callback
    ema = trainer.callbacks["ema"].emas
    out = {
        "staged": reference.staged,
        "order": list(trainer.callbacks),
        "loaded": reference.loaded,
        "differ": reference.differ,
        "restored": reference.restored,
        "unsharded": reference.unsharded,
        "emas": {n: {k: _full(v) for k, v in ema[n].ema_tensors().items()} for n in NAMES},
        "weights": _weights(trainer.train_module.model),
        "snapshots": reference.snapshots,
        "updates": {n: ema[n].updates for n in NAMES},
    }
    # The evaluator's loss of a model holding each reference EMA, put in by the test.
    model = trainer.train_module.model
    assert reference.emas is not None
    with torch.no_grad():
        for name in NAMES:
            for module in model.modules():  # an evaluation leaves lm_head unsharded
                if isinstance(module, FSDPModule):
                    module.reshard()
            params = {canonical_fqn(k): p for k, p in model.named_parameters()}
            for k, p in params.items():
                p.copy_(distribute_tensor(reference.emas[name][k], p.device_mesh, p.placements))
            trainer.callbacks["lm_evaluator"].perform_eval(prefix=f"check/{name}")
    out["metrics"] = metrics
    return out


def _environment(rank: int, world: int) -> None:
    """torchrun's variables for OLMo-core (the harness made the gloo group already). The
    objects imported so far are moved out of the garbage collector's way (OLMo-core runs
    ``gc.collect()`` at every evaluation: seconds each over torch's imports on a busy 2-core
    machine). OLMo-core's padded datasets index their token files in a
    ``ProcessPoolExecutor`` on rank 0: its workers start from a forkserver, never forked
    from the rank itself, whose gloo and trainer threads may hold a lock at the fork (a
    forked worker then hangs, and both ranks with it: seen once in a full run under load)."""
    import gc
    import multiprocessing

    from olmo_core.distributed.utils import init_distributed

    gc.freeze()
    multiprocessing.set_start_method("forkserver", force=True)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), OLMO_SHARED_FS="1")  # fmt: skip
    init_distributed(backend="gloo")


def _w2_body(rank: int, world: int, root: str) -> dict[str, Any]:
    import fsspec

    _environment(rank, world)
    base = Path(root)
    full = _fit(base, base / "full", 4)
    step2 = base / "full" / "step2"
    if rank == 0:
        torch.save(full["snapshots"][2], base / "reference_at_2.pt")
    pickled = torch.load(step2 / "train" / f"rank{rank}.pt", weights_only=False)["callbacks"]
    resumed = _fit(base, base / "resumed", 4, load=step2, start=full["snapshots"][2])
    cloud = _fit(base, CLOUD, 2)
    objects = fsspec.filesystem("s3")
    layout = {
        "run": sorted(p.rsplit("/", 1)[-1] for p in objects.ls(CLOUD, refresh=True)),
        "step2": sorted(p.rsplit("/", 1)[-1] for p in objects.ls(f"{CLOUD}/step2", refresh=True)),
        "ema": sorted(p.rsplit("/", 1)[-1][:5] for p in objects.ls(f"{CLOUD}/step2/ema")),
    }
    cloud_resumed = _fit(base, CLOUD + "-resumed", 3, load=f"{CLOUD}/step2",
                         start=cloud["snapshots"][2])  # fmt: skip
    if rank == 0:
        torch.save(cloud["snapshots"][2], base / "cloud_at_2.pt")
    return {"full": full, "resumed": resumed, "pickled": pickled,
            "files": sorted(p.name for p in step2.iterdir()), "cloud": cloud,
            "layout": layout, "cloud_resumed": cloud_resumed}  # fmt: skip


def _w1_body(rank: int, world: int, root: str) -> dict[str, Any]:
    _environment(rank, world)
    base = Path(root)
    start = torch.load(base / "reference_at_2.pt")
    local = _fit(base, base / "w1", 3, load=base / "full" / "step2", start=start)
    start = torch.load(base / "cloud_at_2.pt")
    return {"local": local, "cloud": _fit(base, CLOUD + "-w1", 3, load=f"{CLOUD}/step2",
                                          start=start)}  # fmt: skip


@pytest.fixture(scope="module")
def store() -> Any:
    with serving_bucket(CLOUD.split("/")[2]) as s3:
        yield s3


@pytest.fixture(scope="module")
def w2(
    store: LocalS3, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("olmo")
    _tokens(root)
    return root, run_ranks(_w2_body, 2, root, str(root), deadline_s=DEADLINE_S, env=store.env)


@pytest.fixture(scope="module")
def w1(store: LocalS3, w2: tuple[Path, list[dict[str, Any]]]) -> dict[str, Any]:
    root, _ = w2
    return run_ranks(_w1_body, 1, root, str(root), deadline_s=DEADLINE_S, env=store.env)[0]


@pytest.mark.distributed
def test_w2_ema_bit_exact_evaluated_and_restored(w2: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = w2
    for rank, result in enumerate(results):
        run = result["full"]
        assert run["order"].index("ema") < run["order"].index("checkpointer"), run["order"]
        assert sorted(run["differ"]) == [1, 2, 3, 4], run["differ"]
        assert all(d == [] for d in run["differ"].values()), (rank, run["differ"])
        assert run["updates"] == {n: 4 for n in NAMES}
        # After the evaluations (raw and both EMAs) the model holds the training weights,
        # lm_head's included, which OLMo-core leaves unsharded after an evaluation forward.
        assert all(d == [] for d in run["restored"].values()), (rank, run["restored"])
        assert any(k.startswith("lm_head.") for k in run["unsharded"][2]), run["unsharded"]
        metrics = run["metrics"]
        for step in (2, 4):
            raw = metrics[f"{step}:eval/lm/val/CE loss"]
            losses = [metrics[f"{step}:eval/ema/{n}/lm/val/CE loss"] for n in NAMES]
            assert len({raw, *losses}) == 3, metrics
        for name in NAMES:  # the logged EMA loss is that of a model holding the EMA
            logged = metrics[f"4:eval/ema/{name}/lm/val/CE loss"]
            assert logged == metrics[f"4:check/{name}/lm/val/CE loss"], (name, metrics)


@pytest.mark.distributed
def test_w2_checkpoint_holds_the_ema_beside_the_model_and_resumes_bit_exact(
    w2: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = w2
    for rank, result in enumerate(results):
        assert result["files"] == [".metadata.json", "ema", "model_and_optim", "train"], result
        # the per-rank pickle: which step and EMAs, no tensor
        assert result["pickled"]["ema"] == {"step": 2, "names": NAMES, "folder": "ema"}
        resumed, full = result["resumed"], result["full"]
        assert resumed["loaded"] == [], (rank, resumed["loaded"])  # the step-2 EMA, not step 1's
        assert sorted(resumed["differ"]) == [3, 4]
        assert all(d == [] for d in resumed["differ"].values()), (rank, resumed["differ"])
        assert resumed["updates"] == full["updates"]
        assert _differ(resumed["weights"], full["weights"]) == []
        for name in NAMES:
            assert _differ(resumed["emas"][name], full["emas"][name]) == [], name
    assert not (root / "full" / ".ema-staging").exists()
    assert sorted(p.name for p in (root / "full").iterdir()) == ["step0", "step2", "step4"]


@pytest.mark.distributed
def test_w1_resumes_the_w2_checkpoint(w1: dict[str, Any]) -> None:
    for run in (w1["local"], w1["cloud"]):
        assert run["loaded"] == [], run["loaded"]
        assert sorted(run["differ"]) == [3] and run["differ"][3] == [], run["differ"]
        assert run["updates"] == {n: 3 for n in NAMES}


@pytest.mark.distributed
def test_w2_url_save_folder_keeps_the_ema_beside_the_checkpoint_and_resumes(
    w2: tuple[Path, list[dict[str, Any]]],
) -> None:
    """A URL ``save_folder``: the EMA is written in the background (OLMo-core's
    checkpointer saves asynchronously), moved into ``step2/ema`` in the bucket (one save
    and its ``current.json``; nothing left staged), and a W=2 resume loads it bit for bit and
    continues it exactly (W=1: ``test_w1_resumes_the_w2_checkpoint``)."""
    _, results = w2
    for rank, result in enumerate(results):
        cloud, resumed, layout = result["cloud"], result["cloud_resumed"], result["layout"]
        assert all(d == [] for d in cloud["differ"].values()), (rank, cloud["differ"])
        assert cloud["staged"][2] > 0, cloud["staged"]  # the step-2 EMA: a background save
        assert layout["run"] == ["step0", "step2"], layout  # no .ema-staging left
        assert layout["step2"] == [".metadata.json", "ema", "model_and_optim", "train"], layout
        assert layout["ema"] == ["curre", "save-"], layout
        assert resumed["loaded"] == [], (rank, resumed["loaded"])
        assert sorted(resumed["differ"]) == [3] and resumed["differ"][3] == [], resumed["differ"]
        assert resumed["updates"] == {n: 3 for n in NAMES}


def test_callback_checks_its_fields_and_runs_before_the_checkpointer() -> None:
    """Bad fields are refused when the callback is made (naming the value); its priority is
    above OLMo-core's checkpointer's, so the EMA is updated before a save."""
    from olmo_core.train.callbacks import CheckpointerCallback, ModelMergeCallback

    from dtensor_ema.integrations.olmo_core import EMACallback

    assert EMACallback.priority > CheckpointerCallback.priority
    assert EMACallback.priority >= ModelMergeCallback.priority
    assert EMACallback(decays=[0.999, 0.5]).names == ["decay_0_999", "decay_0_5"]
    for bad, match in (
        ({"decays": [1.0]}, r"decays must lie in \[0, 1\), got 1.0"),
        ({"decays": []}, "decays is empty"),
        ({"decays": [0.9, 0.9]}, "decays must differ"),
        ({"tau": -1}, "tau must be None or a number >= 0, got -1"),
        ({"ema_options": {"decay": 0.5}}, r"ema_options \['decay'\] are not shared"),
        ({"update_every_n_steps": 0}, "update_every_n_steps must be an int >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=match):
            EMACallback(**bad)
    with pytest.raises(RuntimeError, match="no EMA yet"):
        _ = EMACallback().emas
