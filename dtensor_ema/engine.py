"""The machinery behind :class:`~dtensor_ema.ModelEMA`: one owner for the EMA's state.

:class:`EmaEngine` is built from the user's model, mesh and one
:class:`~dtensor_ema.options.EmaOptions`, and owns everything an update touches:

* the plan (:mod:`dtensor_ema.plan`: the model-to-EMA binding over the world mesh, the
  tracked set),
* the counter (:mod:`dtensor_ema.update.counter`: how many calls, which decay),
* the update groups (:mod:`dtensor_ema.update.fused_update`: cached local views per kernel
  call),
* the updater (:mod:`dtensor_ema.update.updater`, :mod:`dtensor_ema.update.cuda_graph`: who
  applies a step, and when), chosen in one place, :func:`make_updater`,
* changes of the tracked set (the plan decides which tracked tensors are copied),
* whether the EMA is swapped into the model (nothing may update it then), and the EMA
  module built over it (:mod:`dtensor_ema.materialize.ema_module`).

:class:`~dtensor_ema.ModelEMA` keeps the user-facing verbs and delegates here;
:class:`~dtensor_ema.MultiModelEMA`, the drop-ins, the trainer integrations and the PEFT
export use this class's public surface (``ema.engine``), never ``ModelEMA``'s internals.

The data flow, from the model to the kernels and the readers of :attr:`EmaEngine.plan`:
``docs/architecture.md``, "The flow".
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema.layout import ema_local_from_full
from dtensor_ema.materialize.ema_module import UnitSpec, build_ema_module, refuse_unmirrored_options
from dtensor_ema.materialize.swap import swapped_in
from dtensor_ema.materialize.twin import guard_untracked_loads
from dtensor_ema.options import EmaOptions
from dtensor_ema.plan import EmaPlan, build_plan, unwrap_model
from dtensor_ema.update import updater as updaters
from dtensor_ema.update.counter import UpdateCounter, check_count
from dtensor_ema.update.cuda_graph import (
    CAPTURE_FAILED,
    GraphDecision,
    GraphedStep,
    GraphedUpdater,
    GraphRequest,
    log_decision,
    resolve,
)
from dtensor_ema.update.fused_update import UpdateGroup, update_groups
from dtensor_ema.update.updater import Updater

__all__ = ["EmaEngine", "make_updater", "set_grad_mode"]

# torch.no_grad() costs ~1.5 us a call (3 objects); the C switch it wraps is private.
set_grad_mode = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)
"""``set_grad_mode(enabled)``: grad mode switched with no context object (per-step paths)."""


def make_updater(
    groups: list[UpdateGroup],
    *,
    capturable: bool,
    offload: bool,
    graph: GraphRequest | None = None,
) -> Updater:
    """The one place that picks the updater for the options. Local.

    * ``offload``: the host worker (:class:`~dtensor_ema.update.updater.OffloadUpdater`), or on
      CUDA, once :data:`~dtensor_ema.update.updater.CUDA_OFFLOAD` says ``"chunked"`` and every group
      lerps, the chunked device pipeline (:class:`~dtensor_ema.update.updater.
      ChunkedOffloadUpdater`);
    * ``capturable``: :class:`~dtensor_ema.update.updater.CapturableUpdater`; else
      :class:`~dtensor_ema.update.updater.InlineUpdater`;
    * either of those two wrapped in :class:`~dtensor_ema.update.cuda_graph.GraphedUpdater` when
      ``graph`` says replay (:func:`~dtensor_ema.update.cuda_graph.resolve` never does with
      ``offload``).

    Peak extra memory: the offload worker's host staging copy of the source shards, or the
    chunked pipeline's device scratch (see each class); none otherwise.
    """
    if offload:
        on_cuda = any(s.device.type == "cuda" for g in groups for s in g.source_locals)
        chunked = updaters.CUDA_OFFLOAD == "chunked" and all(g.formula == "lerp" for g in groups)
        if on_cuda and chunked:
            return updaters.ChunkedOffloadUpdater(groups)
        return updaters.OffloadUpdater(groups)
    inner: Updater = (
        updaters.CapturableUpdater(groups) if capturable else updaters.InlineUpdater(groups)
    )
    if graph is None or not graph.decision.use:
        return inner
    return GraphedUpdater(
        inner,
        graph.device,
        graph.decision,
        capturable=capturable,
        required=graph.required,
    )


class EmaEngine:
    """The plan, counter, update groups and updater of one EMA, and changes to them.

    Args:
        model: the model as the user passed it (:func:`~dtensor_ema.plan.build_plan`
            unwraps it: :attr:`model`).
        mesh: the user's ``mesh=`` (resolved by the plan: :attr:`world`).
        options: every option, validated (:class:`~dtensor_ema.options.EmaOptions`).
        updates: the counter's initial value.

    Construction is **collective** over :attr:`world` (:func:`~dtensor_ema.plan.build_plan`'s
    structure and replica checks); :meth:`change_tracked` is too; everything else here is
    local. Peak extra memory: the EMA shards themselves.

    Raises:
        TypeError: as :func:`~dtensor_ema.plan.build_plan`.
        ValueError: as :func:`~dtensor_ema.plan.build_plan`, an ``exclude`` name that is not
            tracked, and ``cuda_graph=True`` where replay is unsafe (decided before any
            thread or stream exists).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None,
        options: EmaOptions,
        *,
        updates: int = 0,
    ) -> None:
        self._plan = build_plan(model, mesh, options)
        self.model = self._plan.module
        """The unwrapped model (:func:`~dtensor_ema.plan.unwrap_model`)."""
        self.world = self._plan.world
        """The mesh whose ranks share the EMA (``None``: plain, unsharded EMA tensors)."""
        self.device = self._plan.device
        """The model's device: where the counter's device twin lives."""
        self.options = options
        self._groups = self._build_groups()
        self._counter = UpdateCounter(options, updates, self.device)
        self._decision = self._resolve_graph()
        self._updater = self._new_updater()
        self._swapped = False
        self._identity: tuple[int, int] | None = None
        self._module: nn.Module | None = None
        log_decision(self._decision, self.device.type)

    # ------------------------------------------------------------------ read-only state
    @property
    def plan(self) -> EmaPlan:
        """The model-to-EMA binding (entries in state-dict order, the untracked tensors)."""
        return self._plan

    @property
    def groups(self) -> list[UpdateGroup]:
        """The update groups: cached local views, one fused kernel call each."""
        return self._groups

    @property
    def counter(self) -> UpdateCounter:
        """The update counter and the decay it implies."""
        return self._counter

    @property
    def updater(self) -> Updater:
        """Who applies each step (:func:`make_updater`'s choice)."""
        return self._updater

    @property
    def copied(self) -> frozenset[str]:
        """Tracked fqns copied from the model instead of averaged (``exclude``, copied
        buffers): the plan's entries that are not ``averaged``."""
        return frozenset(e.fqn for e in self._plan if not e.averaged)

    @property
    def graph_decision(self) -> GraphDecision:
        """Whether ``update()`` replays a captured CUDA graph, and why (after a failed
        capture: no, and why)."""
        if isinstance(self._updater, GraphedUpdater):
            return self._updater.decision
        return self._decision

    @property
    def graph(self) -> GraphedStep | None:
        """The captured step while the updater replays a CUDA graph, else ``None``."""
        return self._updater.graph if isinstance(self._updater, GraphedUpdater) else None

    @property
    def module(self) -> nn.Module | None:
        """The EMA module :meth:`build_module` built (``None`` before)."""
        return self._module

    def identity(self) -> int:
        """Which EMA this is, as a 32-bit digest: its entries (names, shapes, EMA dtypes,
        averaged or copied), its untracked tensors and its options
        (:meth:`~dtensor_ema.options.EmaOptions.agreement`). Equal on every rank of one
        EMA; cached until the tracked set changes. Local."""
        version = self._plan.tracked_version
        if self._identity is None or self._identity[0] != version:
            entries = [
                f"{e.fqn} {tuple(e.ema.shape)} {e.ema_local.dtype} {e.averaged}" for e in self._plan
            ]
            options = [f"{k}={v}" for k, v in self.options.agreement().items()]
            text = "\n".join([*entries, *self._plan.untracked, *options])
            self._identity = (version, zlib.crc32(text.encode()))
        return self._identity[1]

    def call_identity(self) -> tuple[int, int]:
        """``(identity(), update count)`` for the agreement before a collective call
        (:func:`~dtensor_ema._collectives.agree_on_call`); waits for a pending offloaded
        step first, so that every rank counts what it applied. Local."""
        self.flush()
        return self.identity(), self._counter.current()

    def config(self) -> str:
        """The checkpoint ``config``: JSON of the options that shape the next update, and
        the tracked set's description when some float tensor is untracked."""
        return json.dumps(
            self.options.config(set(self.copied), self._plan.untracked), sort_keys=True
        )

    # ------------------------------------------------------------------ update
    def step(self) -> None:
        """One ``update()`` call: wait for a pending offloaded step, re-bind the views if
        the model moved its tensors (refused while swapped in), then count and apply the
        step through the updater, with grad mode off. Local: no communication.

        Raises:
            ValueError: the model's tensors changed (the EMA untouched).
            RuntimeError: swapped in, closed, or an earlier offloaded step failed.
        """
        updater = self._updater
        updater.wait()  # an earlier offloaded update that failed raises before this one counts
        if not updater.checks_sources:  # the capturable step, which torch.compile traces whole
            self.refuse_while_swapped()
            with torch.no_grad():
                updater.run(self._counter)
            return
        grad = torch.is_grad_enabled()
        set_grad_mode(False)
        try:
            self.sync_sources()
            updater.run(self._counter)
        finally:
            set_grad_mode(grad)

    def advance(self) -> float | None:
        """Count one call now, for callers that apply the step themselves
        (:class:`~dtensor_ema.MultiModelEMA`): its decay, ``0.0`` to copy, ``None`` to skip.
        Local."""
        return self._counter.advance()

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Set every EMA shard to the model's current values (``set()``); the counter is
        unchanged. Local."""
        self.settle()
        self._updater.ensure_open()
        for group in self._groups:
            group.copy_()

    def flush(self) -> None:
        """Wait until every submitted step has been applied; raise a failed one's error
        (once). Local."""
        self._updater.wait()

    def close(self) -> None:
        """Finish the pending step and stop the updater (idempotent). Local."""
        self._updater.close()

    def use_updater(self, updater: Updater) -> None:
        """Replace the updater (the old one is closed first), e.g. a benchmark's candidate
        pipeline over :attr:`groups`. Local."""
        self._updater.close()
        self._updater = updater

    # ------------------------------------------------------------------ the model
    def check_model_argument(self, model: nn.Module | None) -> None:
        """Refuse a ``model`` argument that is not the tracked model (nor a wrapper of it).

        Raises:
            ValueError: naming both.
        """
        if model is not None and unwrap_model(model) is not self.model:
            raise ValueError(
                f"got a {type(model).__name__} that is not the model this EMA tracks "
                f"({type(self.model).__name__} at {id(self.model):#x}); create a new "
                "ModelEMA for a different model"
            )

    def refuse_while_swapped(self) -> None:
        """Raise ``RuntimeError`` while the EMA weights are swapped into the model."""
        if self._swapped:
            raise RuntimeError(
                "the EMA weights are swapped into the model (inside average_parameters()); "
                "update, set or materialize the EMA after the context exits"
            )

    def sync_sources(self) -> None:
        """Let the plan re-bind its views after model surgery; rebuild the update groups
        when a tensor moved. Local.

        Raises:
            ValueError: the model changed in a way the EMA cannot follow (EMA untouched).
            RuntimeError: while swapped in.
        """
        self.refuse_while_swapped()
        if self._plan.sync():
            self.rebind()

    def settle(self) -> None:
        """Make the EMA ready to read: :meth:`flush`, then :meth:`sync_sources`. Local.

        Raises:
            As :meth:`flush` and :meth:`sync_sources`.
        """
        self.flush()
        self.sync_sources()

    def rebind(self) -> None:
        """Rebuild the update groups from the plan (its views or EMA tensors moved: model
        surgery, ``ema.module`` taking the shards) and hand them to the updater, which
        drops a captured graph (the next call captures again). Local."""
        self.flush()
        self._groups = self._build_groups()
        self._updater.rebind(self._groups)

    def invalidate(self) -> None:
        """After a load wrote the EMA in place: addresses hold, but a captured graph is
        dropped so it cannot keep any state it baked in. Local."""
        self._updater.invalidate()

    def restore_count(self, updates: int) -> None:
        """Set the counter from a loaded state, then :meth:`invalidate`. Local."""
        self._counter.restore(updates)
        self.invalidate()

    def swap_communicates(self) -> bool:
        """Whether :meth:`swapped_in` communicates: some entry is split over replica dims
        (plain/DDP tensors, HSDP's replicate dim, TP-replicated weights, plain buffers) or
        is a ZeRO-3 partition (whose whole copies a swap may refresh); ``False`` for 1-D
        FSDP2 parameters alone, whose swap is local. Local."""
        return any(e.levels or e.layout.flat is not None for e in self._plan)

    @contextlib.contextmanager
    def swapped_in(self, bucket_bytes: int) -> Iterator[nn.Module]:
        """The EMA weights in the model inside the context (:mod:`dtensor_ema.materialize.swap`);
        nothing may update or materialize the EMA meanwhile. **Collective** over the
        replica groups on entry and exit (see ``ModelEMA.average_parameters``).

        Raises:
            RuntimeError: entered again while active.
        """
        if self._swapped:
            raise RuntimeError(
                "average_parameters() is already active for this EMA; exit it before "
                "entering it again"
            )
        self.settle()
        self._swapped = True
        try:
            with swapped_in(self._plan, self.model, bucket_bytes):
                yield self.model
        finally:
            self._swapped = False

    def build_module(
        self, mesh: DeviceMesh | None, units: UnitSpec, compute_dtype: torch.dtype | None
    ) -> nn.Module:
        """Build ``ModelEMA.module`` once (:func:`~dtensor_ema.materialize.ema_module.
        build_ema_module`, which may move the local shards into the twin: the update groups
        are rebuilt). Local; raises as ``ModelEMA.build_module``."""
        if self._module is not None:
            raise RuntimeError(
                "ema.module was already built (build_module() runs once, before the first "
                "access of ema.module); reuse ema.module"
            )
        refuse_unmirrored_options(self.options, mesh)
        self.settle()  # refuses inside average_parameters()
        plan = self._plan
        module = build_ema_module(self.model, plan, mesh, units=units, compute_dtype=compute_dtype)
        if plan.untracked:
            guard_untracked_loads(module, plan)
        self.rebind()  # the EMA's local shards may have moved into the module
        self._module = module
        return module

    # ------------------------------------------------------------------ whole state
    def whole_state(self) -> dict[str, Any]:
        """``{"updates": int, "ema": {fqn: tensor}}``: a copy of the whole EMA, for pickling
        an EMA that is whole on this rank. Local. Peak extra memory: one copy of the EMA.

        Raises:
            RuntimeError: swapped in, sharded over several ranks, or tracking DTensors (the
                message says what to save instead).
        """
        if self._swapped:
            raise RuntimeError(
                "cannot pickle, torch.save or deepcopy a ModelEMA inside average_parameters(): "
                "its model holds the EMA weights there, so the copy's model would start from "
                "them instead of the training weights. Copy it after the context exits"
            )
        world = self.world.size() if self.world is not None else 1
        dtensors = [e.fqn for e in self._plan if e.is_sharded_source]
        if world > 1 or dtensors:
            what = (
                f"sharded over {world} ranks (each holds 1/{world} of it)"
                if world > 1
                else f"tracking DTensor or ZeRO-3 parameters ({dtensors[:3]})"
            )
            raise RuntimeError(
                f"cannot pickle, torch.save or deepcopy a ModelEMA {what}: it would hold one "
                "rank's piece. Save its state instead: dtensor_ema.save_checkpoint(path, ema) "
                "(DCP, every rank writes its own shards; reshards on load), or the full EMA "
                "with ema.get_ema_state_dict() (collective) and torch.save on one rank; the "
                "drop-ins' state_dict() after gather_for_save() on every rank"
            )
        self.flush()
        return {
            "updates": self._counter.current(),
            "ema": {e.fqn: e.ema_local.detach().clone() for e in self._plan},
        }

    @torch.no_grad()
    def load_whole_state(self, ema: Mapping[str, torch.Tensor], updates: int) -> None:
        """Load :meth:`whole_state`'s values: its tracked set wins over what ``track=``
        picks now (``add_tensors``/``drop_tensors`` before the save). Local when the EMA is
        whole on this rank (the only case :meth:`whole_state` allows). The counter is
        checked first and every value is cut to its entry before any is copied, so a bad
        value or count leaves the tensors and the counter as they were.

        Raises:
            ValueError: a count outside ``[0, 2**63 - 1]``, a value that does not fit its
                entry.
        """
        check_count(updates)
        tracked = {e.fqn for e in self._plan}
        missing = [k for k in ema if k not in tracked]
        extra = [k for k in tracked if k not in ema]
        if missing:
            self.change_tracked(missing, add=True)
        if extra:
            self.change_tracked(extra, add=False)
        pieces = [(e.ema_local, ema_local_from_full(e, ema[e.fqn])) for e in self._plan]
        for target, piece in pieces:
            target.copy_(piece)
        self.restore_count(updates)

    # ------------------------------------------------------------------ tracked set
    @torch.no_grad()
    def change_tracked(self, fqns: Iterable[str], *, add: bool) -> None:
        """Start (``add``) or stop averaging the named tensors (see
        ``ModelEMA.add_tensors``/``drop_tensors``). **Collective** over the world mesh
        (:meth:`~dtensor_ema.plan.EmaPlan.track_`/``untrack_``); every rank passes the same
        names. A refused change leaves the tracked set, the trainable-set snapshot and the
        updater as they were.

        Raises:
            TypeError: ``fqns`` is a string.
            ValueError: as ``track_``/``untrack_``, or ``cuda_graph=True`` and a new
                tensor's EMA dtype rules the graph out.
            RuntimeError: while swapped in, or after :meth:`build_module` (the module holds
                the old set).
        """
        if self._module is not None:
            raise RuntimeError(
                f"{'add' if add else 'drop'}_tensors() after ema.module was built: the module "
                "holds the old tracked set. Change the tracked set before the first access of "
                "ema.module"
            )
        if isinstance(fqns, str):
            raise TypeError(f"fqns must be a collection of names, got the string {fqns!r}")
        self.flush()
        self.refuse_while_swapped()
        if self._plan.sync(check_trainable=False):
            self.rebind()
        names = list(fqns)
        if add:
            trainable_before = self._plan.trainable
            added = self._plan.track_(names)
            try:  # the new EMA dtypes may rule out the CUDA graph (cuda_graph=True raises)
                decision = self._resolve_graph()
            except ValueError:
                self._plan.untrack_([entry.fqn for entry in added])  # as before the call,
                self._plan.trainable = trainable_before  # the trainable-set check included
                self.rebind()
                raise
        else:
            self._plan.untrack_(names)
            decision = self._resolve_graph()
        self.rebind()
        current = self.graph_decision
        failed_capture = current.reason.startswith(CAPTURE_FAILED)
        if decision != current and not failed_capture:  # a failure stays eager
            old, self._decision = self._updater, decision
            was_closed = old.closed
            old.close()  # its work is done (flushed above)
            self._updater = self._new_updater()
            if was_closed:  # a closed EMA stays closed
                self._updater.close()
            log_decision(decision, self.device.type)

    # ------------------------------------------------------------------ internals
    def _build_groups(self) -> list[UpdateGroup]:
        options = self.options
        return update_groups(self._plan, options.kernel, options.formula, options.function)

    def _resolve_graph(self) -> GraphDecision:
        """The CUDA-graph decision for the current tracked set (its EMA dtypes decide).

        Raises:
            ValueError: ``cuda_graph=True`` where the decision is no.
        """
        options = self.options
        function = options.function
        return resolve(
            options.cuda_graph,
            self.device,
            offload=options.offload,
            schedule=options.schedule,
            ema_dtypes={e.ema_local.dtype for e in self._plan},
            formula=options.formula if function is None else function.kind,
        )

    def _new_updater(self) -> Updater:
        request = GraphRequest(self._decision, self.device, self.options.cuda_graph is True)
        return make_updater(
            self._groups,
            capturable=self.options.capturable,
            offload=self.options.offload,
            graph=request,
        )
