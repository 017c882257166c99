"""ema-pytorch's ``PostHocEMA``, sharded, on :class:`dtensor_ema.PostHocEMA`:
``from dtensor_ema.compat.ema_pytorch import PostHocEMA``.

Same constructor (``sigma_rels`` or ``gammas``, ``checkpoint_every_num_steps``,
``checkpoint_folder``, ``checkpoint_dtype``, KarrasEMA keywords), methods (``update()``,
``checkpoint()``, ``synthesize_ema_model(gamma=, sigma_rel=, step=)``, ``__call__``) and
attributes, with ema-pytorch 0.8.3's numbers: its gammas (:func:`sigma_rel_to_gamma`,
``numpy.roots``), its ``beta = (1 - 1/(s + 1)) ** (gamma + 1)`` as the engine's power
schedule (bit for bit), its snapshot tensors in ``checkpoint_dtype`` (as one sharded
snapshot per ``checkpoint()``, each rank writing its own shards) and its synthesis system
(solved and summed in float64: within float32 rounding). ``ignore_names`` /
``ignore_startswith_names`` map onto ``track=`` (:class:`NotIgnored`: ignored tensors are
not stored). The guide, with what differs: ``docs/migration-ema-pytorch.md#posthocema``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_ema._collectives import group_of
from dtensor_ema.integrations._common import copy_ema_into_model
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.options import TrackSpec, check_int
from dtensor_ema.posthoc import PostHocEMA as _Engine
from dtensor_ema.posthoc import Term, list_snapshots
from dtensor_ema.posthoc.phema_math import profile_inner
from dtensor_ema.posthoc.phema_math import sigma_rel_to_gamma as _newton_gamma
from dtensor_ema.posthoc.synthesis import combine

__all__ = ["KarrasEMA", "NotIgnored", "PostHocEMA", "sigma_rel_to_gamma"]

_REFUSED: dict[str, Any] = {"ema_model": None, "frozen": False}
_IGNORED = ("allow_different_devices", "move_ema_to_online_device")


class NotIgnored:
    """``track=`` for ema-pytorch's ``ignore_names`` (exact names) and
    ``ignore_startswith_names`` (string prefixes): keeps every other tensor. A class, not a
    closure, so the EMA still pickles. Shared by both ema-pytorch drop-ins."""

    def __init__(self, names: frozenset[str], prefixes: tuple[str, ...]) -> None:
        self.names, self.prefixes = names, prefixes

    def __call__(self, fqn: str, tensor: torch.Tensor) -> bool:
        return self.keeps(fqn)

    def keeps(self, fqn: str) -> bool:
        return fqn not in self.names and not (self.prefixes and fqn.startswith(self.prefixes))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """ema-pytorch's gamma of ``sigma_rel``: the largest real root of eq. 126 by
    ``numpy.roots`` (our Newton iteration where numpy is missing; last bits differ)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with ema-pytorch
        return _newton_gamma(sigma_rel)
    t = sigma_rel**-2
    return float(np.roots([1, 7, 16 - t, 12 - t]).real.max().item())


class KarrasEMA(nn.Module):
    """One profile (ema-pytorch's ``KarrasEMA``): ``gamma``, ``ema_model``, ``__call__``.

    ``ema_model`` is the engine's sharded EMA module (collective forward on every rank).
    """

    def __init__(self, engine: ModelEMA, gamma: float, owner: PostHocEMA | None) -> None:
        super().__init__()
        self._engine = [engine]  # a list: not a submodule
        self.gamma = gamma
        self._owner = [owner]

    @property
    def engine(self) -> ModelEMA:
        return self._engine[0]

    @property
    def ema_model(self) -> nn.Module:
        return self.engine.module

    @property
    def step(self) -> torch.Tensor:
        owner = self._owner[0]
        return torch.tensor(0 if owner is None else owner.calls)

    @property
    def beta(self) -> float:
        """ema-pytorch's ``(1 - 1/(step + 1)) ** (1 + gamma)``."""
        return (1.0 - 1.0 / (float(self.step.item()) + 1.0)) ** (1.0 + self.gamma)

    def eval(self) -> nn.Module:  # type: ignore[override]
        return self.ema_model.eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ema_model(*args, **kwargs)


