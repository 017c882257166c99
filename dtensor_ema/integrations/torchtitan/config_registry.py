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
``config_registry`` does not import here (a missing optional package) are left out and
listed in :data:`UNAVAILABLE`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torchtitan.models import _supported_models

from dtensor_ema.integrations.torchtitan.trainer import EMATrainer, with_ema

UNAVAILABLE: dict[str, str] = {}
"""Model families whose torchtitan ``config_registry`` failed to import: family -> error."""

SOURCES: dict[str, str] = {}
"""Config name -> the torchtitan function it wraps (``module.function``)."""

__all__: list[str] = ["SOURCES", "UNAVAILABLE"]


def _wrap(fn: Callable[[], Any], source: str) -> Callable[[], EMATrainer.Config]:
    def config() -> EMATrainer.Config:
        return with_ema(fn(), source=source)

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
        for p in inspect.signature(fn).parameters.values()
    )


def _register() -> None:
    for family in sorted(_supported_models):
        module_name = f"torchtitan.models.{family}.config_registry"
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            UNAVAILABLE[family] = f"{type(error).__name__}: {error}"
            continue
        for name, fn in vars(module).items():
            if (
                name.startswith("_")
                or not inspect.isfunction(fn)
                or fn.__module__ != module_name
                or not _takes_no_arguments(fn)
            ):
                continue
            if name in SOURCES:
                raise RuntimeError(f"{name} is defined by {SOURCES[name]} and {module_name}")
            SOURCES[name] = f"{module_name}.{name}"
            globals()[name] = _wrap(fn, SOURCES[name])
            __all__.append(name)


_register()
