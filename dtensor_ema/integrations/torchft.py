"""Live recovery with torchft: a restarted replica group gets its EMA back from a peer::

    optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.AdamW(...))
    ema = ModelEMA(model, mesh)            # sharded over the replica group
    register_ema(manager, ema, optimizer)  # on every rank of every group

:func:`register_ema` registers ``ema`` with the group's ``torchft.Manager`` (a recovering
rank receives the shards, count and options of the peer with its group rank, checked by
``ema.load_state_dict``), updates it only on committed steps (a post-hook on the optimizer
torchft's ``OptimizerWrapper`` steps, checking that the committed-step count moved: a
skipped step updates nothing, a hook that runs twice updates once), and serves a committed
EMA to torchft's async quorum thread (:meth:`FaultTolerantEMA.state_dict`). Per-step fault
tolerance only: with LocalSGD/DiLoCo the manager commits once per synchronization (not
supported). Requires ``torchft``; imported only to recognise ``OptimizerWrapper``. The
guide: ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from dtensor_ema.state import tag_rank, wrapped_like

__all__ = ["FaultTolerantEMA", "register_ema"]


class _Manager(Protocol):
    """What this module uses of ``torchft.Manager``."""

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...

    def current_step(self) -> int: ...


class FaultTolerantEMA:
    """An EMA registered with a ``torchft.Manager`` (made by :func:`register_ema`, which
    checks the arguments and registers it; the constructor itself registers nothing).

    Args:
        update: what one committed step does (``ema.update`` for an EMA); ``manager``,
            ``ema`` and ``key`` as for :func:`register_ema`.

    Attributes:
        manager: the replica group's ``torchft.Manager`` (this rank's).
        ema: the EMA: a :class:`~dtensor_ema.ModelEMA`, a :class:`~dtensor_ema.MultiModelEMA`,
            or any object with ``state_dict()`` and ``load_state_dict()`` (a
            :class:`~dtensor_ema.integrations.torchtitan.TorchtitanEMA`, with ``update=``).
        key: the key of the EMA in the manager's state (and in what a peer sends).
    """

    def __init__(
        self,
        manager: _Manager,
        ema: Any,
        update: Callable[[], object],
        *,
        key: str,
    ) -> None:
        self.manager = manager
        self.ema = ema
        self.key = key
        self._update = update
        self._lock = threading.Lock()
        self._seen = manager.current_step()

    def update(self) -> bool:
        """Update the EMA if the manager committed a step since the last update. Local: no
        communication.

        Called by the step post-hook :func:`register_ema` installs; call it yourself after
        ``optimizer.step()`` when you registered without an optimizer. Holds the lock that
        :meth:`state_dict` takes, so the quorum thread never copies a half-updated EMA.
        Peak extra memory: that of the update itself (``ema.update()``: none for a
        ``ModelEMA`` updated inline).

        Returns:
            Whether the EMA was updated: ``False`` when ``manager.current_step()`` did not
            move since the last update (the step was not committed, or this step's update
            already ran).
        """
        with self._lock:
            step = self.manager.current_step()
            if step == self._seen:
                return False
            self._update()
            self._seen = step
        return True

    def state_dict(self) -> dict[str, Any]:
        """The committed EMA a recovering peer receives: a copy of ``ema.state_dict()``.

        torchft calls it only when a peer recovers from this rank, from its quorum thread,
        while the main thread trains (async quorum) or before it trains (sync quorum). It
        takes the lock :meth:`update` holds, so the state is never the middle of an
        update, and returns copies, so what the transport sends (the HTTP transport
        serializes when the peer asks, and on CPU keeps the tensors it was given) stays the
        EMA of the last committed step while the training goes on. On an accelerator the
        device is synchronized before and after the copy (the last update's kernels are
        done; the copies are done before the transport's own stream reads them): this
        waits in the quorum thread, not in the training loop.

        Local: no collective (the transport then sends it to the peer with the same group
        rank). Peak extra memory: one copy of this rank's EMA shards (``1/W`` of the
        tracked float bytes per EMA, on the EMA's device), made only when a peer recovers;
        freed when the transport lets go of it (the process-group transport after
        sending; the HTTP transport on an accelerator after its host copy, on CPU when the
        next recovery replaces it).
        """
        with self._lock:
            state = self.ema.state_dict()
            _synchronize(state)
            snapshot = _copied(state)
            _synchronize(snapshot)
        return snapshot

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the EMA a peer sent (``ema.load_state_dict``: checked before anything is
        written), then count the manager's current step as updated. Local.

        torchft calls it from the training thread (``should_commit`` with the async quorum,
        ``start_quorum`` with the sync one) after it set the manager's step to the peer's,
        so the next committed step updates the EMA, as it does on the peer.
        """
        with self._lock:
            self.ema.load_state_dict(state)
            self._seen = self.manager.current_step()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, {type(self.ema).__name__}, "
            f"last update at committed step {self._seen})"
        )


