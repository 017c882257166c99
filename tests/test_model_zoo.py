"""Model zoo: real models from timm, torchvision, transformers, diffusers and torchtitan,
built offline from configs (no weights downloaded), trained a few real AdamW steps.
torchtitan brings a dense model (llama3) and a MoE one (deepseek_v3: grouped experts as 3-D
parameters, the float buffer ``expert_bias_E`` moved by torchtitan's own load-balancing
optimizer hook; its token counter ``tokens_per_expert_E`` is a non-persistent buffer, outside
the state dict and so outside the EMA and the reference).

For every model, under DDP and FSDP2 at W=2 (one spawn for the whole zoo; each family's
tests read their family's results):

* the EMA of every live parameter and float buffer equals a reference written here (plain
  ``lerp_`` on full tensors gathered from the model after every step), bit for bit, and the
  EMA holds no other entry;
* inside ``average_parameters()`` the model holds the reference, its forward equals an
  unsharded model loaded with the EMA, and the raw weights (integer buffers included) come
  back exactly;
* ``ema.module`` forward equals that unsharded model;
* a DCP checkpoint reshards W=2 -> W=3 (a second spawn, loading the DDP
  checkpoint into FSDP2 and the FSDP2 one into DDP) -> one process without a process group.

Every rank is seeded alike and sees the same batch, so replicated buffers (BatchNorm
statistics) stay identical across ranks and the reference is unambiguous.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import require_extra, run_ranks
from titan_models import deepseek_v3_debugmodel, llama3_debugmodel
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dtensor_ema import ModelEMA, load_checkpoint, save_checkpoint
from dtensor_ema.model_keys import live_tensors

pytestmark = pytest.mark.distributed

if os.environ.get("DTENSOR_EMA_TEST_BACKEND", "gloo") != "gloo":  # CPU models only
    pytest.skip("the zoo runs on gloo CPU ranks", allow_module_level=True)

DECAY = 0.75
STEPS = 3
WRAPPERS = ("ddp", "fsdp")


# ------------------------------------------------------------------ the zoo
@dataclass(frozen=True)
class Spec:
    """How to build, feed and shard one model. ``units`` lists the submodules made FSDP2
    units before the root (the root alone when empty); ``optimizer_hooks(module, opt)``
    registers what the model's own trainer hooks on its optimizer."""

    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[Any, ...]]
    forward: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor]
    loss: Callable[[torch.Tensor, tuple[Any, ...]], torch.Tensor]
    units: Callable[[nn.Module], list[nn.Module]] = lambda m: []
    optimizer_hooks: Callable[[nn.Module, torch.optim.Optimizer], None] = lambda m, o: None


def _images(n_classes: int = 4, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, size, size), torch.randint(0, n_classes, (2,))


def _classify(model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    return model(batch[0])


def _cross_entropy(out: torch.Tensor, batch: tuple[Any, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), batch[1])


def _timm(name: str, **kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=4, **kwargs)


def _torchvision(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=4)


VOCAB = 128


def _tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, 8)),)


def _logits(model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    out = model(batch[0])
    return out if isinstance(out, torch.Tensor) else out.logits


def _next_token(out: torch.Tensor, batch: tuple[Any, ...]) -> torch.Tensor:
    logits = out[:, :-1].reshape(-1, out.shape[-1]).float()
    return nn.functional.cross_entropy(logits, batch[0][:, 1:].reshape(-1))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _unet() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip


def _noisy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 8, 8), torch.tensor([3, 7]), torch.randn(2, 3, 8, 8)


def _denoise(model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    return model(batch[0], batch[1]).sample


def _mse(out: torch.Tensor, batch: tuple[Any, ...]) -> torch.Tensor:
    return nn.functional.mse_loss(out, batch[2])


def _titan() -> nn.Module:
    return llama3_debugmodel(layers=2)


def _titan_moe() -> nn.Module:
    """torchtitan's DeepSeek-V3 ``debugmodel`` cut to its first 2 blocks: block 0 dense,
    block 1 MoE, with the float32 buffers ``expert_bias_E`` (persistent: the EMA tracks it)
    and ``tokens_per_expert_E`` (non-persistent: outside the state dict, so outside the
    EMA)."""
    return deepseek_v3_debugmodel(layers=2)


def _titan_moe_hooks(module: nn.Module, opt: torch.optim.Optimizer) -> None:
    """torchtitan's own load-balancing hook: before each ``opt.step()`` it adds
    ``1e-3 * sign(mean(count) - count)`` (centred) to ``expert_bias_E`` and zeroes the
    count ``tokens_per_expert_E``. The counts are not all-reduced (no loss mesh): every rank
    sees the same batch, so they agree, and a sum over ranks would not change the signs."""
    from types import SimpleNamespace

    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    dims = SimpleNamespace(get_optional_mesh=lambda *a, **k: None, ep_enabled=False, tp=1)
    register_moe_load_balancing_hook(opt, [module], dims)


def _titan_tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 2048, (2, 8)),)


