"""torchtitan's fused <-> unfused Q/K/V projections, for an EMA resumed across the two.

torchtitan 0.3.0 has two attention projections: ``QKVLinear`` (``wq``, ``wk``, ``wv``) and
``FusedQKVLinear`` (one ``wqkv``; llama3's and qwen3's default, ``qwen3_debugmodel_non_fused_qkv``
the other). The EMA keeps the parameters as the model holds them, so a checkpoint's EMA
holds ``wqkv`` when the run that saved it was fused. torchtitan converts its model entry
with ``FusedQKVLinear``'s state-dict hooks; its layout (read from
``torchtitan/models/common/attention.py``) groups the rows per KV head::

    wqkv.reshape(n_kv_heads, heads_per_kv + 2, head_dim, *tail)
        [:, :heads_per_kv] -> wq    [:, heads_per_kv] -> wk    [:, heads_per_kv + 1] -> wv

(``tail``: the input dim of a weight, nothing for a bias). :func:`find_conversions`
pairs the saved and the live projections of each attention module and reads
``head_dim`` and the query heads per KV head from the live module: a ``FusedQKVLinear``'s
``head_dim`` and ``heads_per_kv``; a ``QKVLinear``'s ``head_dim`` and the row counts of its
``wq`` and ``wk`` weights. :func:`convert` is that layout's pure reshape (bit for bit).
No torchtitan import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QKVConversion", "convert", "find_conversions"]

FUSED = "wqkv"
UNFUSED = ("wq", "wk", "wv")


@dataclass(frozen=True, slots=True)
class QKVConversion:
    """One projection (weight or bias) of one attention module, saved in the other layout."""

    saved: tuple[str, ...]
    """The checkpoint's fqns: ``(…wqkv.weight,)`` or ``(…wq.weight, …wk.weight, …wv.weight)``."""
    ours: tuple[str, ...]
    """This model's fqns, in the other layout."""
    head_dim: int
    heads_per_kv: int
    """Query heads per KV head (``n_heads // n_kv_heads``)."""

    @property
    def fuses(self) -> bool:
        """Whether the saved tensors are unfused and ours fused."""
        return len(self.ours) == 1

    def describe(self) -> str:
        return (
            f"{', '.join(self.saved)} -> {', '.join(self.ours)} (head_dim {self.head_dim}, "
            f"{self.heads_per_kv} query head(s) per KV head)"
        )


def convert(
    conversion: QKVConversion, saved: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The saved full tensors of ``conversion`` in this model's layout (full tensors, new
    memory). Local."""
    hd, hpk = conversion.head_dim, conversion.heads_per_kv
    if conversion.fuses:
        wq, wk, wv = (saved[k] for k in conversion.saved)
        tail = tuple(wq.shape[1:])
        n_kv = wk.shape[0] // hd
        parts = [
            wq.reshape(n_kv, hpk, hd, *tail),
            wk.reshape(n_kv, 1, hd, *tail),
            wv.reshape(n_kv, 1, hd, *tail),
        ]
        return {conversion.ours[0]: torch.cat(parts, dim=1).reshape(-1, *tail)}
    (fused,) = (saved[k] for k in conversion.saved)
    tail = tuple(fused.shape[1:])
    w = fused.reshape(-1, hpk + 2, hd, *tail)
    q, k, v = conversion.ours
    return {
        q: w[:, :hpk].reshape(-1, *tail).contiguous(),
        k: w[:, hpk].reshape(-1, *tail).contiguous(),
        v: w[:, hpk + 1].reshape(-1, *tail).contiguous(),
    }


def find_conversions(
    saved: set[str], ours: set[str], modules: Mapping[str, Any]
) -> list[QKVConversion]:
    """The projections this model holds in the other layout than the checkpoint.

    Args:
        saved: the checkpoint's EMA fqns (every pipeline stage's).
        ours: this EMA's fqns.
        modules: canonical module fqn -> module of this model (``"layers.0.attention.qkv_linear"``).

    Raises:
        ValueError: a projection to convert whose layout cannot be read from the live
            module (no ``head_dim``, or a query/KV row count that is not a multiple of it),
            naming it and the way out.
    """
    out = []
    for fqn in sorted(ours):
        prefix, _, leaf = fqn.rpartition(".")
        module_fqn, _, name = prefix.rpartition(".")
        fused = f"{module_fqn}.{FUSED}.{leaf}"
        split = tuple(f"{module_fqn}.{w}.{leaf}" for w in UNFUSED)
        pair: tuple[tuple[str, ...], tuple[str, ...]]
        if name == FUSED and fused not in saved and all(k in saved for k in split):
            pair = (split, (fused,))
        elif name == UNFUSED[0] and all(k in ours for k in split) and fused in saved:
            if any(k in saved for k in split):
                continue
            pair = ((fused,), split)
        else:
            continue
        head_dim, per_kv = _layout(modules.get(module_fqn), module_fqn, pair)
        out.append(QKVConversion(pair[0], pair[1], head_dim, per_kv))
    return out


def _layout(
    module: Any, fqn: str, pair: tuple[tuple[str, ...], tuple[str, ...]]
) -> tuple[int, int]:
    """``(head_dim, heads_per_kv)`` of the live projection module ``fqn``."""
    head_dim: Any = getattr(module, "head_dim", None)
    per_kv: Any = getattr(module, "heads_per_kv", None)
    if per_kv is None and module is not None:
        wq, wk = getattr(module, "wq", None), getattr(module, "wk", None)
        rows = [getattr(getattr(w, "weight", None), "shape", (0,))[0] for w in (wq, wk)]
        readable = isinstance(head_dim, int) and head_dim > 0 and rows[1] > 0
        if readable and rows[0] % rows[1] == 0 and rows[1] % head_dim == 0:
            per_kv = rows[0] // rows[1]
    if not (isinstance(head_dim, int) and head_dim > 0 and isinstance(per_kv, int) and per_kv > 0):
        raise ValueError(
            f"the checkpoint's EMA holds {', '.join(pair[0])} and this model "
            f"{', '.join(pair[1])}, but the head layout of {fqn!r} (head_dim and query heads "
            "per KV head, which the grouped fused layout needs) cannot be read from the "
            f"model ({type(module).__name__}): resume with the checkpoint's QKV setting, or "
            "start from the EMA's weights in torchtitan's keys (the final save's "
            "step-N/ema/<name>, --checkpoint.initial_load_path with "
            "--checkpoint.initial_load_model_only)"
        )
    return head_dim, per_kv