def register_ema(
    manager: _Manager,
    ema: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    key: str = "ema",
    update: Callable[[], object] | None = None,
) -> FaultTolerantEMA:
    """Register ``ema`` with a ``torchft.Manager`` and update it on committed steps.

    Call it on every rank of every replica group, after building the EMA and the
    optimizer, before the first step (the registration is local: each rank registers with
    its own manager). Nothing is registered when an argument is refused. Peak extra memory:
    none; serving a recovering peer costs one copy of this rank's EMA shards (see
    :meth:`FaultTolerantEMA.state_dict`).

    Args:
        manager: this rank's ``torchft.Manager``.
        ema: a :class:`~dtensor_ema.ModelEMA` or :class:`~dtensor_ema.MultiModelEMA` (or an
            object with ``state_dict()``/``load_state_dict()`` and ``update=``), sharded
            over the replica group (its mesh is the group's, never the replica dimension
            torchft manages).
        optimizer: where to hook the update: a ``torchft.optim.OptimizerWrapper`` (the
            hook goes on the optimizer it wraps, which steps only on committed steps), or
            a ``torch.optim.Optimizer`` (torchtitan's torchft optimizer container, or the
            optimizer an ``OptimizerWrapper`` wraps). ``None``: call
            :meth:`FaultTolerantEMA.update` yourself after each ``optimizer.step()``.
        key: the key under which the manager serves the EMA; it must be free.
        update: what one committed step does (default ``ema.update``); e.g.
            ``lambda: titan_ema.step(trainer.step)`` for a ``TorchtitanEMA``.

    Returns:
        The :class:`FaultTolerantEMA` the manager calls.

    Raises:
        TypeError: ``manager`` lacks ``register_state_dict_fn``/``current_step``, ``ema``
            lacks ``state_dict``/``load_state_dict`` (or ``update`` without ``update=``),
            or ``optimizer`` is neither an ``OptimizerWrapper`` nor a ``torch.optim``
            optimizer.
        ValueError: ``key`` is already registered with the manager.
    """
    for name in ("register_state_dict_fn", "current_step"):
        if not callable(getattr(manager, name, None)):
            raise TypeError(f"manager must be a torchft.Manager (no {name}()): got {manager!r}")
    for name in ("state_dict", "load_state_dict"):
        if not callable(getattr(ema, name, None)):
            raise TypeError(f"ema must have {name}(): got a {type(ema).__name__}")
    if update is None:
        update = getattr(ema, "update", None)
        if not callable(update):
            raise TypeError(
                f"a {type(ema).__name__} has no update(): pass update=, the call that "
                "advances it by one committed step"
            )
    target = _hook_target(optimizer)
    handle = FaultTolerantEMA(manager, ema, update, key=key)
    try:
        manager.register_state_dict_fn(key, handle.load_state_dict, handle.state_dict)
    except AssertionError:  # torchft 0.2.0 asserts that a key is new
        raise ValueError(
            f"key {key!r} is already registered with this manager: pass another key="
        ) from None
    if target is not None:

        def update_on_commit(*_: object) -> None:
            handle.update()

        target.register_step_post_hook(update_on_commit)
    return handle


def _hook_target(optimizer: object) -> torch.optim.Optimizer | None:
    """The optimizer whose step post-hook updates the EMA: the one an ``OptimizerWrapper``
    wraps (the wrapper itself runs no hooks: it never calls ``Optimizer.__init__``)."""
    if optimizer is None:
        return None
    try:
        from torchft.optim import OptimizerWrapper
    except ImportError:  # without torchft there is no wrapper to look through
        pass
    else:
        if isinstance(optimizer, OptimizerWrapper):
            optimizer = optimizer.optim
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torchft.optim.OptimizerWrapper or a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    return optimizer


def _copied(value: Any) -> Any:
    """``value`` with every tensor replaced by a detached copy (DTensors keep their mesh,
    placements, shape and the saving rank's tag); dicts, lists and tuples rebuilt."""
    if isinstance(value, DTensor):
        copy = wrapped_like(value, value.to_local().detach().clone())
        tag_rank(copy)
        return copy
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _synchronize(value: Any) -> None:
    """Wait for every accelerator that holds a tensor of ``value`` (nothing on CPU)."""
    devices: set[torch.device] = set()
    _devices(value, devices)
    for device in devices:
        module = getattr(torch, device.type, None)
        if device.type != "cpu" and module is not None and hasattr(module, "synchronize"):
            module.synchronize(device)


def _devices(value: Any, out: set[torch.device]) -> None:
    if isinstance(value, torch.Tensor):
        out.add(value.device)
    elif isinstance(value, Mapping):
        for v in value.values():
            _devices(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _devices(v, out)
