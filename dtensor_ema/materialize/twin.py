"""Building blocks of the EMA's twin modules (:mod:`dtensor_ema.materialize.ema_module` and
:mod:`dtensor_ema.materialize.tp_module` both build on them; neither imports the other's internals).

A twin is a structural clone of the model whose parameter slots hold the EMA (or gather it
around the forward). Here: the model's registered tensor slots by canonical fqn
(:func:`slots`); the structural clone that takes FSDP2 off (:func:`clone_without_fsdp`);
re-pointing the per-instance callables a clone inherits (:func:`rebind_callables`); the
forward hooks every twin shares (:func:`install_forward_hooks`: float buffers gathered from
the EMA, integer and non-persistent buffers copied from the model, untracked buffers shared
with it); and the ``MixedPrecisionPolicy`` a student unit was sharded with
(:func:`student_mp_policy`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from dtensor_ema._collectives import check_all_ranks_enter
from dtensor_ema.layout import PlanEntry
from dtensor_ema.materialize.gather import LocalPiece, gather_full_tensors
from dtensor_ema.model_keys import canonical_fqn
from dtensor_ema.plan import EmaPlan, listed

__all__ = [
    "SharedSlots",
    "clone_without_fsdp",
    "guard_untracked_loads",
    "install_forward_hooks",
    "prepare_twin",
    "rebind_callables",
    "slots",
    "student_mp_policy",
]


def prepare_twin(model: nn.Module, twin: nn.Module) -> nn.Module:
    """Finish a structural clone: callables re-pointed at it, no gradients, ``eval()``."""
    rebind_callables(model, twin)
    twin.requires_grad_(False)
    twin.eval()
    return twin


def slots(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, str, str]]:
    """``(fqn, tensor, owner, name, "param" | "buffer")`` for every registered tensor,
    shared ones under every name. ``fqn`` is canonical (the plan's key: no
    ``_checkpoint_wrapped_module.`` or ``_orig_mod.`` components)."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for name, p in owner._parameters.items():
            if p is not None:
                yield canonical_fqn(f"{prefix}.{name}" if prefix else name), p, owner, name, "param"
        for name, b in owner._buffers.items():
            if b is not None:
                yield (
                    canonical_fqn(f"{prefix}.{name}" if prefix else name),
                    b,
                    owner,
                    name,
                    "buffer",
                )


