"""Checkpoints across world sizes and wrappers, resumed bit for bit; atomic saves; exports.

Every checkpoint is saved once, at W=4 from DDP and FSDP2 models and in this process with no
process group, after ``K`` updates. One spawn per world size W = 1, 2, 3, 4 loads each of
them into DDP and FSDP2 models (this process loads them with no process group), runs ``N``
more updates, and compares with an EMA that never stopped. Spawns: the W=4 saver (which also
does the W=4 loads once every save finished), loaders at W = 1, 2, 3, and one run in which a
rank is killed mid-save.

The model trajectory does not depend on W: instead of training, step ``s`` adds a seeded
random delta to every float tensor (and 1 to integer buffers), computed in full and sliced
for sharded parameters. The reference (:class:`models.ReferenceEMA`, plain ``lerp_`` on full
tensors) follows the same trajectory in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from crafted import checkpoints_under, refused_globals, replace_value
from dist_harness import run_ranks
from models import ReferenceEMA, make_model, mismatches
from models import error_text as _error
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import (
    CheckpointError,
    ModelEMA,
    MultiModelEMA,
    convert_checkpoint,
    export_ema,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.distributed

HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None

DECAY, TAU = 0.9, 2.0  # a steep ramp: a resume that lost the counter uses other decays
K, N = 3, 3  # updates before the save, and after the load
SAVE_W = 4
LOAD_WS = [1, 2, 3, 4]

CHECKPOINTS: dict[str, tuple[str, str]] = {
    "ddp_edge": ("edge", "ddp"),
    "ddp_tf": ("transformer", "ddp"),
    "fsdp_tf": ("transformer", "fsdp"),
    "fsdp_edge": ("edge1d", "fsdp"),
    "plain_tf": ("transformer", "plain"),  # saved in this process, no process group
}
DIST_LOADS = [  # (checkpoint, wrapper it is loaded into), at every W
    ("ddp_edge", "ddp"),
    ("ddp_tf", "ddp"),
    ("fsdp_tf", "ddp"),
    ("plain_tf", "ddp"),
    ("ddp_tf", "fsdp"),
    ("fsdp_tf", "fsdp"),
    ("fsdp_edge", "fsdp"),
    ("plain_tf", "fsdp"),
]
PLAIN_LOADS = [
    ("ddp_edge", "plain"),
    ("ddp_tf", "plain"),
    ("fsdp_tf", "plain"),
    ("fsdp_edge", "plain"),
]


# ------------------------------------------------------------------ models and trajectory
def build(
    model_name: str, wrapper: str, seed: int = 0, tweak: Callable[[nn.Module], None] | None = None
) -> tuple[nn.Module, nn.Module]:
    """``(module, wrapped)``: the same weights on every rank for a given seed; ``tweak``
    changes the module before it is wrapped."""
    module = make_model(model_name.removesuffix("1d"), seed=seed)
    if model_name == "edge1d":  # fully_shard refuses 0-dim parameters
        module.scalar = nn.Parameter(module.scalar.detach().reshape(1))
    if tweak is not None:
        tweak(module)
    if wrapper == "ddp":
        return module, DDP(module)
    if wrapper == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        blocks = [module.conv] if model_name == "edge1d" else list(module.blocks.layers)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module, module
    return module, module


@torch.no_grad()
def perturb_(module: nn.Module, step: int) -> None:
    """Step ``step`` of the trajectory: the same full values at any W and wrapper."""
    seen: set[int] = set()
    for fqn, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights move once
            continue
        seen.add(id(tensor))
        if not tensor.is_floating_point():
            tensor.add_(1)
            continue
        g = torch.Generator().manual_seed(step * 1_000_003 + zlib.crc32(fqn.encode()))
        delta = (torch.randn(tensor.shape, generator=g) * 0.1).to(tensor.dtype)
        if isinstance(tensor, DTensor):
            local = distribute_tensor(
                delta, tensor.device_mesh, tensor.placements, src_data_rank=None
            )
            tensor.to_local().add_(local.to_local())
        else:
            tensor.detach().add_(delta)


def full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors by torch's own gather (``full_tensor``), independent of the library."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in tensors.items()
    }


def references() -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Per model: the EMA and the model after ``K`` and ``K + N`` steps, unsharded."""
    out = {}
    for model_name in sorted({m for m, _ in CHECKPOINTS.values()}):
        module, _ = build(model_name, "plain")
        ref = ReferenceEMA(module.state_dict(), DECAY, TAU)
        out[model_name] = {}
        for step in range(1, K + N + 1):
            perturb_(module, step)
            ref.update(module.state_dict())
            if step in (K, K + N):
                out[model_name][f"ema@{step}"] = {k: v.clone() for k, v in ref.ema.items()}
                out[model_name][f"model@{step}"] = full(module.state_dict())
    return out


