"""The drop-ins follow the tracked set, each tried on a peft LoRA model (transformers GPT-2)
against the real library, in one process:

* diffusers' ``EMAModel(adapter_parameters, model=peft_model)`` keeps the adapter list (it
  used to replace it with every parameter of ``model=``), bit for bit with diffusers';
* ema-pytorch's ``ignore_names``/``ignore_startswith_names`` (refused before) become
  ``track=``: ignored tensors are not stored; ``param_or_buffer_names_no_ema`` stays
  ``exclude=``; ``ema_model`` equals ema-pytorch's bit for bit;
* Lightning's ``EMAWeightAveraging`` holds the adapters only when asked
  (``track="trainable"``), with the average of the adapters equal to Lightning's own
  callback's and a checkpoint a plain module loads strictly.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from models import peft_lora
from torch import nn

HAVE = all(
    importlib.util.find_spec(m) is not None
    for m in ("peft", "transformers", "diffusers", "ema_pytorch", "lightning")
)
pytestmark = pytest.mark.skipif(
    not HAVE and not os.environ.get("CI"),
    reason="needs the 'transformers' and 'compat' extras (peft, diffusers, ema-pytorch, lightning)",
)
TOKENS = torch.randint(1, 96, (4, 8), generator=torch.Generator().manual_seed(0))


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adapter(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_diffusers_keeps_the_lora_parameter_list() -> None:
    from diffusers.training_utils import EMAModel as RealEMAModel

    from dtensor_ema.compat.diffusers import EMAModel

    model = peft_lora("gpt2")
    adapter = _adapter(model)
    real = RealEMAModel(adapter, decay=0.9)
    ours = EMAModel(adapter, decay=0.9, model=model)
    assert ours.engine.local_nbytes() == _nbytes(adapter)  # not the whole model's
    assert len(ours.shadow_params) == len(adapter)
    optimizer = torch.optim.SGD(adapter, lr=0.1)
    for _ in range(3):
        _train_step(model, optimizer)
        real.step(adapter)
        ours.step(adapter)
    assert all(
        torch.equal(a, b) for a, b in zip(real.shadow_params, ours.shadow_params, strict=True)
    )
    ours.copy_to(adapter)
    assert all(torch.equal(p, s) for p, s in zip(adapter, real.shadow_params, strict=True))
    with pytest.raises(ValueError, match=r"parameters \[0\] are not parameters of model="):
        EMAModel([nn.Parameter(torch.zeros(2))], model=model)


def test_ema_pytorch_ignore_names_are_not_stored() -> None:
    import ema_pytorch

    from dtensor_ema.compat.ema_pytorch import EMA

    model = peft_lora("gpt2")
    adapter = {k: p for k, p in model.named_parameters() if p.requires_grad}
    frozen = [k for k, p in model.named_parameters() if not p.requires_grad]
    no_ema = {next(iter(adapter))}  # one adapter tensor copied instead of averaged
    # Half the base by exact name, the rest by prefix (the blocks).
    ignore_names = {k for k in frozen if ".h." not in k}
    prefixes = {"base_model.model.transformer.h.0.ln", "base_model.model.transformer.h.1.ln"}
    prefixes |= {k for k in frozen if ".h." in k and ".ln_" not in k}
    kw: dict[str, Any] = dict(
        beta=0.9,
        update_after_step=0,
        update_every=1,
        ignore_names=ignore_names,
        ignore_startswith_names=prefixes,
        param_or_buffer_names_no_ema=no_ema,
    )
    real = ema_pytorch.EMA(model, **kw)
    ours = EMA(model, **kw)
    assert ours.engine.untracked == frozen  # the ignored base: not stored
    assert ours.engine.local_nbytes() == _nbytes(adapter.values())
    optimizer = torch.optim.SGD(list(adapter.values()), lr=0.1)
    for _ in range(4):
        _train_step(model, optimizer)
        real.update()
        ours.update()
    ours.eval()
    got, expected = ours.ema_model.state_dict(), real.ema_model.state_dict()
    assert list(got) == list(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert torch.equal(got[next(iter(no_ema))], adapter[next(iter(no_ema))])  # copied
    # The replica holds no copy of the ignored base: its tensors are the model's own.
    replica = dict(ours.ema_model.named_parameters())
    assert all(replica[k].data_ptr() == model.get_parameter(k).data_ptr() for k in frozen)


def test_lightning_holds_the_adapters_only_when_asked(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EMAWeightAveraging as RealEMAWeightAveraging

    from dtensor_ema.compat.lightning import EMAWeightAveraging
    from dtensor_ema.compat.swa_utils import AveragedModel

    class LoraModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = peft_lora("gpt2")

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(_adapter(self.model), lr=0.1)

    def fit(callback: Any) -> tuple[LoraModule, pl.Trainer]:
        module = LoraModule()
        trainer = pl.Trainer(
            max_steps=3,
            accelerator="cpu",
            devices=1,
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path),
        )
        loader = torch.utils.data.DataLoader(TOKENS, batch_size=2)  # type: ignore[arg-type]
        trainer.fit(module, loader)
        return module, trainer

    adapter_bytes = _nbytes(_adapter(LoraModule()))
    floats = _nbytes(t for t in LoraModule().state_dict().values() if t.is_floating_point())
    assert AveragedModel(LoraModule()).engine.local_nbytes() == floats - 96 * 32 * 4  # tied
    ours_cb = EMAWeightAveraging(decay=0.5, track="trainable")
    ours, trainer = fit(ours_cb)
    assert ours_cb._average_model is not None
    assert ours_cb._average_model.engine.local_nbytes() == adapter_bytes  # asked: adapters
    real_cb = RealEMAWeightAveraging(decay=0.5)
    real, _ = fit(real_cb)
    # Both copy the average into the module at the end of training: the adapters match.
    ours_sd, real_sd = ours.state_dict(), real.state_dict()
    assert [k for k in real_sd if not torch.equal(ours_sd[k], real_sd[k])] == []
    trainer.save_checkpoint(tmp_path / "ours.ckpt")
    checkpoint = torch.load(tmp_path / "ours.ckpt", weights_only=False)
    fresh = LoraModule()
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)  # whole: base from the model
    assert all(torch.equal(v, ours_sd[k]) for k, v in fresh.state_dict().items())


def test_lightning_follows_backbone_finetuning(tmp_path: Path) -> None:
    """``track="trainable"`` with Lightning's ``BackboneFinetuning`` set up after the EMA
    callback (it freezes the backbone in its own ``setup``, then unfreezes it at epoch 1):
    the average leaves the frozen backbone out until then, and at the end equals
    Lightning's own callback (which averages everything) bit for bit; our callback too."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning
    from lightning.pytorch.callbacks import EMAWeightAveraging as RealEMAWeightAveraging

    from dtensor_ema.compat.lightning import EMAWeightAveraging
    from dtensor_ema.integrations.lightning import EMACallback

    class Finetuned(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    seen: dict[str, int] = {}

    class Watch(pl.Callback):  # the stored bytes during epoch 0, after the freeze
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            for cb in trainer.callbacks:  # type: ignore[attr-defined]
                engine = getattr(getattr(cb, "_average_model", None), "engine", None)
                engine = engine or getattr(cb, "_ema", None)
                if engine is not None and trainer.current_epoch == 0:
                    seen[type(cb).__name__] = engine.local_nbytes()

    def fit(callback: Any) -> Finetuned:
        module = Finetuned()
        trainer = pl.Trainer(
            max_epochs=2, accelerator="cpu", devices=1, logger=False,
            callbacks=[callback, BackboneFinetuning(unfreeze_backbone_at_epoch=1), Watch()],
            enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        return module

    real = fit(RealEMAWeightAveraging(decay=0.5))
    ours = fit(EMAWeightAveraging(decay=0.5, track="trainable"))
    head_bytes = _nbytes(Finetuned().head.parameters())
    assert seen["EMAWeightAveraging"] == head_bytes  # the frozen backbone left out
    real_sd, ours_sd = real.state_dict(), ours.state_dict()
    assert [k for k in real_sd if not torch.equal(ours_sd[k], real_sd[k])] == []
    callback = EMACallback(decay=0.5, tau=None, track="trainable", copy_to_model_on_train_end=True)
    own = fit(callback)
    assert seen["EMACallback"] == head_bytes
    assert set(callback.ema.ema_tensors()) == set(real_sd)  # the backbone followed
    # Its average starts from the weights at fit start (Lightning's copies the first
    # step's), so only the backbone's, added at epoch 1 from the same value, match.
    own_sd = own.state_dict()
    backbone = [k for k in real_sd if k.startswith("backbone.")]
    assert backbone and [k for k in backbone if not torch.equal(own_sd[k], real_sd[k])] == []
    assert not torch.equal(own_sd["head.weight"], real_sd["head.weight"])
