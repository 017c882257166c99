"""``dtensor_ema.compat.ema_pytorch.PostHocEMA`` against ema-pytorch 0.8.3's ``PostHocEMA``.

A small model is trained with real SGD steps; the real ``PostHocEMA`` and the drop-in
watch it with default-like and non-default options. Cells (:data:`CELLS`): no process group
(this process); W=1 (a one-rank group in this process), W=2 and the uneven W=3 (one spawned
body per world size), each under DDP and under FSDP2 (``fully_shard`` on ``body[0]`` and
the root, one 1-D mesh). The drop-in tracks the trained model itself (the DDP wrapper, the
FSDP2 module); the real one, on rank 0, tracks a plain model holding the same full weights
(DDP's replica; under FSDP2 a mirror set to the sharded model's full tensors after every
step). Checked in every cell:

* every profile's EMA weights (the engine's full state) and every profile's forward on the
  same input, bit for bit;
* the checkpoints' tensors (ema-pytorch's ``{index}.{step}.pt`` files against our sharded
  snapshots read back in one process), bit for bit;
* the synthesized model at a ``sigma_rel``/``gamma`` that is not tracked (and at an earlier
  ``step``): bit for bit against a float64 sum of ema-pytorch's own checkpoint files with
  ema-pytorch's own weights (written here), and within float32 rounding of ema-pytorch's
  model, which sums float32 products in directory-listing order;
* ``dcp.save`` of ``state_dict()`` into a fresh drop-in resumes bit for bit; rank 0 holds
  about ``1/W`` of ema-pytorch's per-rank copies.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from dist_harness import require_extra

require_extra("ema_pytorch", "compat")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from ema_pytorch import PostHocEMA as RealPostHocEMA  # noqa: E402
from ema_pytorch.post_hoc_ema import solve_weights  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from dtensor_ema.compat.ema_pytorch import PostHocEMA  # noqa: E402

STEPS = 8
# name -> (options, synthesis requests (sigma_rel, gamma, step))
OPTIONS: dict[str, tuple[dict[str, Any], list[tuple[float | None, float | None, int | None]]]] = {
    "sigma": (
        dict(sigma_rels=(0.05, 0.1), update_every=1, checkpoint_every_num_steps=2),
        [(0.15, None, None), (None, 9.0, 4)],
    ),
    "gamma": (
        dict(
            gammas=(5.0, 12.0),
            update_every=3,
            checkpoint_every_num_steps=3,
            param_or_buffer_names_no_ema={"seen"},
        ),
        [(0.08, None, None)],
    ),
    # ema-pytorch's ignore_names / ignore_startswith_names: those tensors (frozen here, as
    # one ignores them) are neither averaged, stored, nor summed
    "ignore": (
        dict(
            sigma_rels=(0.05, 0.1),
            update_every=2,
            checkpoint_every_num_steps=4,
            ignore_names={"body.1.weight"},
            ignore_startswith_names={"body.3."},
        ),
        [(0.12, None, None)],
    ),
}
IGNORED = {"body.1.weight", "body.3.weight", "body.3.bias"}
"""What the ``ignore`` option leaves out (and freezes before training)."""


class Net(nn.Module):
    """Odd sizes (uneven shards at W=2, 3) and a float buffer that moves every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(0.25)
        return self.body(x)


def _floats(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        k[len(prefix) :]: v.detach().clone()
        for k, v in sd.items()
        if k.startswith(prefix) and v.is_floating_point()
    }


