"""PostHocEMA across ranks: tracking bit for bit at W=2 (DDP, async snapshots, sample counts;
HSDP on a 2 x 1 mesh) and W=3 (FSDP2, uneven shards), resume of the W=2 state at W=3 on the
same trajectory, and synthesize/merge at W=3 (sharded, from W=2 snapshots) equal to one
process.

Two spawns: W=2 writes snapshots and a PostHocEMA checkpoint; W=3 runs everything else. The
reference (a power-function EMA with plain ``lerp_`` on full tensors) runs in this process
on the same model trajectory: step ``s`` adds a seeded random delta to every float tensor
(computed in full and sliced for sharded parameters) and 1 to integer buffers.

Issue 34 (post-hoc EMA of what you train): a GPT-2 LoRA under DDP with
``track="trainable"`` at W=1 (a third spawn) and the uneven W=3: profiles bit for bit, each
rank's snapshot chunks exactly its ``1/W`` of the adapters, distributed synthesis equal to
one process, and the synthesized adapter loading with ``PeftModel.from_pretrained``.
Issue 35: crafted snapshot folders (built here before the spawns) refused on every rank at
W=1 and W=2, nothing written.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from crafted import checkpoints_under, refused_globals
from crafted_snapshots import (
    copy_run,
    edit_manifest,
    foreign_data,
    link_outside,
    shrink_chunk,
)
from dist_harness import run_ranks
from models import make_model, perturb_trainable_
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import (
    ModelEMA,
    PostHocEMA,
    chunk_range,
    load_checkpoint,
    merge_snapshots,
    save_checkpoint,
    synthesize,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

SIGMAS = (0.05, 0.10)
K, N = 6, 3  # updates at W=2 before the checkpoint, and after the resume at W=3
PER_RANK = 4  # samples per rank per update: 8 per update at W=2, 12 at W=3


def perturb_(model: nn.Module, step: int) -> None:
    """The W-independent trajectory; sharded parameters take their slice of the delta."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for v in model.state_dict().values():
            full = v.shape
            if not v.is_floating_point():
                (v.to_local() if isinstance(v, DTensor) else v).add_(1)
                continue
            delta = torch.randn(full, generator=g, dtype=torch.float64).to(v.dtype) * 0.1
            if isinstance(v, DTensor):
                mesh, local = v.device_mesh, delta
                for dim, placement in enumerate(v.placements):
                    if placement.is_shard(0):
                        offset, length = chunk_range(
                            full[0], mesh.size(dim), mesh.get_local_rank(dim)
                        )
                        local = local.narrow(0, offset, length)
                v.to_local().add_(local)
            else:
                v.add_(delta)


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))


class RefPowerEMA:
    """ema <- ema.lerp(model, 1 - beta), beta = (1 - delta/t) ** (gamma + 1), full tensors."""

    def __init__(self, gamma: float) -> None:
        self.gamma, self.t, self.ema = gamma, 0, {}

    def update(self, model: nn.Module, delta: int = 1) -> None:
        self.t += delta
        beta = (1 - delta / self.t) ** (self.gamma + 1)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                self.ema.setdefault(k, v.detach().clone()).lerp_(v.detach(), 1 - beta)


def _full_emas(ph: PostHocEMA) -> list[dict[str, torch.Tensor]]:
    return [ph.profile(s).get_ema_state_dict() for s in SIGMAS]


# ----------------------------------------------------------------- issue 34: LoRA, track=
LORA_STEPS = 6


def _lora_run(rank: int, world: int, root: Path) -> dict[str, Any]:
    """PostHocEMA(DDP(GPT-2 LoRA), track="trainable"), snapshots every 3 updates; the
    distributed synthesis of sigma_rel 0.08, whose full tensors rank 0 saves as a PEFT
    adapter."""
    from models import peft_lora

    from dtensor_ema.export.peft import save_peft_adapter

    model = peft_lora("gpt2")
    snaps = root / f"lora_w{world}"
    ph = PostHocEMA(DDP(model), SIGMAS, snapshot_every=3, snapshot_dir=snaps, track="trainable")
    for step in range(1, LORA_STEPS + 1):
        perturb_trainable_(model, step)
        ph.update()
    out: dict[str, Any] = {"emas": _full_emas(ph), "untracked": ph.untracked}
    out["local_nbytes"] = [ph.profile(s).local_nbytes() for s in SIGMAS]
    sd = synthesize(snaps, 0.08)
    out["synth_local_numel"] = sum(
        v.to_local().numel() for v in sd.values() if isinstance(v, DTensor)
    )
    try:  # the sharded result must be gathered first
        save_peft_adapter(model, sd, root / f"lora_refused_w{world}_rank{rank}")
        out["sharded_refused"] = "written"
    except TypeError as e:
        out["sharded_refused"] = str(e)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    out["synth"] = full
    if rank == 0:
        save_peft_adapter(model, full, root / f"lora_adapter_w{world}")
    dist.barrier()
    return out