def _layers(path: str) -> Callable[[nn.Module], list[nn.Module]]:
    def units(model: nn.Module) -> list[nn.Module]:
        container = functools.reduce(getattr, path.split("."), model)
        return list(container.values() if isinstance(container, nn.ModuleDict) else container)

    return units


ZOO: dict[str, dict[str, Spec]] = {
    "timm": {
        "resnet": Spec(lambda: _timm("test_resnet"), _images, _classify, _cross_entropy),
        "vit": Spec(
            lambda: _timm("test_vit", img_size=32),
            _images,
            _classify,
            _cross_entropy,
            _layers("blocks"),
        ),
        "convnext": Spec(lambda: _timm("test_convnext"), _images, _classify, _cross_entropy),
        "efficientnet": Spec(
            lambda: _timm("test_efficientnet"), _images, _classify, _cross_entropy
        ),
    },
    "torchvision": {
        "resnet18": Spec(lambda: _torchvision("resnet18"), _images, _classify, _cross_entropy),
        "mobilenet_v3_small": Spec(
            lambda: _torchvision("mobilenet_v3_small"), _images, _classify, _cross_entropy
        ),
    },
    "transformers": {
        "gpt2_tied": Spec(_gpt2, _tokens, _logits, _next_token),
        "llama": Spec(_llama, _tokens, _logits, _next_token, _layers("model.layers")),
    },
    "diffusers": {"unet2d": Spec(_unet, _noisy, _denoise, _mse)},
    "torchtitan": {
        "llama3_debugmodel": Spec(_titan, _titan_tokens, _logits, _next_token, _layers("layers")),
        "deepseek_v3_moe": Spec(
            _titan_moe, _titan_tokens, _logits, _next_token, _layers("layers"), _titan_moe_hooks
        ),
    },
}
EXTRAS = {
    "timm": "timm",
    "torchvision": "torchvision",
    "transformers": "transformers",
    "diffusers": "diffusers",
    "torchtitan": "torchtitan",
}


# ------------------------------------------------------------------ helpers (run on ranks)
def _build(spec: Spec) -> nn.Module:
    torch.manual_seed(0)  # every rank alike: the EMA refuses replicas that differ
    return spec.build()


def _wrap(spec: Spec, module: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return DDP(module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in spec.units(module):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A full copy of ``tensor`` (a collective for DTensors: every rank calls it alike)."""
    tensor = tensor.detach()
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.clone()


def _full_live(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(t) for name, t in live_tensors(module).items()}


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing, extra, or not bitwise equal."""
    out = [f"missing {k}" for k in want if k not in got]
    out += [f"extra {k}" for k in got if k not in want]
    out += [
        f"differs {k}"
        for k in want
        if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))
    ]
    return out


