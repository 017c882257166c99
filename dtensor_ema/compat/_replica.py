"""The EMA seen as the replicated module other libraries keep (``timm``'s ``.module``,
ultralytics' ``.ema``), without keeping the replica between evaluations.

``EmaReplica.module`` is a structural copy of the model whose

* float buffers ARE the engine's EMA buffers (``ModelEMA(replicate_buffers=True)``): whole
  on every rank, live, so ``distribute_bn``-style reductions change the EMA itself;
* integer buffers are copies of the model's, refreshed by each ``update()``;
* parameters hold **no storage** (``meta``) between evaluations. :meth:`EmaReplica.
  materialize` (collective) all-gathers the full EMA parameters into them once; they stay
  until the next :meth:`EmaReplica.release` (the facades release on ``update()``,
  ``set()`` and ``train()``). Peak memory while materialized: one full copy of the model's
  parameters per rank, plus one gather bucket.

Without a process group, or on a one-rank mesh, the parameters are the EMA tensors
themselves (always current, nothing to gather).

A state dict or forward of the module while its parameters are released raises a
``RuntimeError`` naming the fix, instead of saving or computing with missing weights: the
rank-0 save habit (``torch.save(ema_module.state_dict())`` on rank 0 alone) works after a
materialization every rank reached, and refuses loudly otherwise. Loading full tensors into
the module (``module.load_state_dict(sd)`` on every rank) restores each rank's piece of
the engine. The hooks are module-level objects so that the module (or a ``deepcopy`` of
it) still pickles.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema.model_ema import ModelEMA

__all__ = ["EmaReplica"]


class EmaReplica:
    """The engine's EMA as a module with the model's structure (see the module docstring)."""

    def __init__(self, engine: ModelEMA, fix: str) -> None:
        self.engine = engine
        self.fix = fix
        model = engine.model
        ema = engine.ema_tensors()
        named = dict(model.state_dict(keep_vars=True))
        self.live = engine.mesh is None or engine.mesh.size() == 1
        memo: dict[int, Any] = {}
        self._param_fqns: list[str] = []
        for fqn, tensor in named.items():
            if id(tensor) in memo:
                if isinstance(tensor, nn.Parameter):
                    self._param_fqns.append(fqn)
                continue
            if isinstance(tensor, nn.Parameter):
                self._param_fqns.append(fqn)
                value = _full_local(ema[fqn]) if self.live else _meta_like(tensor)
                memo[id(tensor)] = nn.Parameter(value, requires_grad=False)
            elif tensor.is_floating_point():
                memo[id(tensor)] = _full_local(ema[fqn])
            else:
                memo[id(tensor)] = tensor.detach().clone()
        self.module: nn.Module = copy.deepcopy(model, memo)
        self.module.eval()
        object.__setattr__(self.module, "_dtensor_ema_fix", fix)  # read by the hooks
        self._ints = [
            (t, named[k]) for k, t in self.module.state_dict().items() if not t.is_floating_point()
        ]
        self._meta = {k: _meta_like(named[k]) for k in self._param_fqns}
        self.module.register_state_dict_pre_hook(_refuse_released)
        self.module.register_forward_pre_hook(_refuse_released_forward)
        self.module.register_load_state_dict_pre_hook(_LoadIntoEngine(engine))

    @property
    def materialized(self) -> bool:
        """Whether the module's parameters hold the current EMA (no storage otherwise)."""
        return not _released(self.module)

    def materialize(self) -> None:
        """Gather the full EMA parameters into :attr:`module`. **Collective** over the EMA's
        mesh (every rank must call it) unless live; a no-op while already materialized.
        Peak extra memory: one full copy of the parameters (kept) plus one gather bucket."""
        if self.live or self.materialized:
            return
        full = self.engine.get_ema_state_dict()
        for fqn in self._param_fqns:
            _set_parameter(self.module, fqn, nn.Parameter(full[fqn], requires_grad=False))

    def release(self) -> None:
        """Free the gathered parameters (they no longer match the EMA). Local."""
        if self.live or not self.materialized:
            return
        for fqn in self._param_fqns:
            _set_parameter(self.module, fqn, nn.Parameter(self._meta[fqn], requires_grad=False))

    def refresh_ints(self) -> None:
        """Copy the model's integer buffers (``num_batches_tracked``), as timm's update does."""
        with torch.no_grad():
            for ours, theirs in self._ints:
                ours.copy_(theirs)

    def refuse_if_released(self) -> None:
        if _released(self.module):
            raise RuntimeError(_message(self.fix))


def _full_local(tensor: torch.Tensor) -> torch.Tensor:
    """The whole EMA tensor on this rank without a copy: plain, or a one-rank DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    shape = tensor.shape
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def _set_parameter(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    path, _, name = fqn.rpartition(".")
    owner = root.get_submodule(path) if path else root
    setattr(owner, name, value)


def _released(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _message(fix: str) -> str:
    return (
        "the EMA weights are sharded across ranks and were not gathered since the last "
        f"update, so this module holds no parameters to save or run: {fix}"
    )


def _refuse_released(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if _released(module):
        raise RuntimeError(_message(getattr(module, "_dtensor_ema_fix", _DEFAULT_FIX)))


def _refuse_released_forward(module: nn.Module, args: Any) -> None:
    _refuse_released(module, "", False)


_DEFAULT_FIX = "call materialize() on the EMA on every rank first"


class _LoadIntoEngine:
    """Load pre-hook: full tensors loaded into the module go into the engine too (each rank
    keeps its piece); validated by the engine before anything is written. A copy or a
    pickle of the module loses the binding (it is no longer the EMA)."""

    def __init__(self, engine: ModelEMA | None) -> None:
        self.engine = engine

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if self.engine is None:
            return
        ours = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        self.engine.load_full_state_dict(ours)
        # Released parameters get storage, so the load that follows fills them: the module
        # then holds the loaded weights (one full copy) until the next update.
        for fqn, param in list(module.named_parameters()):
            if param.is_meta and fqn in ours:
                value = torch.empty_like(param, device=ours[fqn].device)
                _set_parameter(module, fqn, nn.Parameter(value, requires_grad=False))

    def __deepcopy__(self, memo: dict[int, Any]) -> _LoadIntoEngine:
        return _LoadIntoEngine(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_LoadIntoEngine, (None,))
