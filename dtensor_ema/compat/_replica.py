"""One mechanism for every drop-in: the full EMA that other libraries' habits read, gathered
at a point every rank reaches and kept until the EMA changes.

Every facade of :mod:`dtensor_ema.compat` holds one :class:`EmaReplica`. Its one
collective, :meth:`EmaReplica.materialize` (the facades' ``gather_for_save()``, and their
``eval()``/``materialize()`` where they have a module; every rank of the EMA's mesh calls
it), puts the full EMA where the habits read it. Where it goes depends on the layout:

* **replica** (default for plain, DDP and DeepSpeed ZeRO-3 models, whose tensors the EMA
  splits ``1/W`` per rank): :attr:`EmaReplica.module` is a structural copy of the model
  (of a ZeRO-3 model: without DeepSpeed's hooks, its parameters in their real shapes,
  gathered even on one rank, tracked or not, since the model holds only placeholders and
  partitions) whose float buffers
  ARE the engine's EMA buffers when the engine keeps them whole
  (``ModelEMA(replicate_buffers=True)``: live, so ``distribute_bn``/``update_bn`` act on
  the EMA itself), whose integer buffers are copies of the model's (refreshed by every
  update), and whose parameters (and sharded float buffers) hold **no storage** (``meta``)
  until :meth:`~EmaReplica.materialize` all-gathers the full EMA into them on every rank;
  tensors the engine does not track (``track=``) are the model's own, shared, never copied;
  a tracked-set change on the engine (``add_tensors``/``drop_tensors``) re-points the slots
  it concerns before the module is next read (:meth:`EmaReplica.follow_tracked_set`).
  They stay until :meth:`~EmaReplica.changed` (the facades call it on ``update``, ``set``
  and ``load``; ``train()`` keeps them, so ``update_bn``'s forwards in train mode run on
  them). Evaluation then runs at replica speed: no communication per batch. Peak extra
  memory while materialized: one full copy of the parameters per rank, on the model's
  device, plus one gather bucket (``DEFAULT_BUCKET_BYTES``) during the gather.
* **sharded** (FSDP2/TP models, whose ranks may not fit a full copy; or a plain model with
  the facade's ``evaluation="sharded"``): the module is the engine's
  :attr:`~dtensor_ema.ModelEMA.module` (FSDP2 over the EMA mesh: each forward all-gathers
  one unit at a time, peak about the largest unit), and ``materialize()`` gathers one full
  CPU copy to global rank 0 only (the other ranks: one bucket), for a rank-0 save.

Without a process group, or on a one-rank mesh, everything is live (the module's tensors
are the EMA's own; nothing to gather, every save works). FSDP2/TP models take the sharded
module on a one-rank mesh too (FSDP2 modules refuse ``deepcopy``, so no replica can be
built); its parameters are the EMA's own there.

The rules, the same in every facade (``docs/migration.md``, "one rule for every drop-in"):
no hidden collective (a call a library's habit makes on one rank alone reads the full
tensors only when unsharded or after a ``materialize()`` every rank reached since the last
change, else raises a ``RuntimeError`` naming ``<owner>.gather_for_save()``; it never waits
for other ranks nor returns one rank's piece), and loading full tensors on every rank
restores each rank's piece (local).

The module's hooks are module-level objects so that the module (or a ``deepcopy`` of it)
still pickles. An :class:`EmaReplica` pickles as its engine and options and rebuilds its
module around the unpickled engine (whose EMA tensors the module must share);
:class:`ReplicaFacade` does the same for the facades that register that module as a child.
The engine refuses to pickle at W > 1 (see :meth:`dtensor_ema.ModelEMA.__getstate__`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.zero_partition import drop_partition_hooks, is_partitioned, real_shape

__all__ = [
    "EmaReplica",
    "ReplicaFacade",
    "fix_message",
    "keeps_buffers_whole",
]


def keeps_buffers_whole(model: nn.Module, evaluation: str = "replica") -> bool:
    """The facades' ``replicate_buffers``: a plain/DDP model evaluated through a replica
    keeps its float buffers whole on every rank (each rank's EMA buffers are its own
    replica's, as the original libraries' are); FSDP2/TP models and ``evaluation="sharded"``
    evaluate through the engine's sharded module, which holds sharded buffers."""
    return evaluation == "replica" and not any(isinstance(p, DTensor) for p in model.parameters())


