"""Loading the ``ema`` entry of a torchtitan checkpoint into a live :class:`TorchtitanEMA`:
another tracked set (``common_subset``) and the other Q/K/V layout (fused ``wqkv`` <->
``wq``/``wk``/``wv``).

:class:`EMALoad` stands in for the EMA in the state dict torchtitan's ``CheckpointManager``
hands DCP (a DCP ``Stateful``): its ``state_dict()`` holds only the EMA tensors to read as
they are, its ``load_state_dict`` loads them. :meth:`EMALoad.convert` then reads the
projections saved in the other layout, bucket by bucket, converts them
(:mod:`~dtensor_ema.integrations.torchtitan.qkv`, bit for bit) and copies each rank's rows
into the EMA. Pipeline stages need nothing of it: each rank's EMA asks DCP for its own
stages' tensors only. Nothing here imports torchtitan.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtensor_ema._collectives import group_gather_rows
from dtensor_ema.checkpoint.reader import Checkpoint
from dtensor_ema.integrations._common import is_rank0
from dtensor_ema.integrations.torchtitan.ema import TorchtitanEMA
from dtensor_ema.integrations.torchtitan.qkv import QKVConversion, convert, find_conversions
from dtensor_ema.layout import ema_local_from_full
from dtensor_ema.materialize.gather import consecutive_runs
from dtensor_ema.model_keys import canonical_fqn
from dtensor_ema.state import EMA_TENSORS

__all__ = ["CONVERT_BUCKET_BYTES", "EMALoad", "saved_emas"]

logger = logging.getLogger(__name__)

EMA = "ema"
CONVERT_BUCKET_BYTES = 256 * 1024 * 1024
"""Bound on the saved full tensors one read of :meth:`EMALoad.convert` holds."""


def saved_emas(checkpoint: Checkpoint) -> dict[str, set[str]]:
    """``EMA name -> fqns`` of the checkpoint's ``ema`` entry (``{}`` when it has none),
    from its metadata. Local."""
    out: dict[str, set[str]] = {}
    for key in checkpoint.entries_under((EMA,)):
        parts = str(key).split(".", 3)
        if len(parts) == 4 and parts[2] == EMA_TENSORS:
            out.setdefault(parts[1], set()).add(parts[3])
        elif len(parts) >= 2:
            out.setdefault(parts[1], set())
    return out


class EMALoad:
    """The ``ema`` entry of one DCP load, seen through what this checkpoint holds.

    Args:
        ema: the live EMA.
        checkpoint: the checkpoint (read by :func:`dtensor_ema.checkpoint.reader.open_checkpoint`).
        common_subset: load the tensors both the checkpoint and the EMA hold, keep the
            EMA's others (:meth:`TorchtitanEMA.load_state_dict`'s ``common_subset``).
        bucket_bytes: bound on one read of :meth:`convert`.

    Local to build (reads the metadata and the model's modules).

    Raises:
        ValueError: a projection in the other Q/K/V layout whose head layout cannot be
            read from the model (:func:`~dtensor_ema.integrations.torchtitan.qkv.find_conversions`);
            without ``common_subset``, a tensor this EMA tracks that the checkpoint's lacks
            (naming it and ``--ema.load_common_subset``).
    """

    def __init__(
        self,
        ema: TorchtitanEMA,
        checkpoint: Checkpoint,
        *,
        common_subset: bool = False,
        bucket_bytes: int = CONVERT_BUCKET_BYTES,
    ) -> None:
        self.ema = ema
        self.checkpoint = checkpoint
        self.common_subset = common_subset
        self.bucket_bytes = bucket_bytes
        saved = saved_emas(checkpoint)
        modules = {
            canonical_fqn(name): module
            for part in ema.model_parts
            for name, module in part.named_modules()
        }
        self.conversions: dict[str, list[QKVConversion]] = {}
        """Per EMA name: the projections read in the other layout (this rank's parts)."""
        self.keep: dict[str, set[str]] = {}
        """Per EMA name: the fqns DCP reads as they are."""
        for name in ema.names:
            ours = {k for emas in ema.parts for k in emas[name].state_dict()[EMA_TENSORS]}
            theirs = saved.get(name, set())
            conversions = find_conversions(theirs, ours, modules) if theirs else []
            keep = ours - {k for c in conversions for k in c.ours}
            missing = sorted(keep - theirs)
            if missing and theirs and not common_subset:
                raise ValueError(
                    f"checkpoint {checkpoint.path}: its EMA {name!r} lacks {missing[:5]}"
                    f"{' and more' if len(missing) > 5 else ''}, which this EMA tracks (saved "
                    "with another tracked set: other buffer_patterns, parameters frozen "
                    "then); resume with --ema.load_common_subset to load the tensors both "
                    "hold and keep this EMA's others"
                )
            self.conversions[name] = conversions
            self.keep[name] = keep & theirs if common_subset else keep

    def state_dict(self) -> dict[str, Any]:
        """The EMA's state with only the tensors DCP reads as they are. Local, no copy."""
        return {
            name: {
                **state,
                EMA_TENSORS: {k: v for k, v in state[EMA_TENSORS].items() if k in self.keep[name]},
            }
            for name, state in self.ema.state_dict().items()
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what DCP read (:meth:`TorchtitanEMA.load_state_dict`; the converted
        projections are left for :meth:`convert`). Local."""
        leave = {n: [k for c in cs for k in c.ours] for n, cs in self.conversions.items()}
        self.ema.load_state_dict(state_dict, common_subset=self.common_subset, leave=leave)

    @torch.no_grad()
    def convert(self, group: dist.ProcessGroup | None) -> int:
        """Read the projections saved in the other layout, convert them, copy this rank's
        rows into the EMA; log what was converted (rank 0). Returns how many projections
        this rank converted.

        **Collective** over ``group`` (every rank, also one with nothing to convert: one
        DCP read per bucket, as many as the rank with the most). Peak extra memory: one
        bucket of saved full tensors (``bucket_bytes``, or one larger projection) and its
        conversion.
        """
        buckets = self._buckets()
        count = len(buckets)
        if group is not None:
            count = max(row[1] for row in group_gather_rows(group, [count]))
        for i in range(count):
            bucket = buckets[i] if i < len(buckets) else []
            state: dict[str, Any] = {}
            for name, conversion in bucket:
                tensors = state.setdefault(name, {EMA_TENSORS: {}})[EMA_TENSORS]
                for fqn in conversion.saved:
                    shape, dtype = self._spec(name, fqn)
                    tensors[fqn] = torch.empty(shape, dtype=dtype)
            self.checkpoint.load({EMA: state}, group=group, partial=True)
            for name, conversion in bucket:
                saved = state[name][EMA_TENSORS]
                for fqn, full in convert(conversion, saved).items():
                    self._copy(name, fqn, full)
        done = sum(len(c) for c in self.conversions.values())
        if done and is_rank0():
            for name, conversions in self.conversions.items():
                logger.info(
                    "EMA %s: converted %d Q/K/V projection(s) from the checkpoint's layout, "
                    "as torchtitan's FusedQKVLinear does (%s%s)",
                    name,
                    len(conversions),
                    conversions[0].describe(),
                    ", ..." if len(conversions) > 1 else "",
                )
        return done

    def _buckets(self) -> list[list[tuple[str, QKVConversion]]]:
        items = [(name, c) for name, conversions in self.conversions.items() for c in conversions]
        sizes = []
        for name, conversion in items:
            specs = [self._spec(name, fqn) for fqn in conversion.saved]
            sizes.append(sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs))
        return list(consecutive_runs(items, sizes, self.bucket_bytes))

    def _spec(self, name: str, fqn: str) -> tuple[tuple[int, ...], torch.dtype]:
        md = self.checkpoint.metadata.state_dict_metadata[f"{EMA}.{name}.{EMA_TENSORS}.{fqn}"]
        assert isinstance(md, TensorStorageMetadata), fqn
        return tuple(md.size), md.properties.dtype

    def _copy(self, name: str, fqn: str, full: torch.Tensor) -> None:
        """This rank's rows of ``full`` into the EMA entry ``fqn`` of EMA ``name``."""
        for emas in self.ema.parts:
            entry = emas[name].engine.plan.by_fqn().get(fqn)
            if entry is not None:
                piece = ema_local_from_full(entry, full.to(entry.ema_local.dtype))
                entry.ema_local.copy_(piece)
                return
        raise KeyError(f"EMA {name!r} holds no {fqn!r}")