# ----------------------------------------------------------------- issue 35: crafted folders
BAD = ("another run's data", "rows in no chunk", "profile key", "altered t", "folder outside")


def bad_root(root: Path) -> Path:
    """Where the crafted folders live: beside ``root``, so that the checks of everything
    written under ``root`` (the restricted unpickler's) never meet them."""
    return root.with_name(root.name + "_bad")


def craft_bad_snapshots(root: Path) -> None:
    """``<bad_root>/bad/<case>``: copies of a clean one-process run, each with one thing
    wrong."""
    root = bad_root(root)
    root.mkdir()
    clean = root / "bad_clean"
    ph = PostHocEMA(make_model("edge"), SIGMAS, snapshot_every=4, snapshot_dir=clean)
    for step in range(1, 9):
        perturb_(ph.emas.model, step)
        ph.update()
    other = PostHocEMA(nn.Linear(3, 2), SIGMAS, snapshot_dir=root / "bad_other")
    for _ in range(8):
        other.update()
    foreign = other.snapshot()
    last = "step-000000000008"
    (root / "bad").mkdir()
    (root / "bad_outside").mkdir()
    runs = {case: copy_run(clean, root / "bad" / case) for case in BAD}
    foreign_data(runs["another run's data"] / last, foreign)
    shrink_chunk(runs["rows in no chunk"] / last, "p0.odd", 8)
    edit_manifest(runs["profile key"] / last, lambda m: m["profiles"][1].update(key="followed"))
    edit_manifest(runs["altered t"] / last, lambda m: m.update(t=9), sealed=False)
    link_outside(runs["folder outside"], root / "bad_outside", last)


def _refusals(rank: int, world: int, root: Path) -> dict[str, str]:
    """``synthesize`` (distributed, writing DCP) of every crafted folder: what it raised."""
    root = bad_root(root)
    out: dict[str, str] = {}
    for case in BAD:
        target = root / f"bad_out_w{world}_{case.replace(' ', '_')}"
        try:
            synthesize(root / "bad" / case, 0.08, out=target)
            out[case] = "returned"
        except Exception as e:  # every rank must raise, none may hang
            out[case] = f"{type(e).__name__}: {e}"
        out[f"{case} wrote"] = str(target.exists())
    dist.barrier()
    return out


def _body_w1(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"lora": _lora_run(rank, world, Path(root)), "bad": _refusals(rank, world, Path(root))}


def _body_w2(rank: int, world: int, root: str) -> dict[str, Any]:
    root_path = Path(root)
    model = make_model("edge")
    ddp = DDP(model)
    ph = PostHocEMA(
        ddp, SIGMAS, snapshot_every=2, snapshot_dir=root_path / "snaps_w2", async_save=True
    )
    for step in range(1, K + 1):
        perturb_(model, step)
        ph.update(samples=PER_RANK * world)
    save_checkpoint({"ph": ph}, root_path / "ckpt_w2")  # commits the pending snapshot first
    out = {"emas": _full_emas(ph), "gammas": ph.gammas, "local": ph.profile(0.05).local_numel()}

    # HSDP on a 2 x 1 mesh: (Replicate, Shard(0)) parameters; the EMA splits each local
    # piece over the replicate dim
    hsdp = mlp()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    fully_shard(hsdp, mesh=mesh)
    ph_hsdp = PostHocEMA(hsdp, SIGMAS, snapshot_every=5, snapshot_dir=root_path / "snaps_hsdp")
    for step in range(1, 6):
        perturb_(hsdp, step)
        ph_hsdp.update()
    out["hsdp"] = _full_emas(ph_hsdp)
    out["hsdp_local"] = ph_hsdp.profile(0.05).local_numel()
    out["bad"] = _refusals(rank, world, root_path)
    return out