class PostHocEMA(nn.Module):
    """ema-pytorch's ``PostHocEMA`` with each rank holding ``1/W`` of every profile.

    Construction is collective where :class:`~dtensor_ema.ModelEMA`'s is (every rank);
    ``update()`` is local except on checkpoint calls; ``checkpoint()`` and
    ``synthesize_ema_model()`` are collective over the default group (every rank).
    ``mesh`` (keyword only) is passed to the engine.

    Peak extra memory: one EMA shard per profile (``len(gammas) / W`` of the model's
    floats); ``synthesize_ema_model`` adds one more shard (the result) plus, transiently,
    float64 buckets of at most 128 MiB while summing and one full float32 copy of the
    model's floats while loading the result.
    """

    def __init__(
        self,
        model: nn.Module,
        ema_model: Any = None,
        sigma_rels: tuple[float, ...] | None = None,
        gammas: tuple[float, ...] | None = None,
        checkpoint_every_num_steps: int | Literal["manual"] = 1000,
        checkpoint_folder: str = "./post-hoc-ema-checkpoints",
        checkpoint_dtype: torch.dtype = torch.float16,
        *,
        mesh: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        given = {k: kwargs.pop(k, v) for k, v in _REFUSED.items() if k != "ema_model"}
        given["ema_model"] = ema_model
        refused = [k for k, v in given.items() if v != _REFUSED[k]]
        if refused:
            raise ValueError(
                f"dtensor_ema.compat.ema_pytorch.PostHocEMA does not support {refused}: the "
                "sharded EMA builds its modules from the model and averages every float "
                "tensor it tracks"
            )
        for k in _IGNORED:
            kwargs.pop(k, None)  # the EMA lives where the model's shards live
        update_every = kwargs.pop("update_every", 100)
        no_ema = kwargs.pop("param_or_buffer_names_no_ema", set())
        self.ignore_names = set(kwargs.pop("ignore_names", set()))
        self.ignore_startswith_names = set(kwargs.pop("ignore_startswith_names", set()))
        for name, names in (
            ("ignore_names", self.ignore_names),
            ("ignore_startswith_names", self.ignore_startswith_names),
        ):
            if not all(isinstance(n, str) for n in names):
                raise TypeError(f"{name} must be a set of strings, got {sorted(map(repr, names))}")
        if kwargs:
            raise TypeError(f"PostHocEMA got unexpected keyword arguments {sorted(kwargs)}")
        if (sigma_rels is None) == (gammas is None):
            raise ValueError("pass exactly one of sigma_rels or gammas")
        if sigma_rels is not None:
            gammas = tuple(map(sigma_rel_to_gamma, sigma_rels))
        assert gammas is not None
        if len(gammas) < 2:
            raise ValueError(
                f"at least 2 gammas are needed to synthesize other profiles, got {gammas}"
            )
        if len(set(gammas)) != len(gammas):
            raise ValueError(f"gammas must be unique, got {gammas}")
        check_int("update_every", update_every, 1)
        every = checkpoint_every_num_steps
        bad = isinstance(every, bool) or not isinstance(every, int) or every < 1
        if every != "manual" and bad:
            raise ValueError(
                f"checkpoint_every_num_steps must be an int >= 1 or 'manual', got {every!r}"
            )
        self.gammas = tuple(float(g) for g in gammas)
        self.num_ema_models = len(self.gammas)
        self.update_every = update_every
        self.checkpoint_every_num_steps = every
        self.checkpoint_folder = Path(checkpoint_folder)
        self.checkpoint_folder.mkdir(exist_ok=True, parents=True)
        self.checkpoint_dtype = checkpoint_dtype
        self._model = [model]
        self._mesh = mesh
        self._kept = NotIgnored(
            frozenset(self.ignore_names), tuple(sorted(self.ignore_startswith_names))
        )
        self._no_ema = {n for n in no_ema if self._kept.keeps(n)} or None
        self.calls = 0
        self._engine = _Engine(
            model,
            snapshot_dir=self.checkpoint_folder,
            mesh=mesh,
            exclude=self._no_ema,
            track=self._track(),
            snapshot_dtype=checkpoint_dtype,
            gammas=self.gammas,
        )
        self._profiles = [
            KarrasEMA(self._engine.emas[f"p{i}"], g, self) for i, g in enumerate(self.gammas)
        ]

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    def _track(self) -> TrackSpec:
        return self._kept if self._kept.names or self._kept.prefixes else "all"

    @property
    def engine(self) -> _Engine:
        """The :class:`~dtensor_ema.PostHocEMA` doing the work."""
        return self._engine

    @property
    def ema_models(self) -> list[KarrasEMA]:
        """One :class:`KarrasEMA` per gamma, in order."""
        return self._profiles

    @property
    def step(self) -> torch.Tensor:
        """``update()`` calls so far."""
        return torch.tensor(self.calls)

    def update(self) -> None:
        """One ema-pytorch step (see the module docstring). Local; collective on the calls
        that checkpoint (every ``checkpoint_every_num_steps``-th)."""
        first = self.calls == 0
        due = self.calls % self.update_every == 0
        t = self.calls + 2  # ema-pytorch's beta at call s is the power schedule at t = s + 1
        self._engine.update_at(self.calls + 1, t if due else None, t if first else 1)
        self.calls += 1
        every = self.checkpoint_every_num_steps
        if every != "manual" and self.calls % every == 0:
            self.checkpoint()

    def copy_params_from_model_to_ema(self) -> None:
        """Every profile becomes the model. Local."""
        for i in range(self.num_ema_models):
            self._engine.emas[f"p{i}"].set()

    def copy_params_from_ema_to_model(self) -> None:
        """**Collective**: the model becomes each profile in turn (the last one stays)."""
        for i in range(self.num_ema_models):
            ema = self._engine.emas[f"p{i}"]
            copy_ema_into_model(ema, ema.model)

    def checkpoint(self) -> None:
        """Snapshot every profile in ``checkpoint_dtype`` as ``checkpoint_folder/step-<s>``.

        **Collective** (every rank writes its own shards). No extra memory when
        ``checkpoint_dtype`` is the EMA's dtype; a cast copy of this rank's shards otherwise.
        """
        self._engine.snapshot()

    def synthesize_ema_model(
        self,
        gamma: float | None = None,
        sigma_rel: float | None = None,
        step: int | None = None,
    ) -> KarrasEMA:
        """The EMA of ``gamma`` (or ``sigma_rel``) at ``step`` (default: the latest
        snapshot), combined from every snapshot in ``checkpoint_folder``.

        **Collective** over the default group when there is one: every rank reads and
        sums only its ``Shard(0)`` piece, then the result is loaded into a new sharded EMA.

        Raises:
            ValueError: both or neither of ``gamma``/``sigma_rel``, no snapshot, or a
                ``step`` beyond the latest snapshot.
        """
        if (gamma is None) == (sigma_rel is None):
            raise ValueError("pass exactly one of gamma or sigma_rel")
        if sigma_rel is not None:
            gamma = sigma_rel_to_gamma(sigma_rel)
        assert gamma is not None
        self._engine.wait()
        snapshots = list_snapshots(self.checkpoint_folder)
        if not snapshots:
            raise ValueError(f"no snapshot in {self.checkpoint_folder}: call checkpoint() first")
        latest = max(s.step for s in snapshots)
        step = latest if step is None else step
        if step > latest:
            raise ValueError(f"step {step} is beyond the latest snapshot's step {latest}")
        pairs = [(s, p) for s in snapshots for p in s.profiles]
        # ema-pytorch's Algorithm 3: snapshot times = update calls, gammas as float32 tensors.
        t_i = torch.tensor([s.step for s, _ in pairs], dtype=torch.float64)
        g_i = torch.tensor([float(p["gamma"]) for _, p in pairs]).double()
        t_r = torch.tensor([float(step)], dtype=torch.float64)
        g_r = torch.tensor([gamma]).double()
        a = profile_inner(t_i[:, None], g_i[:, None], t_i[None, :], g_i[None, :])
        b = profile_inner(t_i[:, None], g_i[:, None], t_r[None, :], g_r[None, :])
        weights = torch.linalg.solve(a, b).squeeze(-1).tolist()
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"the snapshots' system is singular (weights {weights})")
        terms = [
            Term(s, str(p["key"]), float(p["sigma_rel"]), float(p["gamma"]), w)
            for (s, p), w in zip(pairs, weights, strict=True)
        ]
        group = group_of(None)
        state = combine(terms, group=group)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        engine = ModelEMA(
            self.model, self._mesh, decay=0.0, exclude=self._no_ema, track=self._track()
        )
        engine.load_full_state_dict(full)
        del full
        return KarrasEMA(engine, gamma, None)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The engine's state (sharded, for ``dcp.save``) and the call count. Local."""
        return {"engine": self._engine.state_dict(), "calls": self.calls}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, **_: Any) -> Any:  # type: ignore[override]
        """Restore from :meth:`state_dict` (or a ``dcp.load`` of it). Local."""
        self._engine.load_state_dict(state_dict["engine"])
        self.calls = int(state_dict["calls"])

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Every profile's forward (each **collective** when sharded)."""
        return tuple(p(*args, **kwargs) for p in self._profiles)

    def __repr__(self) -> str:
        return f"PostHocEMA(gammas={self.gammas}, step={self.calls}, engine={self._engine!r})"