def _layout(
    layout: str,
    world: int,
    frozen: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(model trained, model the drop-in tracks, plain model the real EMA tracks)``.

    ``none``: one plain model for all three. ``ddp``: the real EMA watches DDP's replica.
    ``fsdp2``: ``fully_shard`` on ``body[0]`` and the root over one 1-D mesh (uneven
    ``Shard(0)`` pieces at W=2, 3); the real EMA watches a plain mirror that
    :func:`_mirror_` sets to the sharded model's full weights after every step.
    """
    net = Net()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    if layout == "none":
        return net, net, net
    if layout == "ddp":
        ddp = DDP(net)
        return ddp, ddp, net
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(net.body[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, net, Net()


def _mirror_(mirror: nn.Module, model: nn.Module) -> None:
    """Copy ``model``'s full tensors into ``mirror`` (collective for DTensors: every rank)."""
    with torch.no_grad():
        for (_, t), (_, m) in zip(
            model.state_dict().items(), mirror.state_dict().items(), strict=True
        ):
            m.copy_(t.full_tensor() if isinstance(t, DTensor) else t)


def _body(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """Train ``STEPS`` steps with the real PostHocEMA (rank 0, on a plain model holding the
    trained weights) and ours (every rank, on the trained model) for every layout of
    ``world``: ``{layout: {option name: results}}`` (rank 0's; ``{}`` on the others)."""
    layouts = ["none"] if not world else ["ddp", "fsdp2"]
    out: dict[str, dict[str, Any]] = {layout: {} for layout in layouts}
    for layout, (name, (options, requests)) in itertools.product(layouts, OPTIONS.items()):
        model, tracked, mirror = _layout(layout, world, IGNORED if name == "ignore" else set())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ours_dir = Path(root) / f"ours-{layout}-{name}"
        real_dir = Path(root) / f"real-{layout}-{name}-rank{rank}"
        ours = PostHocEMA(tracked, checkpoint_folder=str(ours_dir), **options)
        real = (
            RealPostHocEMA(mirror, checkpoint_folder=str(real_dir), **options)
            if rank == 0
            else None
        )
        torch.manual_seed(1 + rank)
        for _ in range(STEPS):
            loss = model(torch.randn(4, 5)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ours.update()
            if layout == "fsdp2":
                _mirror_(mirror, model)
            if real is not None:
                real.update()
        profiles = [_floats(p.engine.get_ema_state_dict()) for p in ours.ema_models]
        synthesized = []
        for sigma_rel, gamma, step in requests:
            s = ours.synthesize_ema_model(sigma_rel=sigma_rel, gamma=gamma, step=step)
            synthesized.append(_floats(s.engine.get_ema_state_dict()))
        x = torch.randn(2, 5)
        forwards = [y.detach() for y in ours(x)]
        steps = int(ours.step)
        # Resume: a fresh drop-in loads ours.state_dict() through DCP; both go on 3 steps.
        ckpt = Path(root) / f"state-{layout}-{name}"
        dcp.save(ours.state_dict(), checkpoint_id=str(ckpt), no_dist=not world)
        resumed = PostHocEMA(
            tracked,
            checkpoint_folder=str(Path(root) / f"resumed-{layout}-{name}"),
            **{**options, "checkpoint_every_num_steps": "manual"},
        )
        state = resumed.state_dict()
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=not world)
        resumed.load_state_dict(state)
        for _ in range(3):
            loss = model(torch.randn(4, 5)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ours.update()
            resumed.update()
        resume_exact = int(resumed.step) == int(ours.step) == STEPS + 3 and all(
            _equal(_floats(a.engine.get_ema_state_dict()), _floats(b.engine.get_ema_state_dict()))
            for a, b in zip(ours.ema_models, resumed.ema_models, strict=True)
        )
        if real is None:
            continue
        real_synth = [
            _floats(
                real.synthesize_ema_model(sigma_rel=s, gamma=g, step=t).state_dict(), "ema_model."
            )
            for s, g, t in requests
        ]
        out[layout][name] = {
            "ours": profiles,
            "real": [_floats(m.state_dict(), "ema_model.") for m in real.ema_models],
            "synth": synthesized,
            "real_synth": real_synth,
            "forwards": forwards,
            "resume_exact": resume_exact,
            "dtensor_params": all(isinstance(v, DTensor) for v in tracked.parameters()),
            "real_forwards": [y.detach() for y in real(x)],
            "gammas": (ours.gammas, real.gammas),
            "step": (steps, int(real.step)),
            "ours_dir": str(ours_dir),
            "real_dir": str(real_dir),
            "ema_bytes": sum(p.engine.local_nbytes() for p in ours.ema_models),
            "real_bytes": sum(
                v.numel() * v.element_size()
                for m in real.ema_models
                for v in m.ema_model.state_dict().values()
                if v.is_floating_point()
            ),
        }
    if world:
        dist.barrier()
    return out


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """``{cell: rank 0's results per option name}``, cells as in :data:`CELLS`."""
    root = tmp_path_factory.mktemp("posthoc")
    per_world = {0: _body(0, 0, str(root / "w0"))}
    # W=1 in this process (a one-rank gloo group: no spawn), then one spawn per W.
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1
    )
    try:
        per_world[1] = _body(0, 1, str(root / "w1"))
    finally:
        dist.destroy_process_group()
    for world in (2, 3):
        d = root / f"w{world}"
        d.mkdir()
        per_world[world] = run_ranks(_body, world, d, str(d))[0]
    return {
        f"w{world}-{layout}": by_name
        for world, by_layout in per_world.items()
        for layout, by_name in by_layout.items()
    }


CELLS = ["w0-none", "w1-ddp", "w1-fsdp2", "w2-ddp", "w2-fsdp2", "w3-ddp", "w3-fsdp2"]
"""World size (0: no process group) and layout of the model the drop-in tracks."""


def _world(cell: str) -> int:
    return int(cell.split("-")[0][1:])


def _read_snapshot(path: Path, key: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our snapshot's profile ``key`` as full tensors, read in this process (no group)."""
    import json

    manifest = json.loads((path / "manifest.json").read_text())
    dtypes = {
        k: getattr(torch, v["dtype"].removeprefix("torch.")) for k, v in manifest["tensors"].items()
    }
    state = {key: {k: torch.empty(like[k].shape, dtype=dtypes[k]) for k in like}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state[key]


def _kept(real: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """ema-pytorch's tensors that ours stores: all but the ignored ones."""
    if name != "ignore":
        return real
    assert real.keys() >= IGNORED  # ema-pytorch's model and files hold them
    return {k: v for k, v in real.items() if k not in IGNORED}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_profiles_bit_exact(runs: dict[str, dict[str, Any]], cell: str, name: str) -> None:
    run = runs[cell][name]
    assert run["gammas"][0] == tuple(run["gammas"][1])
    assert run["step"][0] == run["step"][1] == STEPS
    for ours, real in zip(run["ours"], run["real"], strict=True):
        assert all(torch.isfinite(v).all() for v in real.values())
        assert _equal(ours, _kept(real, name))
    for ours, real in zip(run["forwards"], run["real_forwards"], strict=True):
        assert torch.equal(ours, real)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_checkpoint_tensors_bit_exact(
    runs: dict[str, dict[str, Any]], cell: str, name: str
) -> None:
    run = runs[cell][name]
    real_files = sorted(Path(run["real_dir"]).glob("*.pt"))
    ours = {int(p.name.split("-")[1]): p for p in Path(run["ours_dir"]).glob("step-*")}
    ours = {k: v for k, v in ours.items() if k <= STEPS}  # later ones: the resume check's
    every = OPTIONS[name][0]["checkpoint_every_num_steps"]
    assert sorted(ours) == list(range(every, STEPS + 1, every))
    assert len(real_files) == 2 * len(ours)
    for f in real_files:
        index, step = map(int, f.stem.split("."))
        real = _kept(_floats(torch.load(f, weights_only=True), "ema_model."), name)
        assert all(v.dtype == torch.float16 for v in real.values())
        assert _equal(_read_snapshot(ours[step], f"p{index}", real), real), f.name


def _reference(
    run: dict[str, Any], gamma: float, step: int | None
) -> tuple[dict[str, torch.Tensor], float]:
    """ema-pytorch's weights over its own files, summed in float64 in our term order; and
    the bound of float32 summation error (sum of |w| times the largest value, 16 ulps)."""
    files = sorted(
        Path(run["real_dir"]).glob("*.pt"), key=lambda f: tuple(map(int, f.stem.split(".")))[::-1]
    )
    keys = [tuple(map(int, f.stem.split("."))) for f in files]
    gammas = run["gammas"][1]
    t_i = torch.tensor([s for _, s in keys])
    g_i = torch.tensor([gammas[i] for i, _ in keys])
    step = max(t_i.tolist()) if step is None else step
    weights = (
        solve_weights(t_i, g_i, torch.tensor([step]), torch.tensor([gamma])).squeeze(-1).tolist()
    )
    acc: dict[str, torch.Tensor] = {}
    for f, w in zip(files, weights, strict=True):
        for k, v in _floats(torch.load(f, weights_only=True), "ema_model.").items():
            acc.setdefault(k, torch.zeros(v.shape, dtype=torch.float64)).add_(v.double(), alpha=w)
    top = max(float(v.abs().max()) for v in acc.values())
    bound = 16 * torch.finfo(torch.float32).eps * sum(abs(w) for w in weights) * max(top, 1.0)
    return {k: v.float() for k, v in acc.items()}, bound


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_synthesized_matches(runs: dict[str, dict[str, Any]], cell: str, name: str) -> None:
    from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma

    run = runs[cell][name]
    requests = OPTIONS[name][1]
    for (sigma_rel, gamma, step), ours, real in zip(
        requests, run["synth"], run["real_synth"], strict=True
    ):
        g = sigma_rel_to_gamma(sigma_rel) if gamma is None else gamma
        ref, bound = _reference(run, g, step)
        assert math.isfinite(bound) and all(torch.isfinite(v).all() for v in ref.values())
        seen_followed = "seen" in OPTIONS[name][0].get("param_or_buffer_names_no_ema", ())
        assert set(ours) == set(_kept(ref, name))  # ignored tensors: not synthesized
        compared = {k: v for k, v in ours.items() if not (seen_followed and k == "seen")}
        assert _equal(compared, {k: ref[k] for k in compared})
        for k in compared:
            torch.testing.assert_close(compared[k], real[k], rtol=0, atol=bound)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_state_dict_resume_is_exact(runs: dict[str, dict[str, Any]], cell: str, name: str) -> None:
    """``dcp.save(ph.state_dict())``, a fresh drop-in ``load_state_dict``s it, both go on."""
    assert runs[cell][name]["resume_exact"]


@pytest.mark.parametrize("cell", CELLS)
def test_rank_holds_its_share(runs: dict[str, dict[str, Any]], cell: str) -> None:
    """Rank 0 (the largest shard) holds about 1/W of ema-pytorch's per-rank copies."""
    run, world = runs[cell]["sigma"], _world(cell)
    assert run["dtensor_params"] == cell.endswith("fsdp2")  # the drop-in tracks FSDP2's shards
    rows = 2 * 7 * 4 * 4  # at most one extra row per tensor and profile from uneven chunks
    assert run["ema_bytes"] <= run["real_bytes"] // max(world, 1) + rows
    if world <= 1:
        assert run["ema_bytes"] == run["real_bytes"]


def test_engine_takes_exact_gammas(tmp_path: Path) -> None:
    """``dtensor_ema.PostHocEMA(gammas=)`` keeps the exponents as given (no round trip
    through ``sigma_rel``) and refuses bad ones."""
    from dtensor_ema import PostHocEMA as Engine
    from dtensor_ema.posthoc.phema_math import gamma_to_sigma_rel

    gammas = (16.972198602303447, 6.937203937601809)
    engine = Engine(Net(), gammas=gammas, snapshot_dir=tmp_path)
    assert engine.gammas == gammas
    assert engine.sigma_rels == tuple(gamma_to_sigma_rel(g) for g in gammas)
    for bad in ((), (-1.0, 2.0), 3.0):
        with pytest.raises(ValueError, match="gammas"):
            Engine(Net(), gammas=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_rels=(0.05, 0.1), ema_model=Net), "ema_model"),
        (dict(sigma_rels=(0.05, 0.1), frozen=True), "frozen"),
        (dict(), "sigma_rels or gammas"),
        (dict(gammas=(5.0,)), "at least 2"),
        (dict(gammas=(5.0, 5.0)), "unique"),
        (dict(gammas=(5.0, 6.0), update_every=0), "update_every"),
        (dict(gammas=(5.0, 6.0), checkpoint_every_num_steps=0), "checkpoint_every_num_steps"),
    ],
)
def test_refuses_clearly(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PostHocEMA(Net(), checkpoint_folder=str(tmp_path), **kwargs)


def test_copy_params_both_ways(tmp_path: Path) -> None:
    """ema-pytorch's ``copy_params_from_model_to_ema`` / ``copy_params_from_ema_to_model``
    (the latter leaves the last profile in the model, as ema-pytorch's loop does)."""
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ph = PostHocEMA(net, checkpoint_folder=str(tmp_path), gammas=(5.0, 12.0), update_every=1)
    for _ in range(3):
        net(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ph.update()
    model = _floats(net.state_dict())
    last = _floats(ph.ema_models[-1].engine.get_ema_state_dict())
    assert not _equal(model, last)
    ph.copy_params_from_ema_to_model()
    assert _equal(_floats(net.state_dict()), last)
    net.body[0].weight.data.add_(1.0)
    ph.copy_params_from_model_to_ema()
    for profile in ph.ema_models:
        assert _equal(_floats(profile.engine.get_ema_state_dict()), _floats(net.state_dict()))