def fix_message(owner: str, also: str = "") -> str:
    """The one-line fix every refusal names (``also``: the library's own call that does the
    same, e.g. timm's ``model_ema.eval()``)."""
    alias = f" ({also} does the same)" if also else ""
    return (
        f"call `{owner}.gather_for_save()` on every rank first{alias}: one collective that "
        "gathers the full EMA, kept until the next update"
    )


class EmaReplica:
    """The full EMA for a facade's module and saves (see the module docstring).

    Args:
        engine: the facade's :class:`~dtensor_ema.ModelEMA`.
        fix: the one-line fix refusals name (:func:`fix_message`).
        sharded: evaluate through the engine's sharded module instead of a replica (forced
            for models with DTensor parameters).

    Construction is local (a ``deepcopy`` of the model's structure with storage-less
    parameters, sharing the engine's whole float buffers).
    """

    def __init__(self, engine: ModelEMA, fix: str, *, sharded: bool = False) -> None:
        self.engine = engine
        self.fix = fix
        self._sharded_option = sharded
        model = engine.model
        # DeepSpeed ZeRO-3: the EMA of a parameter is a flat range of it, never the tensor
        # in its real shape, so the replica's slots are gathered even on one rank.
        self.partitioned = any(is_partitioned(p) for p in model.parameters())
        self.live = (engine.mesh is None or engine.mesh.size() == 1) and not self.partitioned
        # DTensor models (FSDP2, TP) use the engine's module at every W, W=1 included:
        # their modules cannot be deep-copied (FSDP2 raises on ``deepcopy``).
        dtensor_model = any(isinstance(t, DTensor) for t in model.state_dict().values())
        self.sharded = dtensor_model or (sharded and not self.live)
        # A plain model evaluated through the sharded module (the ``evaluation="sharded"``
        # option): that module's ``state_dict()`` would hold one rank's pieces, so it is
        # guarded like a replica's (rule 1). An FSDP2/TP model's module keeps its DTensors,
        # as the original library's EMA of such a model does (save those with DCP).
        self._guard_pending = self.sharded and not dtensor_model
        self.version = 0
        """Bumped by :meth:`changed`: the number of changes of the EMA so far."""
        self._rank0: dict[str, torch.Tensor] | None = None  # sharded: rank 0's full copy
        self._rank0_version = -1
        self._module: nn.Module | None = None
        self._gathered: list[list[str]] = []  # names of each gathered tensor (tied: several)
        self._untracked_gathered = False  # a gathered slot holds a tensor the EMA ignores
        self._ints: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._tracked_version = -1  # the engine's tracked set the module was built for
        if not self.sharded:
            self._module = self._build(model)

    def _build(self, model: nn.Module) -> nn.Module:
        named = dict(model.state_dict(keep_vars=True))
        memo, self._gathered = self._slot_values(named)
        module = copy.deepcopy(model, memo)
        if self.partitioned:  # a plain module now: DeepSpeed's gathers would find nothing
            drop_partition_hooks(module)
        module.eval()
        object.__setattr__(module, "_dtensor_ema_fix", self.fix)  # read by the hooks
        self._ints = [
            (t, named[k]) for k, t in module.state_dict().items() if not t.is_floating_point()
        ]
        # First: a tracked-set change made on the engine since is followed before the
        # released check and before any forward or save reads the slots.
        module.register_state_dict_pre_hook(_FollowTrackedSet(self))
        module.register_forward_pre_hook(_FollowTrackedSet(self))
        module.register_state_dict_pre_hook(_refuse_released)
        module.register_forward_pre_hook(_refuse_released_forward)
        module.register_load_state_dict_pre_hook(_LoadIntoEngine(self.engine))
        return module

    def _slot_values(
        self, named: dict[str, torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], list[list[str]]]:
        """What the module holds for each of the model's tensors (by ``id``, tied ones
        once), for the engine's current tracked set, and the names of the slots
        :meth:`materialize` fills (tied: several). Local; records the tracked set."""
        ema = self.engine.ema_tensors()
        untracked = set(self.engine.untracked)
        self._tracked_version = self.engine.engine.plan.tracked_version
        self._untracked_gathered = False
        values: dict[int, torch.Tensor] = {}
        names: dict[int, list[str]] = {}
        for fqn, tensor in named.items():
            if id(tensor) in values:
                names.get(id(tensor), []).append(fqn)
                continue
            ours = ema.get(fqn)
            whole = ours is not None and (self.live or not isinstance(ours, DTensor))
            if is_partitioned(tensor):  # ZeRO-3: gathered in its real shape, tracked or not
                names[id(tensor)] = [fqn]
                self._untracked_gathered |= fqn in untracked
                values[id(tensor)] = nn.Parameter(_meta(tensor), requires_grad=False)
            elif fqn in untracked:  # not averaged (track=): the model's own, shared, no copy
                values[id(tensor)] = (
                    nn.Parameter(tensor.detach(), requires_grad=False)
                    if isinstance(tensor, nn.Parameter)
                    else tensor
                )
            elif isinstance(tensor, nn.Parameter):
                if ours is None:  # not tracked (non-float): the model's value
                    value = tensor.detach().clone()
                elif self.live:
                    value = _full_local(ours)
                else:
                    names[id(tensor)] = [fqn]
                    value = _meta(tensor)
                values[id(tensor)] = nn.Parameter(value, requires_grad=False)
            elif ours is not None and tensor.is_floating_point():
                if whole:
                    values[id(tensor)] = _full_local(ours)
                else:
                    names[id(tensor)] = [fqn]
                    values[id(tensor)] = _meta(tensor)
            else:
                values[id(tensor)] = tensor.detach().clone()
        return values, list(names.values())

    def follow_tracked_set(self) -> None:
        """After the engine's :meth:`~dtensor_ema.ModelEMA.add_tensors` /
        :meth:`~dtensor_ema.ModelEMA.drop_tensors`: re-point every float slot of the module
        by the rules of construction (newly tracked tensors take the EMA, or a storage-less
        placeholder that the next :meth:`materialize` fills; dropped ones the model's own;
        the engine's rebuilt flat buffers with ``parameters_as_bucket_view``), and drop any
        gathered copy: the EMA changed. Local; no-op (one integer compare) while the
        tracked set is the one the module was built for. Every entry point of this class,
        and the module's forward and ``state_dict()``, call it first."""
        if self._module is None or self.engine.engine.plan.tracked_version == self._tracked_version:
            return
        named = dict(self.engine.model.state_dict(keep_vars=True))
        values, self._gathered = self._slot_values(named)
        for fqn, tensor in named.items():
            if tensor.is_floating_point():
                owner, name = _owner(self._module, fqn)
                slots = owner._parameters if name in owner._parameters else owner._buffers
                slots[name] = values[id(tensor)]  # type: ignore[assignment]
        self.version += 1
        self._rank0 = None

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """The engine and options only: the module is rebuilt around the unpickled (or
        copied) engine, whose EMA tensors it must share. The engine refuses at W > 1."""
        return {"engine": self.engine, "fix": self.fix, "sharded": self._sharded_option}

    def __setstate__(self, state: dict[str, Any]) -> None:
        EmaReplica.__init__(self, state["engine"], state["fix"], sharded=state["sharded"])

    # ------------------------------------------------------------------ evaluation
    @property
    def module(self) -> nn.Module:
        """The module a facade exposes: the replica, or (sharded) the engine's module,
        built on first access (see :meth:`~dtensor_ema.ModelEMA.build_module`)."""
        if self._module is not None:
            self.follow_tracked_set()
            return self._module
        module = self.engine.module
        if self._guard_pending:  # once: the engine keeps this module
            module.register_state_dict_post_hook(_FullOnRank0(self))
            self._guard_pending = False
        return module

    @property
    def materialized(self) -> bool:
        """Whether a rank-0 save works now without a gather (see the module docstring)."""
        if self.live:
            return True
        if self._module is not None:
            return not _released(self._module)
        return self._rank0_version == self.version

    def materialize(self) -> None:
        """Gather the full EMA where the habits read it. **Collective** over the EMA's mesh
        (every rank must call it) unless live; a no-op while current.

        Replica: every rank all-gathers the full parameters into :attr:`module` (peak
        extra memory: one full copy of the parameters, kept until :meth:`changed`, plus
        one bucket). Sharded: global rank 0 receives a full CPU copy (kept until
        :meth:`changed`); the other ranks hold one bucket while it runs.
        """
        self.follow_tracked_set()
        if self.materialized:
            return
        if self._module is None:
            full = self.engine.get_ema_state_dict(
                only_rank0_receives=True, cpu_offload=True, include_untracked=True
            )
            self._rank0, self._rank0_version = (full or None), self.version
            return
        full = self.engine.get_ema_state_dict(include_untracked=self._untracked_gathered)
        for names in self._gathered:
            value = full[names[0]]
            for fqn in names:
                _set_tensor(self._module, fqn, value)

    def prepare_eval(self) -> None:
        """Before a validation pass: the replica is gathered (:meth:`materialize`,
        **collective** after a change); the sharded module needs nothing (it gathers one
        unit per forward)."""
        if self._module is not None:
            self.materialize()

    def forward_module(self) -> nn.Module:
        """The module to run, with no hidden collective: the replica (gathered by the last
        :meth:`materialize`, i.e. ``eval()``/``gather_for_save()``, that every rank reached
        since the last change, or live; its forward raises naming the fix otherwise), or
        the sharded module (collective per forward by nature, as an FSDP2 model's own)."""
        return self.module

    def release(self) -> None:
        """Free the replica's gathered tensors (evaluation is over). Local."""
        if self._module is None or self.live or _released(self._module):
            return
        for names in self._gathered:
            for fqn in names:
                _set_tensor(self._module, fqn, _meta(_get_tensor(self._module, fqn)))

    def changed(self, *, ints: bool = True) -> None:
        """The EMA moved (update, set, load): free every gathered copy and (``ints``) copy
        the model's integer buffers into the replica. Local."""
        self.follow_tracked_set()
        self.version += 1
        self._rank0 = None
        self.release()
        if ints:
            self.refresh_ints()

    def refresh_ints(self) -> None:
        """Copy the model's integer buffers (``num_batches_tracked``), as timm's update does."""
        with torch.no_grad():
            for ours, theirs in self._ints:
                ours.copy_(theirs)

    # ------------------------------------------------------------------ saves
    def full_state(self, what: str) -> dict[str, Any]:
        """The full EMA state dict keyed like the model, for a save one rank makes (whole:
        tensors the engine does not track come from the model). Local.

        Raises:
            RuntimeError: sharded and not materialized on this rank since the last change
                (the message names ``what`` and the fix).
        """
        self.follow_tracked_set()
        if self.live:
            return self.engine.get_ema_state_dict(include_untracked=True)
        if self._module is not None and not _released(self._module):
            return self._module.state_dict()
        if self._module is None and self._rank0 is not None and self.materialized:
            return self._rank0
        world = self.engine.mesh.size() if self.engine.mesh is not None else 1
        raise RuntimeError(
            f"{what} on a sharded EMA (each of the {world} ranks holds 1/{world} of every "
            f"tensor) would save one rank's piece. Fix: {self.fix}"
        )