def _body_w3(rank: int, world: int, root: str) -> dict[str, Any]:
    root_path = Path(root)
    out: dict[str, Any] = {}
    # FSDP2, uneven Shard(0) pieces at W=3, synchronous snapshots in steps
    model = mlp()
    # One mesh for every fully_shard call: FSDP2 builds a new default mesh per call, and the
    # EMA refuses parameters on meshes with different roots.
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ph = PostHocEMA(model, SIGMAS, snapshot_every=3, snapshot_dir=root_path / "snaps_fsdp")
    for step in range(1, 10):
        perturb_(model, step)
        ph.update()
    out["fsdp"] = _full_emas(ph)
    out["fsdp_local_is_dtensor"] = isinstance(ph.profile(0.05).ema_tensors()["0.weight"], DTensor)

    # resume the W=2 checkpoint at W=3 and continue the same trajectory
    edge = make_model("edge")
    for step in range(1, K + 1):
        perturb_(edge, step)
    resumed = PostHocEMA(edge, SIGMAS, snapshot_dir=root_path / "snaps_w2")
    load_checkpoint({"ph": resumed}, root_path / "ckpt_w2")
    out["resumed_counters"] = (resumed.steps, resumed.t, resumed.time_unit)
    for step in range(K + 1, K + N + 1):
        perturb_(edge, step)
        resumed.update(samples=PER_RANK * world)
    resumed.snapshot()
    out["resumed"] = _full_emas(resumed)

    # distributed synthesis of the W=2 (+ resumed) snapshots: this rank's shards only
    sd = synthesize(root_path / "snaps_w2", 0.08)
    out["synth_local_numel"] = sum(
        v.to_local().numel() for v in sd.values() if isinstance(v, DTensor)
    )
    out["synth"] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    path = synthesize(root_path / "snaps_w2", [0.08], out=root_path / "synth_w3")[0]
    out["synth_path"] = str(path)
    ema = ModelEMA(make_model("edge"))
    dcp.load(ema.ema_tensors(), checkpoint_id=str(path))  # loads into the EMA at W=3
    out["ema_loaded"] = ema.get_ema_state_dict()
    merged = merge_snapshots(root_path / "snaps_w2", last=3)
    out["merged"] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in merged.items()}
    out["lora"] = _lora_run(rank, world, root_path)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("phema_dist")
    craft_bad_snapshots(root)
    w1 = run_ranks(_body_w1, 1, root, str(root))
    w2 = run_ranks(_body_w2, 2, root, str(root))
    w3 = run_ranks(_body_w3, 3, root, str(root))
    return {"root": root, "w1": w1, "w2": w2, "w3": w3}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad}"


def _reference_edge(deltas: list[int], gammas: tuple[float, ...]) -> list[RefPowerEMA]:
    model = make_model("edge")
    refs = [RefPowerEMA(g) for g in gammas]
    for step, delta in enumerate(deltas, 1):
        perturb_(model, step)
        for r in refs:
            r.update(model, delta)
    return refs


def test_tracking_bit_exact_w2_ddp_samples(runs: dict[str, Any]) -> None:
    gammas = runs["w2"][0]["gammas"]
    refs = _reference_edge([2 * PER_RANK] * K, gammas)
    for rank_result in runs["w2"]:
        for got, ref in zip(rank_result["emas"], refs, strict=True):
            _assert_equal(got, ref.ema, "W=2")
    total = sum(r.numel() for r in refs[0].ema.values())
    assert runs["w2"][0]["local"] < total  # sharded, not replicated


def test_tracking_bit_exact_w2_hsdp(runs: dict[str, Any]) -> None:
    model = mlp()
    refs = [RefPowerEMA(g) for g in runs["w2"][0]["gammas"]]
    for step in range(1, 6):
        perturb_(model, step)
        for r in refs:
            r.update(model)
    for result in runs["w2"]:
        for got, ref in zip(result["hsdp"], refs, strict=True):
            _assert_equal(got, ref.ema, "W=2 HSDP")
        assert result["hsdp_local"] < sum(v.numel() for v in refs[0].ema.values())
    _assert_equal(synthesize(runs["root"] / "snaps_hsdp", 0.05), refs[0].ema, "HSDP snapshot")


def test_tracking_bit_exact_w3_fsdp(runs: dict[str, Any]) -> None:
    model = mlp()
    refs = [RefPowerEMA(g) for g in runs["w2"][0]["gammas"]]
    for step in range(1, 10):
        perturb_(model, step)
        for r in refs:
            r.update(model)
    for got, ref in zip(runs["w3"][0]["fsdp"], refs, strict=True):
        _assert_equal(got, ref.ema, "W=3 FSDP2")
    assert runs["w3"][0]["fsdp_local_is_dtensor"]
    # FSDP2 snapshots: the tracked profile comes back exactly, read in this process
    sd = synthesize(runs["root"] / "snaps_fsdp", 0.10)
    _assert_equal(sd, refs[1].ema, "FSDP2 snapshot")


