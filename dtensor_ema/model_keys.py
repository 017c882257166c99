"""Names: the model's live tensors by canonical fqn, and the model's own state-dict keys.

The EMA binds to the tensors the optimizer updates (``named_parameters`` and persistent
``named_buffers``), keyed by *canonical* fqns: the module path without wrapper components
(activation checkpointing's ``_checkpoint_wrapped_module``, ``torch.compile``'s
``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``). That is the key
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` gives a tensor, the key of
the EMA's DCP state, and, for most models, the key of ``model.state_dict()``.

Some models transform their state dict with hooks: torchtitan's fused-QKV attention stores
one ``wqkv`` parameter and saves it as ``wq``/``wk``/``wv``. Outputs meant for loading into
the model (``get_model_state_dict``, ``export_ema``) go through the model's own state-dict
post-hooks (:func:`to_model_keys`), and full state dicts loaded into the EMA through its
load pre-hooks (:func:`from_model_keys`), so conversion scripts written for the model's
checkpoints keep working. Hooks of wrapper modules (which only add or strip the wrapper
component) are skipped: our keys carry no wrapper components to begin with.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "WRAPPER_COMPONENTS",
    "canonical_fqn",
    "from_model_keys",
    "hooked_prefixes",
    "live_tensors",
    "to_model_keys",
]

WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
"""Module path components that wrappers insert and ``state_dict`` keys leave out."""

StateDict = dict[str, Any]


def canonical_fqn(name: str) -> str:
    """``name`` without wrapper components: ``layers.0._checkpoint_wrapped_module.w`` ->
    ``layers.0.w``; ``_orig_mod.fc.weight`` -> ``fc.weight``."""
    if not any(part in name for part in WRAPPER_COMPONENTS):
        return name
    return ".".join(p for p in name.split(".") if p not in WRAPPER_COMPONENTS)


def _non_persistent(module: nn.Module) -> set[str]:
    # Buffers registered with persistent=False are left out of state_dict() and so out of
    # the EMA (RoPE tables, ``inv_freq``). torch keeps the set on a private attribute with
    # no public accessor; without it every buffer counts as persistent.
    names = getattr(module, "_non_persistent_buffers_set", None)
    return set(names) if isinstance(names, set) else set()


def live_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``canonical fqn -> tensor`` for every parameter and persistent buffer of ``module``.

    The tensors are the module's own objects (``Parameter``, buffer, or FSDP2/TP
    ``DTensor`` parameter), never copies, in ``state_dict()`` order (a module's
    parameters, then its buffers, then its children's). A tensor reachable under several
    names (tied weights, a module shared at two paths) appears under each. Local; no hook
    runs.

    Raises:
        ValueError: two different tensors share one canonical fqn.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        skip = _non_persistent(sub)
        named = [
            *sub.named_parameters(recurse=False, remove_duplicate=False),
            *(
                (n, b)
                for n, b in sub.named_buffers(recurse=False, remove_duplicate=False)
                if n not in skip
            ),
        ]
        for name, tensor in named:
            fqn = canonical_fqn(dot + name)
            seen = out.get(fqn)
            if seen is not None and seen is not tensor:
                raise ValueError(
                    f"two different tensors of {type(module).__name__} have the canonical "
                    f"name {fqn!r} (one is {dot + name!r}); rename one of them"
                )
            out[fqn] = tensor
    return out


def _is_wrapper(module: nn.Module) -> bool:
    return any(name in WRAPPER_COMPONENTS for name, _ in module.named_children())


def _hooked_modules(module: nn.Module, hooks: str) -> Iterator[tuple[str, nn.Module]]:
    """``(canonical prefix, module)`` for each non-wrapper module with hooks of kind
    ``hooks`` (a private ``nn.Module`` dict: torch has no public way to run or list a
    module's state-dict hooks), in pre-order."""
    for name, sub in module.named_modules(remove_duplicate=False):
        if getattr(sub, hooks, None) and not _is_wrapper(sub):
            prefix = canonical_fqn(name)
            yield (f"{prefix}." if prefix else ""), sub


def hooked_prefixes(module: nn.Module) -> list[str]:
    """The canonical prefixes (``"layers.0.attention.qkv_linear."``; ``""`` for ``module``
    itself) of the modules whose state-dict post-hooks :func:`to_model_keys` runs: a hook
    sees every key under its prefix. Local."""
    return [prefix for prefix, _ in _hooked_modules(module, "_state_dict_hooks")]


def to_model_keys(module: nn.Module, tensors: StateDict) -> StateDict:
    """Run ``module``'s state-dict post-hooks on ``tensors`` (full tensors keyed by
    canonical fqn), as ``module.state_dict()`` would on its own tensors. Local.

    Identity (the same dict) for models without such hooks. Hooks run children first, with
    canonical prefixes, each on the keys under its module's prefix (spliced back in place,
    so the order is ``model.state_dict()``'s); legacy hooks that return a dict replace
    those keys.
    """
    hooked = list(_hooked_modules(module, "_state_dict_hooks"))
    if not hooked:
        return tensors
    destination: StateDict = dict(tensors)
    for prefix, sub in reversed(hooked):  # children before their parents
        # A hook sees its own subtree's keys, and what it returns is spliced back where
        # the subtree was, so the keys keep model.state_dict()'s order.
        keys = list(destination)
        inside = [i for i, k in enumerate(keys) if k.startswith(prefix)]
        at = inside[0] if inside else len(keys)
        subtree: StateDict = {k: destination[k] for k in keys if k.startswith(prefix)}
        metadata = {"version": getattr(sub, "_version", 1)}
        for hook in list(sub._state_dict_hooks.values()):
            result = hook(sub, subtree, prefix, metadata)
            if result is not None and not getattr(hook, "_from_public_api", False):
                subtree = dict(result)
        outside = [k for k in keys if not k.startswith(prefix)]
        destination = {
            **{k: destination[k] for k in outside[:at]},
            **subtree,
            **{k: destination[k] for k in outside[at:]},
        }
    return destination


def from_model_keys(module: nn.Module, state_dict: StateDict) -> StateDict:
    """The inverse of :func:`to_model_keys`: run ``module``'s load pre-hooks on a copy of
    ``state_dict`` (full tensors keyed like ``module.state_dict()``), parents first, as
    ``module.load_state_dict`` would. Local. Identity for models without such hooks.

    Raises:
        ValueError: a hook reported errors.
    """
    hooked = list(_hooked_modules(module, "_load_state_dict_pre_hooks"))
    if not hooked:
        return state_dict
    out: StateDict = dict(state_dict)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    for prefix, sub in hooked:
        metadata = {"version": getattr(sub, "_version", 1)}
        for hook in list(sub._load_state_dict_pre_hooks.values()):
            hook(out, prefix, metadata, True, missing, unexpected, errors)
    if errors:
        raise ValueError(f"the model's load_state_dict hooks refused the state dict: {errors}")
    return out