def _error(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # reported to pytest, which decides
        return None, f"{type(e).__name__}: {e}"


def _train_body(rank: int, world_size: int, families: list[str], root: str) -> dict[str, Any]:
    """W=2: :func:`_train_family` for each of ``families``."""
    return {family: _train_family(rank, family, root) for family in families}


def _train_family(rank: int, family: str, root: str) -> dict[str, Any]:
    """Train each model of ``family`` under DDP and FSDP2, check it, save a checkpoint."""
    out: dict[str, Any] = {}
    for name, spec in ZOO[family].items():
        for wrapper in WRAPPERS:
            module = _build(spec)
            wrapped = _wrap(spec, module, wrapper)
            ema = ModelEMA(wrapped, decay=DECAY, tau=None)
            reference = {k: v.float() for k, v in _full_live(module).items()}
            reference = {k: v for k, v in reference.items() if v.is_floating_point()}
            float_keys = [k for k, t in live_tensors(module).items() if t.is_floating_point()]
            reference = {k: reference[k] for k in float_keys}
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
            spec.optimizer_hooks(module, opt)
            for step in range(STEPS):
                torch.manual_seed(100 + step)  # the same batch on every rank
                batch = spec.batch()
                spec.loss(spec.forward(wrapped, batch), batch).backward()
                opt.step()
                opt.zero_grad()
                ema.update()
                live = _full_live(module)
                for k, v in reference.items():
                    v.lerp_(live[k].float(), 1 - DECAY)
            cell: dict[str, Any] = {}
            cell["finite"] = all(bool(torch.isfinite(v).all()) for v in reference.values())
            cell["moved"] = any(not torch.equal(v, live[k].float()) for k, v in reference.items())
            ema_full = {k: _full(v) for k, v in ema.ema_tensors().items()}
            want = {k: v.to(live[k].dtype) for k, v in reference.items()}
            # The EMA stores each tied tensor once: a tied name must equal its twin.
            cell["ema"] = _differ(ema_full, {k: want[k] for k in ema_full if k in want}) + [
                f"untracked {k}" for k in want if k not in ema_full and not _tied(module, k)
            ]

            # The unsharded model loaded with the EMA, in the model's own keys.
            ema_sd, _ = ema.get_model_state_dict()
            plain = _build(spec)
            plain.load_state_dict(ema_sd)
            plain.eval()
            torch.manual_seed(200)
            batch = spec.batch()
            with torch.no_grad():
                expected = spec.forward(plain, batch)

            module.eval()
            raw = _full_live(module)
            with ema.average_parameters() as swapped:
                inside = _full_live(swapped)
                with torch.no_grad():
                    swapped_out = spec.forward(wrapped, batch)
            cell["inside"] = _differ({k: inside[k] for k in want}, {k: v for k, v in want.items()})
            cell["swapped_forward"] = bool(torch.equal(swapped_out, expected))
            cell["restored"] = _differ(_full_live(module), raw)

            def module_forward(
                ema: ModelEMA = ema,
                batch: tuple[Any, ...] = batch,
                spec: Spec = spec,
                cell: dict[str, Any] = cell,
                expected: torch.Tensor = expected,
            ) -> bool:
                ema_module = ema.module
                ema_module.eval()
                with torch.no_grad():
                    got = spec.forward(ema_module, batch)
                cell["module_max_diff"] = float((got - expected).abs().max())
                return bool(torch.equal(got, expected))

            cell["module_forward"], cell["module_error"] = _error(module_forward)
            module.train()

            save_checkpoint({"ema": ema}, Path(root) / f"{name}-{wrapper}-w2")
            if rank == 0:
                torch.save(
                    {"reference": want, "updates": ema.updates},
                    Path(root) / f"{name}-{wrapper}.pt",
                )
            out[f"{name}/{wrapper}"] = cell
    return out


def _tied(module: nn.Module, key: str) -> bool:
    """Whether ``key`` names a tensor that another live name shares."""
    tensors = live_tensors(module)
    return sum(t is tensors[key] for t in tensors.values()) > 1


def _reshard_body(rank: int, world_size: int, families: list[str], root: str) -> dict[str, Any]:
    """W=3: :func:`_reshard_family` for each of ``families``."""
    return {family: _reshard_family(family, root) for family in families}


def _reshard_family(family: str, root: str) -> dict[str, Any]:
    """Load each W=2 checkpoint into the other wrapper, compare, save again."""
    out: dict[str, Any] = {}
    for name, spec in ZOO[family].items():
        for saved, wrapper in (("ddp", "fsdp"), ("fsdp", "ddp")):
            module = _build(spec)
            wrapped = _wrap(spec, module, wrapper)
            ema = ModelEMA(wrapped, decay=DECAY, tau=None)
            load_checkpoint({"ema": ema}, Path(root) / f"{name}-{saved}-w2")
            saved_ref = torch.load(Path(root) / f"{name}-{saved}.pt")
            got = {k: _full(v) for k, v in ema.ema_tensors().items()}
            out[f"{name}/{saved}->{wrapper}"] = {
                "ema": _differ(got, {k: saved_ref["reference"][k] for k in got}),
                "updates": (ema.updates, saved_ref["updates"]),
            }
            save_checkpoint({"ema": ema}, Path(root) / f"{name}-{saved}-w3")
    return out


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _require(family: str) -> None:
    require_extra(EXTRAS[family], "zoo")


def _installed() -> list[str]:
    return [family for family in ZOO if importlib.util.find_spec(EXTRAS[family]) is not None]


@pytest.fixture(scope="module")
def trained(zoo_root: Path) -> list[dict[str, Any]]:
    """Every rank's results of the W=2 spawn, each ``{family: {cell: ...}}``."""
    return run_ranks(_train_body, 2, zoo_root, _installed(), str(zoo_root), deadline_s=900)


@pytest.fixture(scope="module")
def resharded(trained: list[dict[str, Any]], zoo_root: Path) -> list[dict[str, Any]]:
    """Every rank's results of the W=3 spawn (it loads the W=2 checkpoints)."""
    return run_ranks(_reshard_body, 3, zoo_root, _installed(), str(zoo_root), deadline_s=900)


@pytest.mark.parametrize("family", list(ZOO))
def test_zoo_ema_swap_and_module(family: str, trained: list[dict[str, Any]]) -> None:
    """EMA == reference, swap holds the reference and restores, module forward (W=2)."""
    _require(family)
    results = [r[family] for r in trained]
    plain = [
        {k: {n: v for n, v in cell.items() if n != "module_max_diff"} for k, cell in r.items()}
        for r in results
    ]
    assert plain[0] == plain[1], ("ranks disagree", results)
    cells = results[0]
    assert set(cells) == {f"{n}/{w}" for n in ZOO[family] for w in WRAPPERS}
    module_failures = {}
    for key, cell in cells.items():
        assert cell["finite"] and cell["moved"], key
        assert cell["ema"] == [], (key, cell["ema"])
        assert cell["inside"] == [], (key, cell["inside"])
        assert cell["swapped_forward"], key
        assert cell["restored"] == [], (key, cell["restored"])
        if cell["module_error"] is not None or not cell["module_forward"]:
            module_failures[key] = cell["module_error"] or "forward differs"
    assert module_failures == {}


@pytest.mark.parametrize("family", list(ZOO))
def test_zoo_dcp_reshards_2_3_1(
    family: str, resharded: list[dict[str, Any]], zoo_root: Path
) -> None:
    """DCP: saved at W=2, loaded at W=3 into the other wrapper, then in one process."""
    _require(family)
    for key, cell in resharded[0][family].items():
        assert cell["ema"] == [], (key, cell["ema"])
        assert cell["updates"][0] == cell["updates"][1] == STEPS, key
    for name, spec in ZOO[family].items():
        for saved in WRAPPERS:
            ema = ModelEMA(_build(spec), decay=DECAY, tau=None)
            load_checkpoint({"ema": ema}, zoo_root / f"{name}-{saved}-w3")
            want = torch.load(zoo_root / f"{name}-{saved}.pt")["reference"]
            got = ema.ema_tensors()
            assert _differ(got, {k: want[k] for k in got}) == [], (name, saved)
            assert ema.updates == STEPS


@pytest.mark.parametrize(
    "family_model", ["torchtitan/llama3_debugmodel", "torchtitan/deepseek_v3_moe"]
)
def test_zoo_models_build_the_same_whatever_the_allocator_held(family_model: str) -> None:
    """A zoo model built twice under one seed is the same, finite, even after the allocator
    held huge values: no parameter or buffer is left uninitialized (torchtitan's
    ``config.build()`` alone leaves the grouped experts as ``torch.empty``). One process."""
    family, name = family_model.split("/")
    _require(family)
    built = []
    for poison in (float("nan"), 1e30):
        for numel in (1 << 12, 1 << 16, 1 << 19, 1 << 21):  # freed blocks the build may reuse
            del_me = torch.full((numel,), poison)
            del del_me
        torch.manual_seed(0)
        model = ZOO[family][name].build()
        built.append({k: t.detach().clone() for k, t in live_tensors(model).items()})
    floats = {k: t for k, t in built[0].items() if t.is_floating_point()}
    assert [k for k, t in floats.items() if not t.isfinite().all()] == []
    assert [k for k in built[0] if not torch.equal(built[0][k], built[1][k])] == []