def test_resume_at_another_world_size(runs: dict[str, Any]) -> None:
    gammas = runs["w2"][0]["gammas"]
    refs = _reference_edge([2 * PER_RANK] * K + [3 * PER_RANK] * N, gammas)
    assert runs["w3"][0]["resumed_counters"] == (K, 2 * PER_RANK * K, "samples")
    for got, ref in zip(runs["w3"][0]["resumed"], refs, strict=True):
        _assert_equal(got, ref.ema, "resumed at W=3")
    # its snapshot went next to the W=2 ones: synthesize(tracked) is that snapshot
    _assert_equal(synthesize(runs["root"] / "snaps_w2", 0.05), refs[0].ema, "resumed snapshot")


def test_distributed_synthesis_equals_single_process(runs: dict[str, Any]) -> None:
    snaps = runs["root"] / "snaps_w2"
    single = synthesize(snaps, 0.08)
    total = sum(v.numel() for v in single.values() if v.is_floating_point())
    for result in runs["w3"]:
        _assert_equal(result["synth"], single, "W=3 synthesize")
        _assert_equal(
            result["ema_loaded"],
            {k: v for k, v in single.items() if v.is_floating_point()},
            "ModelEMA loaded from the W=3 output",
        )
        assert result["synth_local_numel"] < total
        _assert_equal(result["merged"], merge_snapshots(snaps, last=3), "W=3 merge")
    # the sharded DCP output loads into a plain model in one process
    model = make_model("edge")
    state = model.state_dict()
    dcp.load(state, checkpoint_id=runs["w3"][0]["synth_path"], no_dist=True)
    model.load_state_dict(state)
    _assert_equal(model.state_dict(), single, "model loaded from the W=3 output")


def test_snapshots_of_every_layout_are_read_with_the_restricted_unpickler(
    runs: dict[str, Any],
) -> None:
    """DDP (async), HSDP and FSDP2 snapshots, the PostHocEMA checkpoint and the distributed
    synthesis output hold only the globals the restricted reader allows (issue 27)."""
    directories = checkpoints_under(runs["root"])
    parents = {d.parent.name for d in directories}
    assert parents >= {"snaps_w2", "snaps_hsdp", "snaps_fsdp"}, parents
    assert {str(d): refused_globals(d) for d in directories} == {str(d): set() for d in directories}


# ----------------------------------------------------------------- issue 34: LoRA, track=
def _lora_refs(gammas: tuple[float, ...]) -> tuple[list[str], list[str], list[dict]]:
    from models import peft_lora

    model = peft_lora("gpt2")
    adapter = [k for k, p in model.named_parameters() if p.requires_grad]
    seen: set[int] = set()
    floats = []  # tied duplicates once (GPT-2's lm_head.weight is wte.weight)
    for k, v in model.state_dict(keep_vars=True).items():
        if v.is_floating_point() and id(v) not in seen:
            floats.append(k)
        seen.add(id(v))
    refs: list[dict[str, torch.Tensor]] = [{} for _ in gammas]
    for step in range(1, LORA_STEPS + 1):
        perturb_trainable_(model, step)
        for gamma, ref in zip(gammas, refs, strict=True):
            beta = (1 - 1 / step) ** (gamma + 1)
            for k, p in model.named_parameters():
                if k in adapter:
                    ref.setdefault(k, p.detach().clone()).lerp_(p.detach(), 1 - beta)
    return adapter, [k for k in floats if k not in adapter], refs


@pytest.mark.parametrize("world", [1, 3])
def test_lora_profiles_bit_exact_and_only_the_adapters(runs: dict[str, Any], world: int) -> None:
    gammas = runs["w2"][0]["gammas"]
    adapter, untracked, refs = _lora_refs(gammas)
    for result in runs[f"w{world}"]:
        lora = result["lora"]
        assert lora["untracked"] == untracked
        for got, ref in zip(lora["emas"], refs, strict=True):
            assert list(got) == adapter
            _assert_equal(got, ref, f"LoRA W={world}")


def _rows(n: int, world: int, rank: int) -> int:
    """Rows of a dim-0 split of ``n`` rows that rank ``rank`` of ``world`` holds."""
    c = math.ceil(n / world)
    offset = min(rank * c, n)
    return max(0, min(n, offset + c) - offset)


