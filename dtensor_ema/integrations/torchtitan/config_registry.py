"""torchtitan's registered configs, each with a sharded EMA: the ``--module`` of
``torchtitan.train``.

::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module dtensor_ema.integrations.torchtitan --config llama3_8b --ema.decays 0.999

torchtitan 0.3.0's ``ConfigManager`` imports ``<module>.config_registry`` for a fully
qualified ``--module`` and calls the function named by ``--config``. Every public,
argument-free function of ``torchtitan.models.<family>.config_registry`` (``llama3_8b``,
``qwen3_0_6b``, ``deepseek_v3_16b``, ``gpt_oss_20b``, ...) has a namesake here that calls it
and returns its config as an
:class:`~dtensor_ema.integrations.torchtitan.trainer.EMATrainer.Config` (the EMA enabled,
the rest unchanged), so every torchtitan flag keeps working and ``--ema.*`` flags are added.

A config that is not torchtitan's plain ``Trainer.Config`` (flux's ``FluxTrainer.Config``
builds its own trainer; kimi's config subclass adds checks of its own) is refused with a
``TypeError`` naming it when its function is called. Model families whose
``config_registry`` does not import here (a missing optional package) are listed in
:data:`UNAVAILABLE`; asking for one of their configs (``--config flux_debugmodel``) raises
an ``ImportError`` that says which import failed. The module's public callables are the
configs only, so torchtitan's list of available configs holds nothing else.
"""

from __future__ import annotations

import ast as _ast
import importlib as _importlib
import inspect as _inspect
from collections.abc import Callable
from pathlib import Path as _Path
from typing import Any

import torchtitan.models as _models
from torchtitan.models import _supported_models

from dtensor_ema.integrations.torchtitan import trainer as _trainer

UNAVAILABLE: dict[str, str] = {}
"""Model families whose torchtitan ``config_registry`` failed to import: family -> error."""

_UNAVAILABLE_CONFIGS: dict[str, str] = {}
"""Config name -> its family in :data:`UNAVAILABLE` (read from the registry's source)."""

SOURCES: dict[str, str] = {}
"""Config name -> the torchtitan function it wraps (``module.function``)."""

__all__: list[str] = ["SOURCES", "UNAVAILABLE"]


def _wrap(fn: Callable[[], Any], source: str) -> Callable[[], _trainer.EMATrainer.Config]:
    def config() -> _trainer.EMATrainer.Config:
        return _trainer.with_ema(fn(), source=source)

    config.__name__ = config.__qualname__ = fn.__name__
    config.__doc__ = (
        f"``{source}()`` with a sharded EMA (``--ema.*``; see "
        ":mod:`dtensor_ema.integrations.torchtitan.trainer`)."
    )
    config.__wrapped__ = fn  # type: ignore[attr-defined]
    return config


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in _inspect.signature(fn).parameters.values()
    )


def _register() -> None:
    for family in sorted(_supported_models):
        module_name = f"torchtitan.models.{family}.config_registry"
        try:
            module = _importlib.import_module(module_name)
        except ImportError as error:
            UNAVAILABLE[family] = f"{type(error).__name__}: {error}"
            for name in _config_names(family):
                _UNAVAILABLE_CONFIGS.setdefault(name, family)
            continue
        for name, fn in vars(module).items():
            if (
                name.startswith("_")
                or not _inspect.isfunction(fn)
                or fn.__module__ != module_name
                or not _takes_no_arguments(fn)
            ):
                continue
            if name in SOURCES:
                raise RuntimeError(f"{name} is defined by {SOURCES[name]} and {module_name}")
            SOURCES[name] = f"{module_name}.{name}"
            globals()[name] = _wrap(fn, SOURCES[name])
            __all__.append(name)


def _config_names(family: str) -> list[str]:
    """The argument-free public functions of ``torchtitan.models.<family>.config_registry``,
    read from its source (it does not import); ``[]`` when the file is not there."""
    source = _Path(_models.__file__).parent / family / "config_registry.py"
    try:
        tree = _ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return []
    names = []
    for node in tree.body:
        if not isinstance(node, _ast.FunctionDef) or node.name.startswith("_"):
            continue
        a = node.args
        if len(a.defaults) == len(a.posonlyargs) + len(a.args) and None not in a.kw_defaults:
            names.append(node.name)
    return names


def __getattr__(name: str) -> Any:
    """A config of a family whose registry did not import: an ``ImportError`` saying why
    (torchtitan's ``ConfigManager`` looks ``--config`` up with ``getattr``)."""
    family = _UNAVAILABLE_CONFIGS.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise ImportError(
        f"config {name!r} is unavailable: torchtitan.models.{family}.config_registry, "
        f"which defines it, failed to import ({UNAVAILABLE[family]}); install what it "
        "needs and run again"
    )


_register()
