"""diffusers' ``EMAModel``, sharded: ``from dtensor_ema.compat.diffusers import EMAModel``.

Same constructor (from a parameter iterator), ``step``, ``copy_to``, ``store``,
``restore``, ``state_dict``/``load_state_dict``, ``save_pretrained``/``from_pretrained``,
and the same numbers bit for bit (``tests/test_compat.py``): :class:`~dtensor_ema.ModelEMA`
with :class:`~dtensor_ema.decay.DiffusersDecay` (or, with ``use_ema_warmup``,
:class:`~dtensor_ema.WarmupDecay`) and ``formula="subtract"`` (``foreach=True``:
``"subtract_alpha"``). Parameters with ``requires_grad=False`` at construction are copied.
DTensor parameters keep their mesh and placements; plain ones are taken as replicated over
the default group (DDP) and sharded over it; pass ``model=`` for FSDP2 models. The EMA holds
only the parameters given (a LoRA run's adapters: ``1/W`` of their bytes per rank).

diffusers' scripts call ``store``, ``copy_to``, ``state_dict()`` and ``save_pretrained()``
on the main process alone; none is a collective here (:mod:`dtensor_ema.compat._replica`):
with more than one rank they read the full EMA gathered by ``ema.gather_for_save()`` on
every rank since the last ``step`` (**collective**; plain/DDP parameters: one full copy per
rank until the next ``step``; DTensor parameters: one full CPU copy on rank 0, and
``copy_to`` writes each rank's own pieces), and raise naming that fix otherwise. Under
DeepSpeed ZeRO-3 ``step`` averages each rank's own partition; ``copy_to``/``restore`` into
the partitions raise, naming ``ema.engine.average_parameters()``. Pickling works without a
process group and raises at W > 1. The guide, with what differs:
``docs/migration-diffusers.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema.compat._replica import EmaReplica, fix_message
from dtensor_ema.decay import DiffusersDecay, WarmupDecay
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.plan import reshard_fsdp
from dtensor_ema.zero_partition import is_partitioned

__all__ = ["EMAModel"]

_HYPER = ("decay", "min_decay", "update_after_step", "use_ema_warmup", "inv_gamma", "power")


def _refuse_zero3(method: str, params: Sequence[torch.Tensor]) -> None:
    """DeepSpeed ZeRO-3 parameters are ``(0,)`` placeholders over partitions that live on
    every rank, which only DeepSpeed's own (collective) forward gathers: writing full
    weights into them (diffusers' ``param.data.copy_``) cannot work, on the main process or
    anywhere. Raise, naming what does. Local."""
    zero3 = [i for i, p in enumerate(params) if is_partitioned(p)]
    if zero3:
        raise RuntimeError(
            f"EMAModel.{method}: parameters {zero3[:3]} are DeepSpeed ZeRO-3 partitions "
            "(placeholders between DeepSpeed's gathers), which no full tensor can be written "
            "into. To validate with the EMA, on every rank: `with ema_model.engine."
            "average_parameters(): ...` (the EMA goes into the partitions, the raw weights "
            "come back after); for full weights: `ema_model.gather_for_save()` on every "
            "rank, then `state_dict()` / `save_pretrained()`"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_layout(ema: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether this rank's EMA piece is the parameter's whole local piece."""
    return (
        isinstance(ema, DTensor)
        and isinstance(param, DTensor)
        and ema.device_mesh == param.device_mesh
        and tuple(ema.placements) == tuple(param.placements)
    )


class EMAModel:
    """diffusers' ``EMAModel`` with each rank holding ``1/W`` of the average.

    Construction is collective where :class:`~dtensor_ema.ModelEMA`'s is (every rank);
    ``gather_for_save()`` is collective over the EMA's mesh (every rank); everything else
    is local: ``step``, ``store``/``restore``, and ``copy_to``/``state_dict``/
    ``save_pretrained``, which work on the main process alone after a ``gather_for_save()``
    that every rank reached since the last ``step`` (see the module docstring).
    """

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter] | nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        foreach: bool = False,
        model_cls: Any | None = None,
        model_config: dict[str, Any] | None = None,
        *,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(parameters, nn.Module):  # diffusers' deprecated form turns warmup on
            model, parameters, use_ema_warmup = parameters, parameters.parameters(), True
        if model is not None:
            reshard_fsdp(model)  # the sharded parameters, even after a no-grad forward
        decay = kwargs.pop("max_value", None) or decay
        min_decay = kwargs.pop("min_value", None) or min_decay
        params = list(parameters)  # read after the reshard (a generator is lazy)
        if model is not None:
            # The caller's list is kept (a LoRA run passes the adapters only); each must be
            # one of the module's current (sharded) parameters.
            current = {id(p) for p in model.parameters()}
            stale = [i for i, p in enumerate(params) if id(p) not in current]
            if stale:
                raise ValueError(
                    f"parameters {stale[:5]} are not parameters of model= "
                    f"{type(model).__name__} (after resharding its FSDP2 units): pass the "
                    "module's own parameter objects, e.g. [p for p in model.parameters() if "
                    "p.requires_grad], built after the model is sharded"
                )
        self._params = nn.ParameterList(params)  # registers the same objects: no copy
        frozen = {str(i) for i, p in enumerate(params) if not p.requires_grad}
        self.decay, self.min_decay, self.update_after_step = decay, min_decay, update_after_step
        self.use_ema_warmup, self.inv_gamma, self.power = use_ema_warmup, inv_gamma, power
        self.foreach, self.model_cls, self.model_config = foreach, model_cls, model_config
        schedule = (
            WarmupDecay(decay=decay, gamma=inv_gamma, power=power, min_decay=min_decay)
            if use_ema_warmup
            else DiffusersDecay(decay=decay, min_decay=min_decay)
        )
        self._engine = ModelEMA(
            self._params,
            schedule=schedule,
            update_after_step=update_after_step,
            formula="subtract_alpha" if foreach else "subtract",
            exclude=frozen or None,
            **kwargs,
        )
        self._replica = EmaReplica(self._engine, fix_message("ema_model"))
        self.temp_stored_params: list[torch.Tensor] | None = None
        self._private = False  # from_pretrained: parameters nobody else can change

    def __deepcopy__(self, memo: dict[int, Any]) -> EMAModel:
        """A copy with its own EMA that steps from the same parameters, as a copy of
        diffusers' ``EMAModel`` (which holds no model) does. Local; refused at W > 1 by the
        engine (naming what to save instead). ``pickle``/``torch.save`` instead carry the
        parameters along: the unpickled ``EMAModel`` tracks its own copies of them
        (``state_dict``, ``shadow_params``, ``copy_to`` work; ``step`` takes those)."""
        for param in self._params:
            memo[id(param)] = param
        copied = EMAModel.__new__(EMAModel)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied

    @property
    def engine(self) -> ModelEMA:
        """The :class:`~dtensor_ema.ModelEMA` doing the work."""
        return self._engine

    @property
    def optimization_step(self) -> int:
        return self._engine.updates

    @property
    def cur_decay_value(self) -> float | None:
        return self._engine.last_decay

    @property
    def shadow_params(self) -> list[torch.Tensor]:
        """The EMA tensors in parameter order (DTensors holding this rank's piece)."""
        tensors = self._engine.ema_tensors()
        return [tensors[str(i)] for i in range(len(self._params))]

    def get_decay(self, optimization_step: int) -> float:
        return self._engine.get_decay(optimization_step)

    def step(self, parameters: Iterable[torch.nn.Parameter] | nn.Module) -> None:
        """One update. Local: no communication. ``parameters`` must be the tracked ones."""
        given = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        if len(given) != len(self._params) or any(
            a is not b for a, b in zip(given, self._params, strict=True)
        ):
            raise ValueError("step() got other parameters than the ones this EMAModel tracks")
        self._replica.release()
        self._engine.update()
        self._replica.changed()

    def copy_to(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Write the EMA into ``parameters`` (the tracked ones, or a fresh model's, by order).

        Local, never a hidden collective, so diffusers' habit of calling it on the main
        process alone works: plain/DDP parameters take the full EMA gathered by the last
        ``gather_for_save()`` that every rank reached since the last ``step`` (or the live
        EMA, unsharded); without one it raises a ``RuntimeError`` naming that fix. The
        tracked DTensor (FSDP2/TP) parameters take this rank's own EMA pieces, when the EMA
        splits them no further (HSDP's replicate dim and TP-replicated weights need the
        other replicas' rows: raises, naming the collective alternative).
        """
        params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        _refuse_zero3("copy_to", params)
        tracked = len(params) == len(self._params) and all(
            a is b for a, b in zip(params, self._params, strict=True)
        )
        if tracked and self._replica.sharded:
            self._copy_local_pieces()
            return
        what = "the tracked parameters" if tracked else "other parameters"
        full = self._replica.full_state(f"EMAModel.copy_to({what})")
        with torch.no_grad():
            for i, param in enumerate(params):
                param.data.copy_(full[str(i)].to(param.device))

    def _copy_local_pieces(self) -> None:
        """DTensor parameters: each rank writes its own pieces, where the EMA holds them
        whole (the parameter's mesh and placements; everything on one rank). Local."""
        ema = self._engine.ema_tensors()
        split = [k for k, t in ema.items() if not _same_layout(t, self._params[int(k)])]
        if split and not self._replica.live:
            raise RuntimeError(
                f"EMAModel.copy_to(the tracked parameters): the EMA splits parameters {split[:3]} "
                "further across their replicas (HSDP's replicate dim, TP-replicated weights), "
                "so writing them needs the other replicas' rows, a collective a main-process "
                "block cannot run. On every rank, use `with ema_model.engine."
                "average_parameters(): ...` to evaluate, or save with DCP "
                "(dtensor_ema.save_checkpoint)"
            )
        with torch.no_grad():
            for k, t in ema.items():
                _local(self._params[int(k)]).copy_(_local(t))

    def store(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Keep a CPU copy of ``parameters`` (diffusers' habit: before ``copy_to`` for a
        validation pass). Local."""
        self.temp_stored_params = [p.detach().cpu().clone() for p in parameters]

    def restore(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Write the stored copy back into ``parameters``. Local."""
        if self.temp_stored_params is None:
            raise RuntimeError(
                "This ExponentialMovingAverage has no `store()`ed weights to `restore()`"
            )
        params = list(parameters)
        _refuse_zero3("restore", params)
        with torch.no_grad():
            for stored, param in zip(self.temp_stored_params, params, strict=False):
                param.data.copy_(stored.data)
        self.temp_stored_params = None

    def to(self, device: Any = None, dtype: Any = None, non_blocking: bool = False) -> None:
        first = self._params[0]
        if (device is not None and torch.device(device) != first.device) or dtype is not None:
            raise ValueError("the sharded EMA stays on the model's device and dtype")

    def pin_memory(self) -> None:
        raise NotImplementedError("use ModelEMA(offload=True) to keep the shards in host memory")

    def gather_for_save(self) -> None:
        """**Collective** (every rank) before a rank-0 ``state_dict()``/``save_pretrained``:
        the full EMA stays until the next ``step`` (plain/DDP: on every rank, one full copy;
        DTensor parameters: on rank 0's CPU)."""
        self._replica.materialize()

    def state_dict(self) -> dict[str, Any]:
        """diffusers' dict with full ``shadow_params``. Local (see ``gather_for_save``)."""
        if self._private and self._replica.version == 0:  # the EMA is the loaded model
            full = {str(i): p.detach().clone() for i, p in enumerate(self._params)}
        else:
            full = self._replica.full_state("EMAModel.state_dict()")
        out: dict[str, Any] = {k: getattr(self, k) for k in _HYPER}
        out["optimization_step"] = self.optimization_step
        return out | {"shadow_params": [full[str(i)] for i in range(len(self._params))]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every rank loads the same full tensors and keeps its piece. Local."""
        state_dict = copy.deepcopy(state_dict)
        other = {
            k: state_dict[k]
            for k in _HYPER
            if k in state_dict and state_dict[k] != getattr(self, k)
        }
        if other:
            raise ValueError(f"checkpoint hyper-parameters {other} differ from this EMAModel's")
        step = state_dict.get("optimization_step", self.optimization_step)
        shadow = state_dict.get("shadow_params")
        if shadow is None:
            self._engine.updates = step
        else:
            self._engine.load_full_state_dict(
                {str(i): t for i, t in enumerate(shadow)}, updates=step
            )
        self._replica.changed()

    def save_pretrained(self, path: str) -> None:
        """As diffusers; on rank 0 alone needs ``gather_for_save()`` first when sharded."""
        if self.model_cls is None or self.model_config is None:
            raise ValueError("`save_pretrained` needs `model_cls` and `model_config` at __init__.")
        model = self.model_cls.from_config(self.model_config)
        state = self.state_dict()
        state.pop("shadow_params", None)
        model.register_to_config(**state)
        self.copy_to(model.parameters())
        model.save_pretrained(path)

    @classmethod
    def from_pretrained(cls, path: str, model_cls: Any, foreach: bool = False) -> EMAModel:
        """Every rank loads the saved model; the EMA starts from it with the saved counter."""
        _, ema_kwargs = model_cls.from_config(path, return_unused_kwargs=True)
        model = model_cls.from_pretrained(path)
        hyper = {k: ema_kwargs[k] for k in _HYPER if k in ema_kwargs}
        ema = cls(
            model.parameters(),
            model_cls=model_cls,
            model_config=model.config,
            foreach=foreach,
            **hyper,
        )
        ema._engine.updates = ema_kwargs.get("optimization_step", 0)
        ema._private = not any(isinstance(p, DTensor) for p in ema._params)
        return ema