class ReplicaFacade(nn.Module):
    """What the module drop-ins (timm, torch ``swa_utils``, ema-pytorch) share: their
    :class:`~dtensor_ema.ModelEMA` (:attr:`engine`) and its :class:`EmaReplica`, whose module
    is registered as the library's child (:attr:`MODULE`), the verbs that gather it, the
    forward on it, and pickling. ``materialize()``, ``gather_for_save()`` and ``eval()`` are
    **collective** over the EMA's mesh (every rank); the rest is local."""

    MODULE = "module"
    """The child name the library gives its copy (ema-pytorch: ``ema_model``)."""
    ALWAYS_REGISTERED = False
    """Register the sharded module as the child too (timm's ``.module`` always exists)."""

    @staticmethod
    def check_evaluation(evaluation: str) -> None:
        """Refuse an ``evaluation=`` other than ``"replica"`` or ``"sharded"``."""
        if evaluation not in ("replica", "sharded"):
            raise ValueError(f"evaluation must be 'replica' or 'sharded', got {evaluation!r}")

    def attach(self, engine: ModelEMA, fix: str, evaluation: str) -> None:
        """Hold ``engine`` and its replica (``fix``: :func:`fix_message`)."""
        self._engine, self.evaluation = engine, evaluation
        self._replica = EmaReplica(engine, fix, sharded=evaluation == "sharded")
        self._register()

    def _register(self) -> None:
        if self.ALWAYS_REGISTERED or not self._replica.sharded:
            self._modules[self.MODULE] = self._replica.module

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/deepcopy: everything but the replica's module, which the replica rebuilds
        on load around the unpickled engine (the engine refuses at W > 1, naming what to
        save instead)."""
        state = self.__dict__.copy()
        state["_modules"] = {k: v for k, v in state["_modules"].items() if k != self.MODULE}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._register()

    @property
    def engine(self) -> ModelEMA:
        """The sharded :class:`~dtensor_ema.ModelEMA` doing the work."""
        return self._engine

    def _change(self, apply: Callable[[], None]) -> None:
        """Run ``apply`` (a change of the EMA) with the gathered copy released first: it is
        stale from there on."""
        self._replica.release()
        apply()
        self._replica.changed()

    def materialize(self) -> None:
        """Gather the full EMA on every rank until the next update (replica), or to rank
        0's CPU (sharded). **Collective** (every rank). Peak: one full copy of the
        parameters per rank (sharded: one full CPU copy on rank 0 only)."""
        self._replica.materialize()

    def gather_for_save(self) -> None:
        """**Collective** (every rank) before rank 0 alone saves the library's state dict
        (``eval()`` does it too): the same as :meth:`materialize`."""
        self._replica.materialize()

    def train(self, mode: bool = True) -> Any:
        """``eval()`` gathers the replica (**collective**); ``train()`` is local and keeps it
        until the next update (a forward in train mode, e.g. ``update_bn``'s, runs on it)."""
        if not mode:
            self._replica.prepare_eval()
        if self._replica.sharded:
            self._replica.module.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The average's forward. Local (replica): after an update, on the copy gathered by
        ``eval()``/``gather_for_save()`` on every rank, else raises naming that fix;
        **collective** on every call with the sharded module, as an FSDP2 model's forward."""
        return self._replica.forward_module()(*args, **kwargs)


def _full_local(tensor: torch.Tensor) -> torch.Tensor:
    """The whole EMA tensor on this rank without a copy: plain, or a one-rank DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    """A storage-less stand-in of ``tensor`` in its real shape (ZeRO-3: ``ds_shape``)."""
    shape = real_shape(tensor) if is_partitioned(tensor) else tensor.shape
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return (root.get_submodule(path) if path else root), name


def _get_tensor(root: nn.Module, fqn: str) -> torch.Tensor:
    owner, name = _owner(root, fqn)
    value = getattr(owner, name)
    assert isinstance(value, torch.Tensor)
    return value


def _set_tensor(root: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner, name = _owner(root, fqn)
    if name in owner._parameters:
        setattr(owner, name, nn.Parameter(value, requires_grad=False))
    else:
        setattr(owner, name, value)


def _released(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


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


_DEFAULT_FIX = "call gather_for_save() on the EMA on every rank first"


class _FollowTrackedSet:
    """Forward and state-dict pre-hook of the replica: :meth:`EmaReplica.follow_tracked_set`
    before the module is read. A copy or a pickle of the module loses the binding (it is no
    longer the EMA's replica), as :class:`_LoadIntoEngine` does."""

    def __init__(self, replica: EmaReplica | None) -> None:
        self.replica = replica

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if self.replica is not None:
            self.replica.follow_tracked_set()

    def __deepcopy__(self, memo: dict[int, Any]) -> _FollowTrackedSet:
        return _FollowTrackedSet(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FollowTrackedSet, (None,))


class _FullOnRank0:
    """State-dict post-hook of the sharded module when it stands in for a replica: the
    full EMA where :meth:`EmaReplica.full_state` has it (rank 0 after ``materialize()``),
    else the refusal naming the fix; never one rank's pieces. Local."""

    def __init__(self, replica: EmaReplica) -> None:
        self.replica = replica

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        full = self.replica.full_state("module.state_dict()")
        for key in list(state_dict):
            name = key[len(prefix) :]
            if key.startswith(prefix) and name in full:
                state_dict[key] = full[name]


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
        # Released tensors get storage, so the load that follows fills them: the module
        # then holds the loaded weights (one full copy) until the next update.
        named: list[tuple[str, torch.Tensor]] = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        for fqn, tensor in named:
            if tensor.is_meta and fqn in ours:
                _set_tensor(module, fqn, torch.empty_like(tensor, device=ours[fqn].device))

    def __deepcopy__(self, memo: dict[int, Any]) -> _LoadIntoEngine:
        return _LoadIntoEngine(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_LoadIntoEngine, (None,))