@pytest.mark.parametrize("world", [1, 3])
def test_lora_snapshots_hold_one_wth_of_the_adapters_per_rank(
    runs: dict[str, Any], world: int
) -> None:
    """Each rank's data file holds exactly its rows of each adapter tensor, for both
    profiles (read from the snapshot's own ``.metadata``), and its EMA that many bytes."""
    adapter, _, refs = _lora_refs(runs["w2"][0]["gammas"])
    want = [
        2 * sum(_rows(v.shape[0], world, r) * v[0].numel() * 4 for v in refs[0].values())
        for r in range(world)
    ]
    total = 2 * sum(v.numel() * 4 for v in refs[0].values())
    assert sum(want) == total
    snaps = sorted((runs["root"] / f"lora_w{world}").glob("step-*"))
    assert [s.name for s in snaps] == ["step-000000000003", "step-000000000006"]
    for snap in snaps:
        metadata = dcp.FileSystemReader(str(snap)).read_metadata()  # our own file
        assert set(metadata.state_dict_metadata) == {f"p{i}.{k}" for i in range(2) for k in adapter}
        per_rank = [0] * world
        for fqn, md in metadata.state_dict_metadata.items():
            for chunk in md.chunks:
                index = MetadataIndex(fqn, chunk.offsets)
                writer = re.match(r"__(\d+)_", metadata.storage_data[index].relative_path)
                assert writer is not None
                per_rank[int(writer.group(1))] += chunk.sizes.numel() * 4
        assert per_rank == want, (snap.name, per_rank, want)
    for rank, result in enumerate(runs[f"w{world}"]):
        assert sum(result["lora"]["local_nbytes"]) == want[rank]


@pytest.mark.parametrize("world", [1, 3])
def test_lora_distributed_synthesis_and_peft_adapter(runs: dict[str, Any], world: int) -> None:
    import peft
    from models import transformers_base

    snaps = runs["root"] / f"lora_w{world}"
    single = synthesize(snaps, 0.08)
    adapter, _, refs = _lora_refs(runs["w2"][0]["gammas"])
    assert list(single) == adapter
    _assert_equal(synthesize(snaps, SIGMAS[1]), refs[1], "tracked profile")
    total = sum(v.numel() for v in single.values())
    for rank, result in enumerate(runs[f"w{world}"]):
        _assert_equal(result["lora"]["synth"], single, f"W={world} synthesize")
        assert result["lora"]["sharded_refused"].startswith(
            "save_peft_adapter needs full tensors, got DTensors"
        ), result["lora"]["sharded_refused"]
        assert not (runs["root"] / f"lora_refused_w{world}_rank{rank}").exists()
        assert result["lora"]["synth_local_numel"] <= math.ceil(total / world) * 2
    loaded = peft.PeftModel.from_pretrained(
        transformers_base("gpt2"), str(runs["root"] / f"lora_adapter_w{world}")
    )
    _assert_equal(loaded.state_dict(), single, "adapter loaded by PeftModel.from_pretrained")


# ----------------------------------------------------------------- issue 35: crafted folders
REFUSED = {
    "another run's data": (  # its .metadata is of another save than the manifest (issue 42)
        "CheckpointError",
        r"step-000000000008/\.metadata: written by save '[0-9a-f-]+', but the snapshot's "
        r"manifest names save '[0-9a-f-]+': the folder holds another snapshot's \(or run's\) "
        r"data",
    ),
    "rows in no chunk": (
        "CheckpointError",
        r"'p0\.odd'.* rows 8-12",
    ),
    "profile key": (
        "SnapshotError",
        r"profiles\[1\]\['key'\] must be 'p1' \(where profile 1 is stored\), got 'followed'",
    ),
    "altered t": ("SnapshotError", "its checksum does not match its content"),
    "folder outside": ("SnapshotError", "is a symlink to .*, outside the snapshot directory"),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", BAD)
def test_crafted_snapshots_refused_on_every_rank(
    runs: dict[str, Any], world: int, case: str
) -> None:
    """Every rank raises (none hangs, none returns ``torch.empty`` values), nothing is
    written; at W=2 the data checks are agreed, so both ranks raise the same message."""
    kind, pattern = REFUSED[case]
    seen = {result["bad"][case] for result in runs[f"w{world}"]}
    assert len(seen) == 1, seen  # the same message on every rank
    (message,) = seen
    agreed = world > 1 and kind == "CheckpointError"
    assert message.startswith(f"{kind}: "), message
    if agreed:
        assert "reading the snapshots' metadata failed on ranks [0, 1]" in message, message
    assert re.search(pattern, message), message
    assert all(result["bad"][f"{case} wrote"] == "False" for result in runs[f"w{world}"])
