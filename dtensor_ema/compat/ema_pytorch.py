"""ema-pytorch's ``EMA``, sharded: ``from dtensor_ema.compat.ema_pytorch import EMA``.

Same constructor (defaults ``beta=0.9999, update_after_step=100, update_every=10``),
attributes and methods; the numbers come from :class:`~dtensor_ema.ModelEMA` with
:class:`~dtensor_ema.decay.EmaPytorchDecay` (the warmup rounded in float32, as ema-pytorch
does). ema-pytorch's ``update_every=N`` averages on steps ``0, N, 2N, ...`` with the plain
decay: mapped onto ``ModelEMA(update_every=N, updates=N - 1, update_after_step=N +
update_after_step - 1)`` with a schedule that does not raise the decay to ``N``.
``ignore_names``/``ignore_startswith_names`` map onto ``track=`` (ignored tensors are not
stored), ``param_or_buffer_names_no_ema`` onto ``exclude=``; ``ema_model``,
``update_model_with_ema_every``, ``forward_method_names`` and ``lazy_init_ema`` are refused.

Evaluation (``ema(x)``, ``ema.eval()``, ``forward_eval``) runs on ``ema_model`` and the
rank-0 save ``torch.save(ema.state_dict())`` reads it, by the drop-ins' shared rules
(:class:`~dtensor_ema.compat._replica.ReplicaFacade`): ``ema.eval()`` or
``ema.gather_for_save()`` all-gathers the full parameters (**collective**: every rank; peak
one full copy per rank, what ema-pytorch keeps always) until the next change.
``evaluation="sharded"`` evaluates through the engine's FSDP2 module instead (FSDP2/TP
models always do). The guide, with the numbers checked against ema-pytorch 0.8.3 and what
differs: ``docs/migration-ema-pytorch.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from dtensor_ema.compat._ema_pytorch_posthoc import NotIgnored, PostHocEMA
from dtensor_ema.compat._replica import ReplicaFacade, fix_message, keeps_buffers_whole
from dtensor_ema.decay import EmaPytorchDecay
from dtensor_ema.integrations._common import copy_ema_into_model
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import check_int

__all__ = ["EMA", "PostHocEMA"]

_REFUSED: dict[str, Any] = {
    "ema_model": None,
    "update_model_with_ema_every": None,
    "forward_method_names": (),
    "lazy_init_ema": False,
}


class EMA(ReplicaFacade):
    """ema-pytorch's ``EMA`` with each rank holding ``1/W`` of the average.

    Construction is collective where :class:`~dtensor_ema.ModelEMA`'s is (every rank);
    ``update()``, ``train()`` and ``ema(x)`` (replica) are local; ``eval()`` and
    ``gather_for_save()`` are collective over the EMA's mesh (see the module docstring).
    ``evaluation`` and ``mesh`` (keyword only) are ours; other keywords go to ``ModelEMA``.
    """

    MODULE = "ema_model"

    def __init__(
        self,
        model: nn.Module,
        ema_model: nn.Module | Callable[[], nn.Module] | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        param_or_buffer_names_no_ema: set[str] = set(),  # noqa: B006 (ema-pytorch's default)
        ignore_names: set[str] = set(),  # noqa: B006
        ignore_startswith_names: set[str] = set(),  # noqa: B006
        include_online_model: bool = True,
        allow_different_devices: bool = False,
        use_foreach: bool = False,
        update_model_with_ema_every: int | None = None,
        update_model_with_ema_beta: float = 0.0,
        forward_method_names: tuple[str, ...] = (),
        move_ema_to_online_device: bool = False,
        coerce_dtype: bool = False,
        lazy_init_ema: bool = False,
        *,
        evaluation: Literal["replica", "sharded"] = "replica",
        **engine: Any,
    ) -> None:
        super().__init__()
        given = dict(
            ema_model=ema_model,
            update_model_with_ema_every=update_model_with_ema_every,
            forward_method_names=forward_method_names,
            lazy_init_ema=lazy_init_ema,
        )
        refused = [k for k, v in given.items() if v != _REFUSED[k]]
        if refused:
            raise ValueError(
                f"dtensor_ema.compat.ema_pytorch.EMA does not support {refused}: the sharded "
                "EMA builds its module from the model"
            )
        kept = NotIgnored(frozenset(ignore_names), tuple(ignore_startswith_names))
        if kept.names or kept.prefixes:
            if "track" in engine:
                raise ValueError(
                    "pass either ignore_names/ignore_startswith_names or track=, not both"
                )
            # ema-pytorch skips them in every average: here they are not stored at all.
            engine["track"] = kept
        check_int("update_every", update_every, 1)
        self.check_evaluation(evaluation)
        engine.setdefault("replicate_buffers", keeps_buffers_whole(model, evaluation))
        self.beta, self.inv_gamma, self.power, self.min_value = beta, inv_gamma, power, min_value
        self.update_every, self.update_after_step = update_every, update_after_step
        self.include_online_model = include_online_model
        self.online_model: Any = model if include_online_model else [model]
        average = ModelEMA(
            model,
            updates=update_every - 1,  # ema-pytorch averages on steps 0, N, 2N, ...
            schedule=EmaPytorchDecay(decay=beta, gamma=inv_gamma, power=power, min_decay=min_value),
            update_every=update_every,
            update_after_step=update_every + update_after_step - 1,
            # Ignoring wins over copying, as in ema-pytorch's update loop.
            exclude={n for n in param_or_buffer_names_no_ema if kept.keeps(n)} or None,
            **engine,
        )
        # The replica registered, as ema-pytorch registers its copy.
        self.attach(average, fix_message("ema", also="`ema.eval()`"), evaluation)

    @property
    def model(self) -> nn.Module:
        """The online model (ema-pytorch's name)."""
        model = self.online_model if self.include_online_model else self.online_model[0]
        assert isinstance(model, nn.Module)
        return model

    @property
    def ema_model(self) -> nn.Module:
        """The EMA as a module: the replica (parameters gathered by ``eval()``, a call or
        ``gather_for_save()``; running it while they are freed raises), or with
        ``evaluation="sharded"`` the engine's sharded module (collective forward)."""
        return self._replica.module

    @property
    def step(self) -> torch.Tensor:
        """``update()`` calls so far (ema-pytorch's ``step`` buffer)."""
        return torch.tensor(self._engine.updates - (self.update_every - 1))

    @property
    def initted(self) -> torch.Tensor:
        return torch.tensor(bool(self.step > 0))

    def update(self) -> None:
        """One ema-pytorch step. Local: no communication."""
        self._change(self._engine.update)

    def get_current_decay(self) -> float:
        """The decay of the current ``step`` (0.0: a copy)."""
        options = self._engine.options
        return self._engine.schedule(self._engine.updates - options.update_after_step)

    def copy_params_from_model_to_ema(self) -> None:
        """Local: every rank copies its own piece."""
        self._change(self._engine.set)

    def copy_params_from_ema_to_model(self) -> None:
        """**Collective** (every rank): the model's tensors become the EMA's."""
        copy_ema_into_model(self._engine, self._engine.model)

    def add_to_optimizer_post_step_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer.register_step_post_hook(lambda *_: self.update())

    def eval(self) -> nn.Module:  # type: ignore[override]
        """``ema_model.eval()``, gathered first (**collective** after an update; replica)."""
        self._replica.prepare_eval()
        return self.ema_model.eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``ema_model(*args)``. Local (replica): after an update, on the copy gathered by
        ``eval()``/``gather_for_save()`` on every rank, else raises naming that fix."""
        return self._replica.forward_module()(*args, **kwargs)

    def forward_eval(self, *args: Any, **kwargs: Any) -> Any:
        """ema-pytorch's: the forward in eval mode, the mode restored after."""
        module = self._replica.forward_module()
        training = module.training
        module.eval()
        out = module(*args, **kwargs)
        module.train(training)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """ema-pytorch's keys (``initted``, ``step``, ``online_model.*``, ``ema_model.*``)
        with full tensors. Local; when sharded, after ``gather_for_save()`` (or ``eval()``)
        on every rank, else raises."""
        out: dict[str, Any] = {"initted": self.initted, "step": self.step}
        if self.include_online_model:
            out |= {f"online_model.{k}": v for k, v in self.model.state_dict().items()}
        full = self._replica.full_state("EMA.state_dict()")
        out |= {f"ema_model.{k}": v for k, v in full.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_: Any) -> Any:  # type: ignore[override]
        """Load full tensors (every rank loads the same file and keeps its piece). Local."""
        prefix = "ema_model."
        ema = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        step = int(state_dict["step"])
        self._engine.load_full_state_dict(ema, updates=step + self.update_every - 1)
        if self.include_online_model:
            online = {k[13:]: v for k, v in state_dict.items() if k.startswith("online_model.")}
            self.model.load_state_dict(online, strict=strict)
        self._replica.changed()