class SharedSlots:
    """The twin's slots of the tensors the EMA does not track (``track=``): views of the
    model's own storage, never copies (a parameter slot holds an ``nn.Parameter`` over
    ``tensor.detach()``, a buffer slot the model's buffer itself).

    :meth:`refresh` re-points a slot whose model tensor was replaced or re-allocated since
    (``p.data = ...``): local, one ``data_ptr`` read per tensor, no copy.
    """

    def __init__(self, plan: EmaPlan) -> None:
        self.plan = plan
        self._slots: list[tuple[nn.Module, str, str, str]] = []
        self._values: dict[tuple[str, str], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def untracked_fqn(self, fqn: str) -> str | None:
        """The untracked tensor a model fqn names (through tied aliases), or ``None``."""
        target = self.plan.aliases.get(fqn, fqn)
        return target if target in self.plan.untracked else None

    def value(self, fqn: str, kind: str) -> torch.Tensor:
        """What a twin slot holds for the untracked tensor ``fqn`` (one object per tensor
        and kind, so tied slots stay tied)."""
        source = self.plan.untracked[fqn]
        pointer = _data_ptr(source)
        held = self._values.get((fqn, kind))
        if held is None or held[0] is not source or held[1] != pointer:
            shared = (
                nn.Parameter(source.detach(), requires_grad=False) if kind == "param" else source
            )
            held = (source, pointer, shared)
            self._values[(fqn, kind)] = held
        return held[2]

    def add(self, owner: nn.Module, name: str, kind: str, fqn: str) -> None:
        """Hold ``owner.<name>`` to the model's tensor ``fqn`` from now on."""
        self._slots.append((owner, name, kind, fqn))
        self.put(owner, name, kind, fqn)

    def put(self, owner: nn.Module, name: str, kind: str, fqn: str) -> None:
        value = self.value(fqn, kind)
        if kind == "param":
            owner._parameters[name] = value  # type: ignore[assignment]  # a Parameter
        else:
            owner._buffers[name] = value

    def refresh(self) -> None:
        """Re-point every slot at the model's current tensor (cheap when nothing moved)."""
        for owner, name, kind, fqn in self._slots:
            self.put(owner, name, kind, fqn)


def guard_untracked_loads(twin: nn.Module, plan: EmaPlan) -> None:
    """Refuse ``load_state_dict`` on the twin (or any of its submodules) of a state that
    would change a tensor the EMA does not track: the twin's slots for them are the model's
    own tensors (or read from them before each forward), so loading would write into the
    model. A value that is the model's tensor, or equal to it, passes (a state the module
    gave loads back). A pre-hook on every module above such a slot checks the whole subtree
    being loaded, so the module ``load_state_dict`` was called on raises before anything is
    written. Local (DTensors compare their local pieces)."""
    owners: dict[int, list[tuple[str, str]]] = {}  # id(module) -> [(local name, untracked)]
    for module_fqn, module in twin.named_modules():
        names = [*module._parameters, *module._buffers]
        for name in names:
            fqn = canonical_fqn(f"{module_fqn}.{name}" if module_fqn else name)
            target = plan.aliases.get(fqn, fqn)
            if target in plan.untracked:
                owners.setdefault(id(module), []).append((name, target))

    def changed(state_dict: Mapping[str, Any], keys: list[tuple[str, str]]) -> list[str]:
        return [k for k, target in keys if k in state_dict and _differs(state_dict[k], target)]

    def _differs(value: Any, target: str) -> bool:
        model = plan.untracked[target]
        if value is model:
            return False
        local = value.to_local() if hasattr(value, "to_local") else value
        mine = model.to_local() if hasattr(model, "to_local") else model
        if hasattr(value, "to_local") != hasattr(model, "to_local"):
            return True  # a full tensor for a sharded one (or the other way): not the same
        return not (local.shape == mine.shape and torch.equal(local.to(mine.dtype), mine))

    def refuse(shared: list[str]) -> None:
        if shared:
            raise ValueError(
                f"ema.module.load_state_dict: {listed(shared)} are the model's own tensors "
                "(untracked: track=), shared by ema.module; loading other values would write "
                "into the model. Leave them out of the state and pass strict=False, or load "
                "the EMA with ema.load_state_dict()"
            )

    def check_root(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any) -> None:
        keys = []
        for module_fqn, sub in module.named_modules():
            head = f"{prefix}{module_fqn}." if module_fqn else prefix
            keys += [(head + name, target) for name, target in owners.get(id(sub), [])]
        refuse(changed(state_dict, keys))

    owner_fqns = [f for f, m in twin.named_modules() if id(m) in owners]
    for module_fqn, module in twin.named_modules():  # the owners and all their ancestors
        if any(
            f == module_fqn or not module_fqn or f.startswith(module_fqn + ".") for f in owner_fqns
        ):
            module.register_load_state_dict_pre_hook(check_root)


def _data_ptr(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.data_ptr())


def install_forward_hooks(
    model: nn.Module, twin: nn.Module, plan: EmaPlan, shared: SharedSlots | None = None
) -> None:
    """Before a forward: gather the EMA's float buffers into the twin (one flat all-gather
    per bucket over the mesh) and copy the integer ones, and the buffers the model does
    not save (non-persistent ones: RoPE tables), from the model; re-point the slots
    ``shared`` holds (untracked tensors, shared with the model) if the model moved them.
    After it (also when it raises): reshard every unit, so the root's parameters do not
    stay gathered and the next forward sees the next update()."""
    buffer_slots = {
        fqn: (owner, name) for fqn, _, owner, name, kind in slots(twin) if kind == "buffer"
    }
    entries = [e for e in plan if not e.is_parameter and not e.is_dtensor_source]
    pieces = [_buffer_piece(e, buffer_slots[e.fqn]) for e in entries]
    followed = [(buffer_slots[fqn], source) for fqn, source in plan.followed.items()]
    tracked = {*plan.by_fqn(), *plan.aliases, *plan.followed, *plan.untracked}
    followed += [
        (buffer_slots[fqn], source)
        for fqn, source, _, _, kind in slots(model)
        if kind == "buffer" and fqn not in tracked and fqn in buffer_slots
    ]

    def pre_forward(_module: nn.Module, _args: Any) -> None:
        check_all_ranks_enter(plan.world, "ema.module forward")
        if shared is not None:
            shared.refresh()
        with torch.no_grad():
            for (owner, name), source in followed:
                owner._buffers[name].copy_(source)  # type: ignore[union-attr]
            if pieces:
                full = gather_full_tensors(pieces)
                for entry in entries:
                    owner, name = buffer_slots[entry.fqn]
                    owner._buffers[name].copy_(full[entry.fqn])  # type: ignore[union-attr]

    def post_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        for module in twin.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    twin.register_forward_pre_hook(pre_forward, prepend=True)
    twin.register_forward_hook(post_forward, always_call=True)


def _buffer_piece(entry: PlanEntry, slot: tuple[nn.Module, str]) -> LocalPiece:
    """How to gather one float buffer's EMA into the twin's (full) buffer: undo the
    replica split (``levels``), in the twin buffer's dtype."""
    owner, name = slot
    buffer = owner._buffers[name]
    assert buffer is not None
    return LocalPiece(
        fqn=entry.fqn,
        local=entry.ema_local,
        shape=entry.source.shape,
        mesh=None,
        placements=(),
        out_dtype=buffer.dtype,
        levels=entry.levels,
        piece_shape=entry.source_piece.shape,
    )


def student_mp_policy(module: nn.Module) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` a student unit was sharded with. torch keeps it only on
    the private FSDP state; without it (a torch that renamed it) the default policy."""
    try:
        policy = module._get_fsdp_state()._mp_policy  # type: ignore[operator]
    except AttributeError:
        return MixedPrecisionPolicy()
    return policy if isinstance(policy, MixedPrecisionPolicy) else MixedPrecisionPolicy()


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def clone_without_fsdp(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The module tree with FSDP2 taken off: original classes, FSDP's hooks and state
    dropped, tensors replaced through ``memo``, other attributes shared (shallow).

    FSDP2 modules refuse ``copy.deepcopy``; the twin needs only the structure.
    """
    clones: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        if id(m) in clones:
            return clones[id(m)]
        cls: type[nn.Module] = type(m)
        if isinstance(m, FSDPModule):
            cls = next(b for b in cls.__bases__ if issubclass(b, nn.Module))
        new = cls.__new__(cls)
        clones[id(m)] = new
        state = {k: v for k, v in m.__dict__.items() if not _fsdp_attribute(k, v)}
        state["_parameters"] = {
            k: (memo[id(v)] if v is not None else None) for k, v in m._parameters.items()
        }
        state["_buffers"] = {
            k: (memo[id(v)] if v is not None else None) for k, v in m._buffers.items()
        }
        state["_modules"] = {
            k: (clone(v) if v is not None else None) for k, v in m._modules.items()
        }
        for name in _HOOK_DICTS:
            hooks = m.__dict__.get(name)
            if isinstance(hooks, dict):
                state[name] = type(hooks)((k, h) for k, h in hooks.items() if not _fsdp_hook(h))
        new.__dict__.update(state)
        return new

    return clone(module)


def _fsdp_attribute(name: str, value: Any) -> bool:
    if name in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
        return True
    # fully_shard's composable state and registry live in the module's __dict__.
    return name.startswith("__composable_api")


def _fsdp_hook(hook: Any) -> bool:
    owner = getattr(hook, "__self__", None)
    target = owner if owner is not None else hook
    module = getattr(type(target) if owner is not None else target, "__module__", "") or ""
    if isinstance(hook, functools.partial):
        return _fsdp_hook(hook.func)
    return module.startswith("torch.distributed.fsdp") or module.startswith(
        "torch.distributed._composable"
    )


# ------------------------------------------------------------------------- callables


def rebind_callables(model: nn.Module, twin: nn.Module) -> None:
    """Point the twin's per-instance callables at the twin, never at ``model``.

    A structural clone inherits what ``model``'s modules hold in their ``__dict__``:

    * ``forward`` set on the instance: torchtitan's ``Module.parallelize`` sets
      ``self.forward`` to a closure over the module, its bound ``forward`` (or a
      ``local_map`` wrapper of it) and the ``ParallelDims``; CP wraps attention the same
      way. Run as is, the twin would call the *training* module's forward.
    * forward hooks: bound methods or closures over modules.
    * ``_compiled_call_impl`` (``module.compile()``, torchtitan's per-block compile): a
      compiled function of the *training* module's ``_call_impl``.

    Bound methods of a module of ``model`` are re-bound to the twin's module of the same
    fqn; closures and ``functools.partial`` objects are rebuilt with every module (or bound
    method) they capture replaced the same way. ``_compiled_call_impl`` is dropped: the
    twin runs eagerly (compile it yourself, e.g. ``block.compile()`` per block of
    ``ema.module``). Local.

    Raises:
        NotImplementedError: a callable captures a module outside ``model``, or is an
            object whose captures cannot be seen (naming the module and attribute).
    """
    twins = dict(twin.named_modules(remove_duplicate=False))
    mapping: dict[int, nn.Module] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if fqn in twins:
            mapping[id(module)] = twins[fqn]
    for fqn, module in twin.named_modules():
        state = module.__dict__
        if state.get("_compiled_call_impl") is not None:
            state["_compiled_call_impl"] = None
        where = fqn or "<root>"
        if "forward" in state:
            state["forward"] = _remap(state["forward"], mapping, f"{where}.forward", 0)
        for name in _HOOK_DICTS[:5]:
            hooks = state.get(name)
            if isinstance(hooks, dict) and hooks:
                state[name] = type(hooks)(
                    (k, _remap(h, mapping, f"{where}.{name}", 0)) for k, h in hooks.items()
                )


def _remap(obj: Any, mapping: Mapping[int, nn.Module], where: str, depth: int) -> Any:
    """``obj`` with every module of the model it captures replaced by the twin's."""
    if depth > 8:
        raise NotImplementedError(f"ema.module: {where} nests callables too deeply to rebind")
    if isinstance(obj, nn.Module):
        if id(obj) in mapping:
            return mapping[id(obj)]
        if obj in mapping.values():
            return obj
        raise NotImplementedError(
            f"ema.module: {where} captures a {type(obj).__name__} that is not part of the "
            "model; the EMA twin cannot run it. Evaluate with ema.average_parameters()"
        )
    if isinstance(obj, types.MethodType):
        owner = _remap(obj.__self__, mapping, where, depth + 1)
        return obj if owner is obj.__self__ else types.MethodType(obj.__func__, owner)
    if isinstance(obj, functools.partial):
        func = _remap(obj.func, mapping, where, depth + 1)
        args = tuple(_remap(a, mapping, where, depth + 1) for a in obj.args)
        kwargs = {k: _remap(v, mapping, where, depth + 1) for k, v in obj.keywords.items()}
        if (
            func is obj.func
            and all(a is b for a, b in zip(args, obj.args, strict=True))
            and all(kwargs[k] is v for k, v in obj.keywords.items())
        ):
            return obj
        return functools.partial(func, *args, **kwargs)
    if isinstance(obj, types.FunctionType):
        return _remap_function(obj, mapping, where, depth)
    if callable(obj) and not isinstance(obj, (type, types.BuiltinFunctionType)):
        captured = (
            [v for v in vars(obj).values() if isinstance(v, nn.Module)]
            if hasattr(obj, "__dict__")
            else []
        )
        if any(id(v) in mapping for v in captured):
            raise NotImplementedError(
                f"ema.module: {where} is a {type(obj).__name__} holding a module of the "
                "model; the EMA twin cannot rebind it. Evaluate with ema.average_parameters()"
            )
    return obj


def _remap_function(
    fn: types.FunctionType, mapping: Mapping[int, nn.Module], where: str, depth: int
) -> types.FunctionType:
    """``fn`` rebuilt over remapped closure cells, defaults and ``__wrapped__``."""
    cells = fn.__closure__ or ()
    values = []
    changed = False
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later): keep it as is
            values.append(cell)
            continue
        new = _remap(value, mapping, where, depth + 1)
        changed |= new is not value
        values.append(types.CellType(new) if new is not value else cell)
    defaults = fn.__defaults__
    if defaults:
        new_defaults = tuple(_remap(d, mapping, where, depth + 1) for d in defaults)
        changed |= any(a is not b for a, b in zip(new_defaults, defaults, strict=True))
        defaults = new_defaults
    wrapped = fn.__dict__.get("__wrapped__")
    new_wrapped = _remap(wrapped, mapping, where, depth + 1) if wrapped is not None else None
    changed |= new_wrapped is not wrapped
    if not changed:
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, tuple(values))
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__dict__.update(fn.__dict__)
    if wrapped is not None:
        out.__dict__["__wrapped__"] = new_wrapped
    return out
