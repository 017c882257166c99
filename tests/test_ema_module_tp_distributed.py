"""``ema.module`` on tensor-parallel layouts (issue 18 item 3), gloo CPU.

Cases: a TP-only model at W=2 (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``, a norm replicated on the tp mesh by ``distribute_module``, plain
parameters outside TP); at W=4 on a 2 x 2 mesh, the same model with TP on the inner dim and
``fully_shard`` on the outer (as torchtitan does), the TP-only model with a dp dim it does
not shard, the TP-only model over all 4 ranks, and torchtitan 0.3.0's own
llama3 debugmodel (fused Q/K/V, two layers) parallelized by its own ``parallelize_llama``
on its own ``ParallelDims`` meshes: FSDP2 + TP (dp_shard 2 x tp 2) and HSDP (dp_replicate 2
x dp_shard 2), and torchtitan's deepseek_v3 debugmodel (dense block, then MoE with 8 grouped
experts) by its own ``parallelize_deepseekv3``: FSDP2 (dp_shard 4) + expert parallelism
(ep 2, all-to-all token dispatch, on torchtitan's ``"partial_dtensor"`` backend: gloo
refuses the ``"spmd_types"`` backend's uneven list all-to-all), all with ``mesh=None``. The
torchtitan EMAs are saved with DCP at W=4 and loaded, bit for bit, into the unsharded
debugmodel's EMA in one process.

Each case keeps a full-model EMA reference written here (``lerp_`` of ``full_tensor()``
after every SGD step), and checks:

* the EMA equals the reference bit for bit, and ``average_parameters()`` puts exactly the
  reference into the model;
* ``ema.module(x)`` equals an unsharded model holding the reference (rel. error <= 1e-5);
* building the module leaves the EMA's per-rank bytes unchanged and the module's resting
  parameters *are* the EMA's DTensors (same local storage: no replicated copy); under HSDP,
  where FSDP2 cannot hold the EMA's split over the replicate dim, they are one copy of the
  model's own shards (refreshed from the EMA before each forward);
* after more steps and ``ema.update()``, the next forward shows the new average;
* during the forward, TP weights are DTensors in the model's TP layout.

One spawn per world size.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from titan_models import build_titan, deepseek_v3_trainer, llama3_trainer, parallel_dims
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.distributed

DECAY = 0.6
DIM, HIDDEN = 11, 18  # uneven: FSDP splits TP-local rows 9 -> 5/4 and 11 -> 6/5


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, hidden)
        self.w2 = nn.Linear(hidden, DIM)
        self.register_buffer("shift", torch.zeros(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # a running statistic, like BatchNorm's
            with torch.no_grad():
                self.shift.lerp_(x.detach().float().mean(dim=(0, 1)), 0.3)
        return x + self.w2(torch.tanh(self.w1(self.norm(x) + self.shift.to(x.dtype))))


class Net(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Linear(6, DIM)
        self.layers = nn.ModuleList([Block(hidden), Block(hidden)])
        self.out = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _replicated_in(_module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)


def _local_out(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
    return output.to_local()


def _tp(model: Net, tp_mesh: DeviceMesh) -> None:
    """Colwise w1, rowwise w2 (its bias Replicate on tp), the norm's parameters Replicate
    on tp; ``embed``/``out`` stay plain (FSDP-only once ``fully_shard`` is applied)."""
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        distribute_module(layer.norm, tp_mesh, input_fn=_replicated_in, output_fn=_local_out)


def _fsdp(model: Net, dp_mesh: DeviceMesh) -> None:
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _live(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of every float parameter and persistent buffer, by module path (no
    state-dict hooks: torchtitan's would split the fused ``wqkv``)."""
    named = list(model.named_parameters())
    for prefix, module in model.named_modules():
        named += [
            (f"{prefix}.{n}" if prefix else n, b)
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return {n: _full(v) for n, v in named if v.is_floating_point()}


def _load(reference: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    tensors = dict(reference.named_parameters()) | dict(reference.named_buffers())
    with torch.no_grad():
        for name, value in state.items():
            tensors[name].copy_(value)
    return reference.eval()


def _not_shared(module: nn.Module, ema: ModelEMA) -> list[str]:
    """Parameters of ``module`` that are not the EMA's own DTensors (storage-wise)."""
    tensors = ema.ema_tensors()
    return [
        k
        for k, p in module.named_parameters()
        if not isinstance(p, DTensor)
        or p.to_local().data_ptr()
        != tensors[k.replace("_checkpoint_wrapped_module.", "")].to_local().data_ptr()
    ]


def _local_bytes(module: nn.Module) -> int:
    """This rank's bytes of ``module``'s parameters."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes()
        for p in module.parameters()
    )


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = _full(actual) if isinstance(actual, DTensor) else actual
    if not torch.isfinite(expected).all():
        return float("inf")
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _case(
    model: nn.Module,
    reference: nn.Module,
    batch: Callable[[int], torch.Tensor],
    *,
    probe: str,
    context: Callable[[], Any] | None = None,
    loss: Callable[[Any], torch.Tensor] = lambda y: y.float().square().mean(),
    view: Callable[[torch.Tensor], torch.Tensor] = lambda y: y,
    checkpoint: Path | None = None,
) -> dict[str, Any]:
    """Train 2 steps, build ``ema.module``, check it; 1 more step, check again. With
    ``checkpoint``, save the EMA there with DCP and the reference beside it (rank 0)."""
    import contextlib

    ctx = context or contextlib.nullcontext
    ref = _live(model)
    ema = ModelEMA(model, decay=DECAY, tau=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)

    def step(i: int) -> None:
        with ctx():
            loss(model(batch(i))).backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        for k, v in _live(model).items():
            ref[k].lerp_(v, 1 - DECAY)

    for i in range(2):
        step(i)
    bytes_before = ema.local_nbytes()
    module = ema.module
    out: dict[str, Any] = {"bytes_before": bytes_before, "bytes_after": ema.local_nbytes()}
    out["full_bytes"] = sum(v.nbytes for v in ref.values())  # the unsharded EMA's bytes
    out["ema_mesh"] = None if ema.mesh is None else list(ema.mesh.shape)
    out["rest_not_shared"] = _not_shared(module, ema)
    out["module_bytes"], out["model_bytes"] = (_local_bytes(m) for m in (module, model))
    seen: dict[str, Any] = {}

    def record(m: nn.Module, _args: Any) -> None:
        w = m.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        placements = [str(p) for p in getattr(w, "placements", ())]
        seen["probe"] = (type(w).__name__, placements, list(local.shape))

    module.get_submodule(probe).register_forward_pre_hook(record)
    x = batch(99)
    errors = []
    for phase in range(2):
        if phase:
            model.train()
            step(2)
        model.eval()
        with torch.no_grad(), ctx():
            y = module(x)
            raw = model(x)
            expected = view(_load(reference, ref)(x))
        errors.append(_rel_err(y, expected))
        if not phase:
            out["raw_err"] = _rel_err(raw, expected)
    got = {k: _full(v) for k, v in ema.ema_tensors().items()}
    with ema.average_parameters(), torch.no_grad(), ctx():
        inside = _live(model)
        swapped = model(x)  # the model's own sharded forward on the EMA
    model.train()
    out.update(
        swap_forward_equal=torch.equal(_full(y), _full(swapped)),
        errors=errors,
        finite=all(bool(t.isfinite().all()) for t in ref.values()),
        ema_mismatch=[k for k in ref if not torch.equal(got[k], ref[k])],
        swap_mismatch=[k for k in ref if not torch.equal(inside[k], ref[k])],
        probe=seen.get("probe"),
        rest_after=_not_shared(module, ema),  # the gathered parameters are dropped
    )
    if checkpoint is not None:
        save_checkpoint({"ema": ema}, checkpoint)
        if dist.get_rank() == 0:
            torch.save({"reference": ref, "updates": ema.updates}, f"{checkpoint}.pt")
    return out


def _batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(step))


def _net(hidden: int = HIDDEN) -> tuple[Net, Net]:
    torch.manual_seed(0)
    model = Net(hidden)
    return model, copy.deepcopy(model)


def _guarded(cases: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as error:  # reported per case; pytest names it
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
    return results


# ------------------------------------------------------------------ W=2: TP only
def tp2_body(rank: int, world_size: int) -> dict[str, Any]:
    def tp_only() -> dict[str, Any]:
        model, reference = _net()
        _tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
        return _case(model, reference, _batch, probe="layers.0.w1")

    def offload() -> dict[str, Any]:
        model, _ = _net()
        _tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
        ema = ModelEMA(model, decay=DECAY, offload=True)
        try:
            ema.build_module()
        except NotImplementedError as error:
            return {"refused": str(error)}
        return {"refused": None}

    def dtensor_buffer() -> dict[str, Any]:
        model, _ = _net()
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        _tp(model, mesh)
        model.layers[0].register_buffer("scale", distribute_tensor(torch.ones(3), mesh))
        ema = ModelEMA(model, decay=DECAY)
        try:
            ema.build_module()
        except NotImplementedError as error:
            return {"refused": str(error)}
        return {"refused": None}

    return _guarded({"tp_only": tp_only, "offload": offload, "dtensor_buffer": dtensor_buffer})


# ------------------------------------------------------------------ W=4: 2 x 2
def tp4_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def fsdp_tp() -> dict[str, Any]:
        model, reference = _net()
        _tp(model, mesh["tp"])
        _fsdp(model, mesh["dp"])
        return _case(model, reference, _batch, probe="layers.0.w1")

    def tp_on_2d() -> dict[str, Any]:
        model, reference = _net()  # TP on tp; dp replicates it (EMA split over dp too)
        _tp(model, mesh["tp"])
        return _case(model, reference, _batch, probe="layers.1.w2")

    def tp_1d() -> dict[str, Any]:
        # TP over all 4 ranks (TP's own local outputs need even shards): the replicated
        # norms and biases (11) split 3, 3, 3, 2 in the EMA.
        model, reference = _net(hidden=20)
        _tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
        return _case(model, reference, _batch, probe="layers.0.w1")

    def fsdp_tp_bf16() -> dict[str, Any]:
        # FSDP2 mixed precision: the module gathers bf16 weights and casts the unit inputs,
        # as the model's FSDP2 does: its forward equals the model's on the EMA bit for bit.
        model, _ = _net()
        _tp(model, mesh["tp"])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
        ema = ModelEMA(model, decay=DECAY, tau=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        for i in range(2):
            model(_batch(i)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update()
        seen = []
        module = ema.module
        module.get_submodule("layers.0.w1").register_forward_pre_hook(
            lambda m, args: seen.append((str(m.weight.dtype), str(args[0].dtype)))
        )
        model.eval()
        with torch.no_grad():
            y = module(_batch(99))
            with ema.average_parameters():
                swapped = model(_batch(99))
        return {
            "equal": torch.equal(y, swapped),
            "dtypes": (str(y.dtype), *seen[0]),
            "ema_dtypes": sorted({str(t.dtype) for t in ema.ema_tensors().values()}),
        }

    cases = {"fsdp_tp": fsdp_tp, "tp_on_2d": tp_on_2d, "tp_1d": tp_1d, "bf16": fsdp_tp_bf16}
    if importlib.util.find_spec("torchtitan") is not None:

        def titan(replicate: int, shard: int, tp: int, probe: str) -> dict[str, Any]:
            from torchtitan.distributed.utils import get_spmd_context

            dims = parallel_dims(world_size, dp_replicate=replicate, dp_shard=shard, tp=tp)
            # torchtitan's llama3 debugmodel as shipped (fused Q/K/V), 2 layers, SDPA, fp32:
            # parallelized by its own parallelize_llama on dims, and the plain reference.
            degrees = {"replicate": replicate, "shard": shard, "tp": tp}
            model = build_titan(llama3_trainer(layers=2, **degrees), dims)
            trainer = llama3_trainer(layers=2, **degrees)
            reference = build_titan(trainer)

            def tokens(step: int) -> torch.Tensor:
                g = torch.Generator().manual_seed(step)
                return torch.randint(0, trainer.model_spec.model.vocab_size, (2, 8), generator=g)

            tp_mesh = dims.get_mesh("tp") if tp > 1 else None
            vocab = trainer.model_spec.model.vocab_size // tp

            def view(logits: torch.Tensor) -> torch.Tensor:  # loss parallel: vocab shards
                if tp_mesh is None:
                    return logits
                return logits[..., tp_mesh.get_local_rank() * vocab :][..., :vocab]

            out = _case(
                model,
                reference,
                tokens,
                probe=probe,
                context=get_spmd_context(parallel_dims=dims),
                view=view,
                checkpoint=Path(root) / f"titan-{replicate}x{shard}x{tp}",
            )
            out["fused"] = any("wqkv" in n for n, _ in model.named_parameters())
            out["mesh"] = list(model.tok_embeddings.weight.device_mesh.mesh.shape)
            return out

        cases["titan_fsdp_tp"] = lambda: titan(1, 2, 2, probe="layers.0.attention.wo")
        cases["titan_hsdp"] = lambda: titan(2, 2, 1, probe="layers.0.attention.wo")

        def titan_moe_ep() -> dict[str, Any]:
            import torchtitan.distributed.utils as titan_utils

            # torchtitan's deepseek_v3 debugmodel (block 0 dense, block 1 MoE: 8 grouped
            # experts) by its own parallelize_deepseekv3: FSDP2 over 4 ranks, experts on
            # ep 2 x efsdp 2 (_StridedShard(0), Shard(0)), all-to-all token dispatch.
            backend = titan_utils.get_spmd_backend()
            titan_utils.set_spmd_backend("partial_dtensor")  # gloo: see deepseek_v3_trainer
            try:
                dims = parallel_dims(world_size, spmd_backend="partial_dtensor", dp_shard=4, ep=2)
                model = build_titan(deepseek_v3_trainer(shard=4, ep=2), dims)
                trainer = deepseek_v3_trainer()
                reference = build_titan(trainer)
                vocab = trainer.model_spec.model.vocab_size

                def tokens(step: int) -> torch.Tensor:
                    g = torch.Generator().manual_seed(step)
                    return torch.randint(0, vocab, (2, 8), generator=g)

                out = _case(
                    model,
                    reference,
                    tokens,
                    probe="layers.1.moe.router.gate",
                    checkpoint=Path(root) / "titan-moe-ep",
                )
            finally:
                titan_utils.set_spmd_backend(backend)
            experts = model.get_submodule("layers.1.moe.routed_experts.inner_experts").w1_EFD
            out["experts"] = (
                [str(p) for p in experts.placements],
                list(experts.device_mesh.mesh_dim_names or ()),
                list(experts.to_local().shape),
            )
            return out

        cases["titan_moe_ep"] = titan_moe_ep
    return _guarded(cases)


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(tp2_body, 2, tmp_path_factory.mktemp("tp2"), deadline_s=300)


@pytest.fixture(scope="module")
def tp4_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp4")


@pytest.fixture(scope="module")
def tp4_results(tp4_root: Path) -> list[dict[str, Any]]:
    return run_ranks(tp4_body, 4, tp4_root, str(tp4_root), deadline_s=400)


def _check(results: list[dict[str, Any]], name: str, probe: Any, shares: bool = True) -> None:
    """``probe``: the probed weight's (type, placements, local shape) during the forward,
    or a list of them by rank. ``shares``: the module's parameters are the EMA's DTensors;
    else (HSDP) they are one copy of the model's own shards, refreshed from the EMA."""
    for rank, cases in enumerate(results):
        out = cases[name]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["finite"], out
        assert out["ema_mismatch"] == [] and out["swap_mismatch"] == [], out
        assert all(e <= 1e-5 for e in out["errors"]), (rank, out["errors"])
        assert out["raw_err"] > 1e-3, out  # the EMA is far from the raw weights
        assert out["swap_forward_equal"], out  # bit for bit: the same layouts and kernels
        assert out["bytes_after"] == out["bytes_before"], out
        if shares:
            assert out["rest_not_shared"] == [] and out["rest_after"] == [], out
        else:
            assert out["module_bytes"] == out["model_bytes"], out
        assert out["probe"] == (probe[rank] if isinstance(probe, list) else probe), out


def test_tp_only_module_matches_the_unsharded_reference(tp2_results: list[Any]) -> None:
    _check(tp2_results, "tp_only", ("DTensor", ["S(0)"], [HIDDEN // 2, DIM]))


def test_layouts_the_module_cannot_hold_are_refused_naming_them(tp2_results: list[Any]) -> None:
    for cases in tp2_results:
        refused = cases["offload"].get("refused")
        assert refused is not None and "offload=True" in refused, cases["offload"]
        refused = cases["dtensor_buffer"].get("refused")
        assert refused is not None, cases["dtensor_buffer"]
        assert "DTensor buffers ['layers.0.scale']" in refused, refused


@pytest.mark.parametrize(
    ("name", "probe"),
    [
        ("fsdp_tp", ("DTensor", ["S(0)"], [HIDDEN // 2, DIM])),
        ("tp_on_2d", ("DTensor", ["S(1)"], [DIM, HIDDEN // 2])),
        ("tp_1d", ("DTensor", ["S(0)"], [5, DIM])),
    ],
)
def test_2x2_module_matches_the_unsharded_reference(
    tp4_results: list[Any], name: str, probe: Any
) -> None:
    _check(tp4_results, name, probe)


def test_fsdp_tp_mixed_precision_module_equals_the_swapped_model(tp4_results: list[Any]) -> None:
    for rank, cases in enumerate(tp4_results):
        out = cases["bf16"]
        assert "error" not in out, f"rank {rank}: {out['error']}"
        assert out["equal"], out
        assert out["dtypes"] == ("torch.bfloat16", "torch.bfloat16", "torch.bfloat16"), out
        assert out["ema_dtypes"] == ["torch.float32"], out


def test_torchtitan_fsdp_tp_module_matches_the_unsharded_reference(
    tp4_results: list[Any],
) -> None:
    pytest.importorskip("torchtitan")
    # torchtitan's spmd_types backend: FSDP2 unshards to the plain TP-local piece.
    _check(tp4_results, "titan_fsdp_tp", ("Parameter", [], [256, 128]))
    assert all(cases["titan_fsdp_tp"]["fused"] for cases in tp4_results)
    assert all(cases["titan_fsdp_tp"]["mesh"] == [2, 2] for cases in tp4_results)


def test_torchtitan_hsdp_module_matches_the_unsharded_reference(tp4_results: list[Any]) -> None:
    """torchtitan's own HSDP 2 x 2 (``dp_replicate=2, dp_shard=2``): ``mesh=None`` finds
    the world, the EMA splits each shard over the replicate dim, and the module works,
    holding one copy of the model's shards (FSDP2 cannot hold the EMA's finer split)."""
    pytest.importorskip("torchtitan")
    _check(tp4_results, "titan_hsdp", ("Parameter", [], [256, 256]), shares=False)
    assert all(cases["titan_hsdp"]["fused"] for cases in tp4_results)
    assert all(cases["titan_hsdp"]["mesh"] == [2, 2] for cases in tp4_results)
    # 1/W per rank: the EMA elements of HSDP's replicated shards are split once more.
    total = sum(cases["titan_hsdp"]["bytes_before"] for cases in tp4_results)
    assert all(cases["titan_hsdp"]["bytes_before"] * 4 <= total + 4096 for cases in tp4_results)


def test_torchtitan_moe_expert_parallel_module_matches_the_unsharded_reference(
    tp4_results: list[Any],
) -> None:
    """torchtitan's deepseek_v3 debugmodel (block 1: MoE, 8 grouped experts, all-to-all
    token dispatch) parallelized by its own ``parallelize_deepseekv3``: FSDP2 over the 4
    ranks and EP 2, each expert weight split 4 ways (``_StridedShard(0)`` on efsdp x
    ``Shard(0)`` on ep, 2 of the 8 experts per rank). ``mesh=None`` finds the 2 x 2 world;
    the EMA and the swap equal the reference bit for bit, ``ema.module`` holds the EMA's
    DTensors and its forward equals the unsharded model on the reference; each rank keeps
    exactly 1/4 of the EMA's bytes."""
    pytest.importorskip("torchtitan")
    _check(tp4_results, "titan_moe_ep", ("Parameter", [], [8, 256]))
    for cases in tp4_results:
        out = cases["titan_moe_ep"]
        assert out["experts"] == (["_S(0, 2)", "S(0)"], ["efsdp", "ep"], [2, 256, 256]), out
        assert out["ema_mesh"] == [2, 2], out
        assert out["bytes_before"] * 4 == out["full_bytes"], out


@pytest.mark.parametrize("layout", ["titan-1x2x2", "titan-2x2x1", "titan-moe-ep"])
def test_torchtitan_w4_checkpoint_loads_in_one_process(
    tp4_results: list[Any], tp4_root: Path, layout: str
) -> None:
    """DCP saved on torchtitan's FSDP2+TP, HSDP 2 x 2 or FSDP2+EP mesh at W=4 loads into the
    unsharded debugmodel's EMA (llama3, or deepseek_v3 for EP) without a process group,
    bit for bit."""
    pytest.importorskip("torchtitan")
    if layout == "titan-moe-ep":
        model = build_titan(deepseek_v3_trainer())
    else:
        model = build_titan(llama3_trainer(layers=2, shard=2, tp=2))
    ema = ModelEMA(model, decay=DECAY, tau=None)
    load_checkpoint({"ema": ema}, tp4_root / layout)
    saved = torch.load(tp4_root / f"{layout}.pt")
    got = ema.ema_tensors()
    assert sorted(got) == sorted(saved["reference"])
    assert [k for k, v in saved["reference"].items() if not torch.equal(got[k], v)] == []
    assert ema.updates == saved["updates"] == 3