def _ema_vs(ema: ModelEMA, expected: dict[str, torch.Tensor]) -> list[str]:
    actual = full(ema.ema_tensors())
    return mismatches(actual, {k: expected[k] for k in actual})


# ------------------------------------------------------------------------------- save
def save_one(name: str, tmp: Path) -> dict[str, Any]:
    """Run ``K`` steps, save; run ``N`` more (the run that never stopped) and keep its EMA."""
    model_name, wrapper = CHECKPOINTS[name]
    refs = torch.load(tmp / "refs.pt", weights_only=True)[model_name]
    module, wrapped = build(model_name, wrapper)
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)
    for step in range(1, K + 1):
        perturb_(module, step)
        ema.update()
    out = {"at_save": _ema_vs(ema, refs[f"ema@{K}"])}
    save_checkpoint({"model": module.state_dict(), "ema": ema}, tmp / "ckpt" / name)
    for step in range(K + 1, K + N + 1):
        perturb_(module, step)
        ema.update()
    uninterrupted = full(ema.ema_tensors())
    out["uninterrupted"] = mismatches(
        uninterrupted, {k: refs[f"ema@{K + N}"][k] for k in uninterrupted}
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(uninterrupted, tmp / f"uninterrupted-{name}.pt")
    return out


def async_scenarios(tmp: Path) -> dict[str, Any]:
    """``dcp.async_save`` of a live EMA that keeps updating while the save is pending."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    out: dict[str, Any] = {}
    group = dist.new_group(backend="gloo")  # the upload thread's collectives get their own group
    module, wrapped = build("edge", "ddp")
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)
    for step in range(1, K + 1):
        perturb_(module, step)
        ema.update()
    saved = full(ema.ema_tensors())

    # torch 2.14's default stager copies the state to the CPU before async_save returns.
    future = dcp.async_save(
        {"ema": ema}, checkpoint_id=str(tmp / "async-default"), process_group=group
    )
    out["default_returns"] = type(future).__name__
    for step in range(K + 1, K + 3):
        perturb_(module, step)
        ema.update()
    future.result()

    # With async staging the EMA must wait for staging_completion before it changes.
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    snapshot, snapshot_updates = full(ema.ema_tensors()), ema.updates
    response = dcp.async_save(
        {"ema": ema},
        checkpoint_id=str(tmp / "async-staged"),
        process_group=group,
        async_stager=stager,
    )
    out["staged_returns"] = type(response).__name__
    response.staging_completion.result()
    perturb_(module, 99)
    ema.update()
    response.upload_completion.result()
    stager.close()

    for ckpt, expected, updates in (
        ("async-default", saved, K),
        ("async-staged", snapshot, snapshot_updates),
    ):
        _, fresh_wrapped = build("edge", "ddp", seed=1)
        fresh = ModelEMA(fresh_wrapped, decay=DECAY, tau=TAU)
        load_checkpoint({"ema": fresh}, tmp / ckpt)
        out[ckpt] = {
            "mismatch": mismatches(full(fresh.ema_tensors()), expected),
            "updates": fresh.updates == updates,
        }
    dist.destroy_process_group(group)
    return out


def saver_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {
        name: save_one(name, Path(tmp)) for name, (_, w) in CHECKPOINTS.items() if w != "plain"
    }
    results["async"] = async_scenarios(Path(tmp))
    dist.barrier()  # every checkpoint is on disk: the W=4 loads run in this spawn too
    results["loads"] = loader_body(rank, world_size, tmp)
    return results


# ------------------------------------------------------------------------------- load
def load_one(ckpt: str, wrapper: str, tmp: Path) -> dict[str, Any]:
    """Load into a model built from other weights, check, then run ``N`` more updates."""
    model_name = CHECKPOINTS[ckpt][0]
    refs = torch.load(tmp / "refs.pt", weights_only=True)[model_name]
    module, wrapped = build(model_name, wrapper, seed=1)  # loading must replace every value
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)
    state = {"model": module.state_dict(), "ema": ema}
    load_checkpoint(state, tmp / "ckpt" / ckpt)
    module.load_state_dict(state["model"])
    out: dict[str, Any] = {
        "updates": ema.updates,
        "ema_at_load": _ema_vs(ema, refs[f"ema@{K}"]),
        "model_at_load": mismatches(full(module.state_dict()), refs[f"model@{K}"]),
    }
    for step in range(K + 1, K + N + 1):
        perturb_(module, step)
        ema.update()
    out["ema_resumed"] = _ema_vs(ema, refs[f"ema@{K + N}"])
    never_stopped = torch.load(tmp / f"uninterrupted-{ckpt}.pt", weights_only=True)
    out["vs_never_stopped"] = mismatches(full(ema.ema_tensors()), never_stopped)
    out["module"], out["ema"] = module, ema
    return out


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _add_extra(module: nn.Module) -> None:
    module.extra = nn.Parameter(torch.randn(4, 2))


def _widen_odd(module: nn.Module) -> None:
    module.odd = nn.Parameter(torch.randn(13, 8))


def bad_input_scenarios(tmp: Path, wrapper: str) -> dict[str, Any]:
    """Refused checkpoints, each with the error it raised and whether the EMA it was
    loaded into stayed exactly as it was."""
    root = tmp / f"bad-{wrapper}"
    module, wrapped = build("edge", wrapper)
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)
    perturb_(module, 1)
    ema.update()
    save_checkpoint({"ema": ema, "model": module.state_dict()}, root / "edge")
    _, extra_wrapped = build("edge", wrapper, tweak=_add_extra)
    save_checkpoint({"ema": ModelEMA(extra_wrapped, decay=DECAY, tau=TAU)}, root / "extra")
    save_checkpoint({"model": module.state_dict()}, root / "foreign")
    if _is_rank0():
        for name in ("missing-file", "no-metadata", "truncated"):
            shutil.copytree(root / "edge", root / name)
        data_files = sorted(p.name for p in (root / "edge").glob("*.distcp"))
        (root / "missing-file" / data_files[-1]).unlink()
        (root / "no-metadata" / ".metadata").unlink()
        with open(root / "truncated" / data_files[0], "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) // 2)
    _barrier()

    cases: dict[str, tuple[ModelEMA, str]] = {
        "missing_key": (
            ModelEMA(build("edge", wrapper, tweak=_add_extra)[1], decay=DECAY, tau=TAU),
            "edge",
        ),
        "extra_key": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "extra"),
        "shape": (
            ModelEMA(build("edge", wrapper, tweak=_widen_odd)[1], decay=DECAY, tau=TAU),
            "edge",
        ),
        "dtype": (
            ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU, ema_dtype=torch.float64),
            "edge",
        ),
        "decay": (ModelEMA(build("edge", wrapper)[1], decay=0.5, tau=TAU), "edge"),
        "no_path": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "nowhere"),
        "foreign": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "foreign"),
        "missing_file": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "missing-file"),
        "no_metadata": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "no-metadata"),
        "truncated": (ModelEMA(build("edge", wrapper)[1], decay=DECAY, tau=TAU), "truncated"),
    }
    out: dict[str, Any] = {"data_files": data_files if _is_rank0() else None}
    for case, (target, ckpt) in cases.items():
        target.updates = 7
        before = full(target.ema_tensors())
        error = _error(lambda: load_checkpoint({"ema": target}, root / ckpt))  # noqa: B023
        unchanged = mismatches(full(target.ema_tensors()), before) == [] and target.updates == 7
        out[case] = {"error": error, "unchanged": unchanged}
    return out


def atomic_scenarios(tmp: Path) -> dict[str, Any]:
    """Saves that fail halfway must leave the last good checkpoint loadable and unchanged."""
    rank = dist.get_rank()
    path = tmp / "atomic" / "ckpt"
    partial, previous = path.with_name("ckpt.partial"), path.with_name("ckpt.previous")
    module, wrapped = build("edge", "ddp")
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)

    def advance_and_save(step: int) -> dict[str, torch.Tensor]:
        perturb_(module, step)
        ema.update()
        save_checkpoint({"ema": ema, "model": module.state_dict()}, path)
        return full(ema.ema_tensors())

    def reload() -> dict[str, Any]:
        fresh = ModelEMA(build("edge", "ddp", seed=1)[1], decay=DECAY, tau=TAU)
        load_checkpoint({"ema": fresh}, path)
        return {"ema": full(fresh.ema_tensors()), "updates": fresh.updates}

    out: dict[str, Any] = {}
    good = advance_and_save(1)
    perturb_(module, 2)
    ema.update()

    original_write = FileSystemWriter.write_data

    def failing_write(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        if rank == 2:
            raise OSError("injected: disk full on rank 2")
        return original_write(self, plan, planner)

    FileSystemWriter.write_data = failing_write  # type: ignore[method-assign]
    try:
        out["write_error"] = _error(lambda: save_checkpoint({"ema": ema}, path))
    finally:
        FileSystemWriter.write_data = original_write  # type: ignore[method-assign]
    out["partial_after_write_error"] = partial.exists()
    got = reload()
    out["after_write_error"] = (mismatches(got["ema"], good), got["updates"])

    class Exploding:
        def state_dict(self) -> dict[str, Any]:
            if rank == 1:
                raise RuntimeError("injected: rank 1 cannot produce its state")
            return {"x": torch.zeros(1)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    out["state_error"] = _error(lambda: save_checkpoint({"ema": ema, "extra": Exploding()}, path))
    got = reload()
    out["after_state_error"] = (mismatches(got["ema"], good), got["updates"])

    second = advance_and_save(3)
    out["partial_after_success"] = partial.exists()
    got = reload()
    out["after_success"] = (mismatches(got["ema"], second), got["updates"])

    # A save killed between its two renames leaves the last good checkpoint in .previous.
    if rank == 0:
        os.rename(path, previous)
    _barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = reload()
    out["fallback_warning"] = [str(w.message) for w in caught if "interrupted" in str(w.message)]
    out["after_interrupted_commit"] = (mismatches(got["ema"], second), got["updates"])
    third = advance_and_save(4)
    got = reload()
    out["after_recovery"] = (mismatches(got["ema"], third), got["updates"])
    out["leftovers"] = sorted(p.name for p in path.parent.iterdir() if p != path)
    return out


def kill_body(rank: int, world_size: int, tmp: str) -> str:
    """Rank 1 is SIGKILLed after writing its data file of the second save."""
    path = Path(tmp) / "ckpt"
    module, wrapped = build("edge", "ddp")
    ema = ModelEMA(wrapped, decay=DECAY, tau=TAU)
    perturb_(module, 1)
    ema.update()
    save_checkpoint({"ema": ema}, path)
    expected = full(ema.ema_tensors())  # collective
    if rank == 0:
        torch.save(expected, Path(tmp) / "expected.pt")
    perturb_(module, 2)
    ema.update()
    if rank == 1:
        original_write = FileSystemWriter.write_data

        def dying_write(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
            original_write(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = dying_write  # type: ignore[method-assign]
    try:
        save_checkpoint({"ema": ema}, path)
        outcome = "saved"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    (Path(tmp) / f"outcome{rank}.json").write_text(json.dumps(outcome))
    return outcome


def loader_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if world_size == 3:
        results["bad_inputs"] = bad_input_scenarios(Path(tmp) / "w3", "ddp")
        results["atomic"] = atomic_scenarios(Path(tmp) / "w3")
    for ckpt, wrapper in DIST_LOADS:
        loaded = load_one(ckpt, wrapper, Path(tmp))
        module, ema = loaded.pop("module"), loaded.pop("ema")
        if world_size == 3 and (ckpt, wrapper) in (("ddp_tf", "ddp"), ("fsdp_tf", "fsdp")):
            # Export after resuming: the file must hold the EMA after K + N steps.
            out_dir = Path(tmp) / f"export-w{world_size}-{wrapper}"
            out_dir.mkdir(exist_ok=True)  # export creates no directories
            export_ema(ema, out_dir / "ema.pt", bucket_bytes=4096)  # many small buckets
            if HAVE_SAFETENSORS:
                export_ema(ema, out_dir / "ema.safetensors")
        results[f"{ckpt}->{wrapper}"] = loaded
        del module, ema
    dist.barrier()
    return results


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("checkpoints")
    torch.save(references(), tmp / "refs.pt")
    assert not dist.is_initialized()
    plain = save_one("plain_tf", tmp)
    results = run_ranks(saver_body, SAVE_W, tmp, str(tmp))
    for r in results:
        r["plain_tf"] = plain
    return tmp, results


_LOADED: dict[tuple[str, int], list[dict[str, Any]]] = {}


def _loaded_at(tmp: Path, world_size: int) -> list[dict[str, Any]]:
    """One loader spawn per world size, shared by the fixtures below."""
    key = (str(tmp), world_size)
    if key not in _LOADED:
        _LOADED[key] = run_ranks(loader_body, world_size, tmp / f"load-w{world_size}", str(tmp))
    return _LOADED[key]


@pytest.fixture(scope="module", params=LOAD_WS, ids=lambda w: f"W{w}")
def loaded(
    request: pytest.FixtureRequest, saved: tuple[Path, list[dict[str, Any]]]
) -> tuple[int, list[dict[str, Any]]]:
    tmp, results = saved
    if request.param == SAVE_W:  # loaded by the saver's spawn, after all saves finished
        return SAVE_W, [r["loads"] for r in results]
    return request.param, _loaded_at(tmp, request.param)


@pytest.fixture(scope="module")
def loaded_w3(saved: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The W=3 loader also exports, and runs the atomicity and bad-input scenarios."""
    return _loaded_at(saved[0], 3)


# ------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_saved_runs_follow_the_reference(saved: Any, name: str) -> None:
    _, results = saved
    for rank, r in enumerate(results):
        assert r[name] == {"at_save": [], "uninterrupted": []}, f"rank {rank}"


@pytest.mark.parametrize(("ckpt", "wrapper"), DIST_LOADS, ids=[f"{c}->{w}" for c, w in DIST_LOADS])
def test_reshard_and_resume_exactly(loaded: Any, ckpt: str, wrapper: str) -> None:
    world_size, results = loaded
    for rank, r in enumerate(results):
        got = r[f"{ckpt}->{wrapper}"]
        assert got["updates"] == K, f"W={world_size} rank {rank}"
        assert got["ema_at_load"] == [] and got["model_at_load"] == [], (
            f"W={world_size} rank {rank}"
        )
        assert got["ema_resumed"] == [], f"W={world_size} rank {rank}"
        assert got["vs_never_stopped"] == [], f"W={world_size} rank {rank}"


@pytest.mark.parametrize(
    ("ckpt", "wrapper"), PLAIN_LOADS, ids=[f"{c}->{w}" for c, w in PLAIN_LOADS]
)
def test_reshard_into_one_process_without_process_group(
    saved: Any, ckpt: str, wrapper: str
) -> None:
    tmp, _ = saved
    assert not dist.is_initialized()
    got = load_one(ckpt, wrapper, tmp)
    assert got["ema"].mesh is None
    assert got["updates"] == K
    assert got["ema_at_load"] == [] and got["model_at_load"] == []
    assert got["ema_resumed"] == [] and got["vs_never_stopped"] == []


def test_every_layout_is_read_with_the_restricted_unpickler(saved: Any) -> None:
    """The DDP and FSDP2 checkpoints saved at W=4, the async saves and the one saved without
    a process group hold only the globals the restricted reader allows (issue 27)."""
    tmp, _ = saved
    directories = checkpoints_under(tmp)
    names = {d.name for d in directories}
    assert names >= {*CHECKPOINTS, "async-default", "async-staged"}, names
    assert {str(d): refused_globals(d) for d in directories} == {str(d): set() for d in directories}


def test_async_save_snapshots_the_ema(saved: Any) -> None:
    _, results = saved
    for r in results:
        got = r["async"]
        assert got["default_returns"] == "Future"  # staged before returning (torch 2.14)
        assert got["staged_returns"] == "AsyncSaveResponse"
        assert got["async-default"] == {"mismatch": [], "updates": True}
        assert got["async-staged"] == {"mismatch": [], "updates": True}


def test_export_gathers_the_full_ema_keyed_like_the_model(saved: Any, loaded_w3: Any) -> None:
    tmp, _ = saved
    refs = torch.load(tmp / "refs.pt", weights_only=True)["transformer"]
    module, _ = build("transformer", "plain")
    keys = list(module.state_dict())
    expected = {k: refs[f"ema@{K + N}"][k] for k in keys}
    for wrapper in ("ddp", "fsdp"):
        out_dir = tmp / f"export-w3-{wrapper}"
        exported = torch.load(out_dir / "ema.pt", weights_only=True)
        assert list(exported) == keys  # tied head.weight included, in state-dict order
        assert mismatches(exported, expected) == []
        assert exported["head.weight"].data_ptr() == exported["tok.weight"].data_ptr()
        fresh, _ = build("transformer", "plain", seed=1)
        fresh.load_state_dict(exported, strict=True)
        assert not list(out_dir.glob("*.partial"))

        if not HAVE_SAFETENSORS:
            continue
        from safetensors.torch import load_file, load_model

        tensors = load_file(out_dir / "ema.safetensors")
        assert set(tensors) == set(keys) - {"head.weight"}  # tied weights stored once
        assert mismatches(tensors, {k: expected[k] for k in tensors}) == []
        fresh, _ = build("transformer", "plain", seed=1)
        missing, unexpected = load_model(fresh, out_dir / "ema.safetensors")
        assert not missing and not unexpected
        assert mismatches(fresh.state_dict(), expected) == []


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_checkpoint_offline(saved: Any, tmp_path: Path, suffix: str) -> None:
    tmp, _ = saved
    if suffix == ".safetensors" and not HAVE_SAFETENSORS:
        pytest.skip("safetensors is not installed")
    refs = torch.load(tmp / "refs.pt", weights_only=True)["transformer"]
    out = tmp_path / f"ema{suffix}"
    returned = convert_checkpoint(tmp / "ckpt" / "fsdp_tf", out)
    if suffix == ".pt":
        written = torch.load(out, weights_only=True)
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        written = load_file(out)
        with safe_open(out, "pt") as f:
            assert f.metadata()["dtensor_ema.updates"] == str(K)
    module, _ = build("transformer", "plain")
    # Averaged tensors only, keyed like the model: the tied duplicate is not averaged.
    assert set(written) == set(module.state_dict()) - {"head.weight"}
    assert mismatches(written, {k: refs[f"ema@{K}"][k] for k in written}) == []
    assert mismatches(returned, written) == []
    module.load_state_dict(written, strict=False)
    halves = convert_checkpoint(
        tmp / "ckpt" / "fsdp_tf", tmp_path / f"bf16{suffix}", dtype=torch.bfloat16
    )
    assert all(v.dtype == torch.bfloat16 for v in halves.values())
    assert mismatches(halves, {k: v.to(torch.bfloat16) for k, v in written.items()}) == []
    with pytest.raises(ValueError, match=r"no EMA tensors under 'model'.*top-level entries"):
        convert_checkpoint(tmp / "ckpt" / "fsdp_tf", tmp_path / "x.pt", key="model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_checkpoint(tmp / "ckpt" / "nowhere", tmp_path / "x.pt")


# ---------------------------------------------------------------- atomicity, bad input
def _assert_bad_inputs(
    out: dict[str, Any], data_files: list[str], dist_ranks: list[int] | None = None
) -> None:
    expected = {
        "missing_key": r"^ValueError: checkpoint .* does not match the EMA under 'ema' "
        r"\(a different model\?\): missing \['extra'\]$",
        "extra_key": r"^ValueError: .* does not match the EMA .*: unexpected \['extra'\]$",
        "shape": r"^ValueError: .*mismatched \['odd: saved \(13, 7\) torch.float32, this EMA "
        r"\(13, 8\) torch.float32'\]$",
        "dtype": r"^ValueError: .*mismatched \[.*'odd: saved \(13, 7\) torch.float32, this EMA "
        r"\(13, 7\) torch.float64'",
        "decay": r"^ValueError: checkpoint .* cannot resume the EMA under 'ema': .*decay",
        "no_path": r"^FileNotFoundError: no checkpoint at .*nowhere: the directory does not exist$",
        "foreign": r"^ValueError: checkpoint .*foreign has no EMA state under 'ema'; its "
        r"top-level entries are \['model'\]$",
        "missing_file": rf"^FileNotFoundError: checkpoint .* is incomplete: data files "
        rf"\['{data_files[-1]}'\] named by its .metadata are missing$",
        "no_metadata": r"^FileNotFoundError: .*no-metadata is not a complete DCP checkpoint: it "
        r"has no .metadata file",
        "truncated": rf"^FileNotFoundError: checkpoint .* is incomplete: truncated data files "
        rf"\['{data_files[0]} \(\d+ bytes, needs \d+\)'\]$",
    }
    assert set(out) - {"data_files"} == set(expected)
    for case, pattern in expected.items():
        error = out[case]["error"]
        assert error is not None, case
        if dist_ranks is not None:
            # Every rank raises agree's message: "<Type>: <step> failed on ranks [..]:
            # <Type>: <the error every rank saw>".
            head, sep, error = error.partition(f" failed on ranks {dist_ranks}: ")
            assert sep and head.split(": ", 1)[0] == error.split(": ", 1)[0], (case, head)
        assert re.search(pattern, error), (case, error)
        assert out[case]["unchanged"], f"{case}: the refused load changed the EMA"


def test_bad_checkpoints_are_refused_before_anything_is_written(loaded_w3: Any) -> None:
    results = loaded_w3
    data_files = results[0]["bad_inputs"]["data_files"]
    assert data_files == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    for r in results:
        _assert_bad_inputs(r["bad_inputs"], data_files, [0, 1, 2])


def test_bad_checkpoints_without_process_group(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    out = bad_input_scenarios(tmp_path, "plain")
    _assert_bad_inputs(out, out["data_files"])


def test_failed_saves_keep_the_last_good_checkpoint(loaded_w3: Any) -> None:
    results = loaded_w3
    for rank, r in enumerate(results):
        got = r["atomic"]
        # DCP gathers the write errors of all ranks and raises them on every rank.
        assert re.search(
            r"^CheckpointError: saving .*ckpt failed, the checkpoint there is unchanged:.*"
            r"injected: disk full on rank 2",
            got["write_error"],
            re.S,
        )
        # Every rank raises rank 1's error, naming rank 1.
        assert re.search(
            r"^RuntimeError: collecting the state to save to .*ckpt failed on rank 1: "
            r"RuntimeError: injected: rank 1 cannot produce its state$",
            got["state_error"],
        ), (rank, got["state_error"])
        assert got["after_write_error"] == ([], 1)
        assert got["after_state_error"] == ([], 1)
        assert got["partial_after_write_error"]  # evidence the save died mid-way
        assert not got["partial_after_success"]
        assert got["after_success"] == ([], 3)
        assert len(got["fallback_warning"]) == 1
        assert got["after_interrupted_commit"] == ([], 3)
        assert got["after_recovery"] == ([], 4)
        assert got["leftovers"] == []


def test_killed_rank_never_damages_the_last_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"rank 1: exited with code -9"):
        run_ranks(kill_body, 2, tmp_path, str(tmp_path))
    outcome = json.loads((tmp_path / "outcome0.json").read_text())
    assert outcome != "saved"  # rank 0 saw its peer die and did not commit
    assert not (tmp_path / "outcome1.json").exists()  # rank 1 really died mid-save
    assert (tmp_path / "ckpt.partial").is_dir()
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    fresh = ModelEMA(build("edge", "plain", seed=1)[1], decay=DECAY, tau=TAU)
    load_checkpoint({"ema": fresh}, tmp_path / "ckpt")
    assert fresh.updates == 1
    assert mismatches(full(fresh.ema_tensors()), expected) == []


class _Sneaky:
    """Unpickling this runs ``_sneaky_side_effect``: what ``weights_only`` must refuse."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_sneaky_side_effect, ())


def _sneaky_side_effect() -> None:
    Path(os.environ["SNEAKY_MARKER"]).touch()


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path, monkeypatch: Any) -> None:
    """A value (or, crafted, a tensor) whose pickle refers to other objects is refused with
    one line naming the checkpoint and the entry, without torch's advice to retry with
    ``weights_only=False`` and without DCP's traceback text (issue 35)."""
    marker = tmp_path / "executed"
    monkeypatch.setenv("SNEAKY_MARKER", str(marker))
    module, _ = build("edge", "plain")
    ema = ModelEMA(module, decay=DECAY, tau=TAU)
    path = tmp_path / "ckpt"
    save_checkpoint({"ema": ema, "extra": {"payload": _Sneaky()}}, path)
    assert not marker.exists()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint({"ema": ema, "extra": {"payload": None}}, path)
    assert str(info.value) == (
        f"{path}/__0_0.distcp: entry 'extra.payload' is not a tensor or plain value: its "
        "pickle refers to other objects; refused (nothing in it was run)"
    )
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # A tensor's pickle replaced by one of another object, checksums rewritten to match.
    crafted = Path(shutil.copytree(path, tmp_path / "tensor"))
    replace_value(crafted, "ema.ema.odd", _Sneaky())
    with pytest.raises(CheckpointError) as info:
        load_checkpoint({"ema": ema}, crafted)
    assert re.fullmatch(
        rf"{re.escape(str(crafted))}/__0_0\.distcp: entry 'ema\.ema\.odd' \(chunk at offsets "
        r"\(0, 0\)\) is not a tensor or plain value: its pickle refers to other objects; "
        r"refused \(nothing in it was run\)",
        str(info.value),
    ), str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not marker.exists()


def test_optimizer_state_round_trips_through_weights_only_loading(tmp_path: Path) -> None:
    """Non-tensor optimizer values (param_groups: floats, tuples, None, bools) load with
    ``weights_only=True``."""
    module, _ = build("transformer", "plain")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.8, 0.9))
    module(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    ema = ModelEMA(module, decay=DECAY, tau=TAU)
    ema.update()
    save_checkpoint(
        {"model": module.state_dict(), "optim": optimizer.state_dict(), "ema": ema}, tmp_path / "c"
    )
    fresh, _ = build("transformer", "plain", seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_ema = ModelEMA(fresh, decay=DECAY, tau=TAU)
    state = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict(), "ema": fresh_ema}
    fresh(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    fresh_optimizer.step()  # allocate state to load into
    state["optim"] = fresh_optimizer.state_dict()
    load_checkpoint(state, tmp_path / "c")
    fresh_optimizer.load_state_dict(state["optim"])
    assert fresh_optimizer.param_groups[0]["lr"] == 1e-3
    assert fresh_optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    saved_state = optimizer.state_dict()["state"]
    for index, values in fresh_optimizer.state_dict()["state"].items():
        assert mismatches(values, saved_state[index]) == [], index
    assert fresh_ema.updates == 1
    assert mismatches(fresh_ema.ema_tensors(), ema.ema_tensors()) == []


def test_export_without_safetensors_is_a_clear_error(tmp_path: Path, monkeypatch: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import raises ImportError
    ema = ModelEMA(build("edge", "plain")[0])
    with pytest.raises(
        ImportError, match=r"writing .*ema.safetensors needs the safetensors package"
    ):
        export_ema(ema, tmp_path / "ema.safetensors")
    export_ema(ema, tmp_path / "ema.pt")
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert list(exported) == list(build("edge", "plain")[0].state_dict())


def test_multi_model_ema_is_checked_per_member(tmp_path: Path) -> None:
    module, _ = build("edge", "plain")
    multi = MultiModelEMA(module, {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": DECAY}})
    perturb_(module, 1)
    multi.update()
    save_checkpoint({"emas": multi}, tmp_path / "c")
    fresh = MultiModelEMA(
        build("edge", "plain", seed=1)[0],
        {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": DECAY}},
    )
    load_checkpoint({"emas": fresh}, tmp_path / "c")
    for name in ("fast", "slow"):
        assert fresh[name].updates == 1
        assert mismatches(fresh[name].ema_tensors(), multi[name].ema_tensors()) == []

    other = MultiModelEMA(
        build("edge", "plain", seed=1)[0],
        {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": 0.25}},
    )
    before = {name: full(other[name].ema_tensors()) for name in ("fast", "slow")}
    with pytest.raises(ValueError, match=r"cannot resume the EMA under 'emas.slow': .*decay"):
        load_checkpoint({"emas": other}, tmp_path / "c")
    for name in ("fast", "slow"):
        assert other[name].updates == 0
        assert mismatches(full(other[name].ema_tensors()), before[name]) == []
    wider = MultiModelEMA(
        build("edge", "plain", tweak=_widen_odd)[0],
        {"fast": {"decay": 0.5, "tau": None}, "slow": {"decay": DECAY}},
    )
    with pytest.raises(
        ValueError, match=r"under 'emas.fast' \(a different model\?\): mismatched \['odd: saved"
    ):
        load_checkpoint({"emas": wider}, tmp_path / "c")
