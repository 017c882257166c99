"""Combine post-hoc EMA snapshots into new averages, streaming tensor bucket by bucket.

:func:`synthesize` reconstructs the power-function EMA of any ``sigma_rel`` from the
snapshots' least-squares weights (:func:`~dtensor_ema.posthoc.phema_math.solve_coefficients`);
:func:`merge_snapshots` averages snapshots with explicit weights (the last ``K`` uniformly, or
warmup-stable-merge style weights). Both run on one engine, :func:`combine`: float64
accumulators of at most ``bucket_bytes`` a bucket, each snapshot's slice read with DCP
(under a process group each rank reads and builds only its ``Shard(0)`` piece), through
:mod:`dtensor_ema.checkpoint.reader`: every selected snapshot is checked before any tensor
is read and runs no code. Peak memory, outputs and the checks: ``docs/posthoc.md#synthesis``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtensor_ema._collectives import agree
from dtensor_ema._collectives import group_of as _group
from dtensor_ema.checkpoint.reader import (
    Checkpoint,
    CheckpointError,
    ChecksumError,
    open_checkpoint,
)
from dtensor_ema.checkpoint.save_load import save_checkpoint
from dtensor_ema.export.state_file import check_destination, write_state_file
from dtensor_ema.layout import chunk_range
from dtensor_ema.materialize.gather import consecutive_runs
from dtensor_ema.options import check_int
from dtensor_ema.posthoc.phema_math import (
    DEFAULT_MAX_CONDITION,
    check_sigma_rel,
    profile_fit_error,
    sigma_rel_to_gamma,
    solve_coefficients,
)
from dtensor_ema.posthoc.snapshots import Snapshot, check_compatible, dtype_from_str, list_snapshots

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Term",
    "merge_snapshots",
    "merge_terms",
    "plan_synthesis",
    "synthesize",
]

DEFAULT_BUCKET_BYTES = 128 * 1024 * 1024
"""Bytes of float64 accumulator per bucket."""
MAX_TERMS = 2048
"""Most (snapshot, profile) pairs one synthesis combines: its least-squares system is that
square (32 MiB of float64, a second or two to solve); select fewer snapshots with
``steps=``."""

Format = Literal["safetensors", "pt", "dcp"]
StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Term:
    """One snapshot's profile and the weight it gets in the combination."""

    snapshot: Snapshot
    key: str
    """Where the profile lives in the snapshot checkpoint (``"p0"``)."""
    sigma_rel: float
    gamma: float
    weight: float

    @property
    def step(self) -> int:
        return self.snapshot.step

    @property
    def t(self) -> float:
        return self.snapshot.t


# ------------------------------------------------------------------------- selection
def _select(
    snapshot_dir: str | os.PathLike[str], step: int | None, steps: Sequence[int] | None
) -> list[Snapshot]:
    """Snapshots with ``step`` at most ``step`` (default: the latest), optionally only those
    listed in ``steps``; checked to describe one model."""
    available = list_snapshots(snapshot_dir)
    by_step = {s.step: s for s in available}
    if steps is not None:
        missing = [s for s in steps if s not in by_step]
        if missing:
            raise ValueError(
                f"no snapshot at step(s) {missing} in {snapshot_dir}; available: {sorted(by_step)}"
            )
        available = [by_step[s] for s in sorted(set(steps))]
    if step is not None:
        if step not in by_step:
            raise ValueError(
                f"no snapshot at step {step} in {snapshot_dir}; available: {sorted(by_step)}"
            )
        available = [s for s in available if s.step <= step]
        if not available or available[-1].step != step:
            raise ValueError(f"step {step} is not among the selected steps {steps}")
    check_compatible(available)
    return available


def plan_synthesis(
    snapshot_dir: str | os.PathLike[str],
    sigma_rel: float,
    *,
    step: int | None = None,
    steps: Sequence[int] | None = None,
    max_condition: float = DEFAULT_MAX_CONDITION,
) -> tuple[list[Term], float]:
    """The least-squares weights :func:`synthesize` would use, and the profile fit error.

    Local, reads only the manifests. The target is the power-function profile of
    ``sigma_rel`` at the time of the latest selected snapshot.

    Returns:
        ``(terms, fit_error)``: one term per (snapshot, tracked profile), weights summing to
        1; ``fit_error`` is the relative L2 distance between the combined and the target
        profile (:func:`~dtensor_ema.posthoc.phema_math.profile_fit_error`).

    Raises:
        FileNotFoundError: a missing snapshot directory.
        ValueError: ``sigma_rel`` outside ``(0, 0.2887)``, an empty directory, a ``step``
            with no snapshot, snapshots of different models/shapes/dtypes, more than
            :data:`MAX_TERMS` snapshot profiles, or a singular or ill-conditioned system
            (too few distinct snapshots).
    """
    sigma_rel = check_sigma_rel(sigma_rel)
    gamma = sigma_rel_to_gamma(sigma_rel)
    chosen = _select(snapshot_dir, step, steps)
    count = sum(len(s.manifest["profiles"]) for s in chosen)
    if count > MAX_TERMS:
        raise ValueError(
            f"{len(chosen)} snapshots of {count // len(chosen)} profiles on average make {count} "
            f"terms, more than {MAX_TERMS} (the least-squares system is that square): select "
            "fewer snapshots with steps="
        )
    pairs = [(s, p) for s in chosen for p in s.profiles]
    ts = [s.t for s, _ in pairs]
    gammas = [float(p["gamma"]) for _, p in pairs]
    target_t = chosen[-1].t
    # A tracked sigma_rel is recomputed from the manifest's value, so it matches exactly.
    weights = solve_coefficients(ts, gammas, target_t, gamma, max_condition=max_condition)
    error = profile_fit_error(ts, gammas, weights, target_t, gamma)
    terms = [
        Term(s, str(p["key"]), float(p["sigma_rel"]), float(p["gamma"]), float(w))
        for (s, p), w in zip(pairs, weights.tolist(), strict=True)
    ]
    return terms, error


def merge_terms(
    snapshot_dir: str | os.PathLike[str],
    *,
    last: int | None,
    weights: Mapping[int, float] | None,
    sigma_rel: float | None,
) -> list[Term]:
    """The terms :func:`merge_snapshots` combines (its arguments' meaning), from the
    manifests alone. Local.

    Raises:
        ValueError: as for :func:`merge_snapshots`.
    """
    if (last is None) == (weights is None):
        raise ValueError("pass exactly one of last=K (uniform average) or weights={step: w}")
    available = list_snapshots(snapshot_dir)
    if last is not None:
        if check_int("last", last, 1) > len(available):
            raise ValueError(
                f"last={last} but {snapshot_dir} holds only {len(available)} snapshots"
            )
        chosen = available[-last:]
        spec = {s.step: 1.0 / last for s in chosen}
    else:
        assert weights is not None
        if not weights:
            raise ValueError("weights must name at least one snapshot step")
        bad = {k: w for k, w in weights.items() if not math.isfinite(float(w))}
        if bad:
            raise ValueError(f"weights must be finite, got {bad}")
        by_step = {s.step: s for s in available}
        missing = [k for k in weights if k not in by_step]
        if missing:
            raise ValueError(
                f"no snapshot at step(s) {missing} in {snapshot_dir}; available: {sorted(by_step)}"
            )
        chosen = [by_step[k] for k in sorted(weights)]
        spec = {int(k): float(w) for k, w in weights.items()}
    check_compatible(chosen)
    profiles = chosen[-1].profiles
    tracked = [float(p["sigma_rel"]) for p in profiles]
    if sigma_rel is None:
        profile = min(profiles, key=lambda p: float(p["sigma_rel"]))
    else:
        matches = [p for p in profiles if float(p["sigma_rel"]) == float(sigma_rel)]
        if not matches:
            raise ValueError(f"sigma_rel={sigma_rel} is not a tracked profile; tracked: {tracked}")
        profile = matches[0]
    return [
        Term(
            s,
            str(profile["key"]),
            float(profile["sigma_rel"]),
            float(profile["gamma"]),
            spec[s.step],
        )
        for s in chosen
    ]


# ------------------------------------------------------------------------- public API
def synthesize(
    snapshot_dir: str | os.PathLike[str],
    sigma_rel: float | Sequence[float],
    *,
    out: str | os.PathLike[str] | None = None,
    format: Format | None = None,
    step: int | None = None,
    steps: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    max_condition: float = DEFAULT_MAX_CONDITION,
    process_group: dist.ProcessGroup | None = None,
    progress: bool = False,
) -> Any:
    """The post-hoc EMA of ``sigma_rel`` (or of several), from the snapshots in ``snapshot_dir``.

    Reconstructs the power-function EMA of relative width ``sigma_rel`` at the time of the
    latest selected snapshot as the least-squares combination of every selected snapshot of
    every tracked profile (EDM2 eq. 151, Algorithm 3, weights in float64). A tracked
    ``sigma_rel`` returns that profile's latest snapshot exactly.

    Runs in one process with no process group, or distributed: with a process group
    initialized, it is **collective** over ``process_group`` (default: the whole default
    group; its backend must handle CPU tensors, e.g. gloo or ``"cpu:gloo,cuda:nccl"``),
    each rank reading and combining only its ``Shard(0)`` piece of every tensor.

    Args:
        snapshot_dir: a directory written by :class:`~dtensor_ema.PostHocEMA`.
        sigma_rel: one relative width in ``(0, 0.2887)``, or several.
        out: where to write instead of returning tensors. A path ending in ``.safetensors``
            or ``.pt`` is one file (one ``sigma_rel``; its directory must exist); another
            path is a directory (created if missing) that receives one output per
            ``sigma_rel``, named ``sigma_rel-<value>``. Distributed
            runs write DCP checkpoints only.
        format: ``"safetensors"``, ``"pt"`` or ``"dcp"``; default: from ``out``'s suffix, or
            ``"dcp"`` when distributed, else ``"safetensors"`` (``"pt"`` if the safetensors
            package is missing).
        step: reconstruct at this snapshot's step from the snapshots up to it (default: the
            latest).
        steps: use only the snapshots at these steps.
        dtype: output dtype; default: each tensor's EMA dtype.
        bucket_bytes: bound on each bucket's float64 accumulator.
        max_condition: refuse systems with a larger condition number.
        process_group: the ranks that synthesize together (distributed only).
        progress: show a tqdm progress bar (when tqdm is installed).

    Returns:
        Without ``out``: ``{fqn: tensor}`` keyed like the model's ``state_dict()`` (integer
        buffers from the latest snapshot, tied names sharing one tensor), full tensors in one
        process, ``Shard(0)`` DTensors on a 1-D CPU mesh when distributed; a list of such
        dicts for a sequence of ``sigma_rel``. With ``out``: the path written (a list of
        paths for a sequence). Snapshots of a ``PostHocEMA(track=...)`` that left tensors
        untracked give the tracked tensors only (no integer buffers): load them with
        ``model.load_state_dict(sd, strict=False)``, or write a LoRA model's adapters with
        :func:`~dtensor_ema.export.peft.save_peft_adapter`; a ``.safetensors`` output
        lists the absent tensors in its metadata (``dtensor_ema.untracked``).

    Peak memory (per rank): one output copy (``1/W`` of it when distributed) plus a few
    buckets; several ``sigma_rel`` are produced one after the other when written to
    ``out`` (held together when returned).

    Raises:
        FileNotFoundError: a missing snapshot directory, or a missing parent directory of a
            one-file ``out`` (checked before any snapshot is read).
        ValueError: see :func:`plan_synthesis`; a ``.safetensors``/``.pt`` output when
            distributed, or several ``sigma_rel`` into one file.
        SnapshotError: a snapshot folder or manifest that is malformed, altered (its
            checksum differs), or leads outside ``snapshot_dir`` (a ``ValueError``; see
            ``dtensor_ema.posthoc.snapshots.read_manifest``).
        CheckpointError: a snapshot's ``.metadata`` refers to a global that is not DCP
            metadata (a crafted snapshot: refused before any tensor is read, nothing run),
            is not what DCP writes or claims more than its files hold, or was written by
            another save than its manifest names; a snapshot's data lacks an entry its
            manifest names, holds it in another shape or dtype, or its chunks do not cover
            it exactly once (refused before any tensor is read, on every rank); or DCP
            failed to read a snapshot.
        ChecksumError: a snapshot has no checksum files, one of another save, or bytes
            that differ from those saved (another step's data file in its folder).
    """
    many = not isinstance(sigma_rel, (int, float))
    sigmas = (
        [float(s) for s in sigma_rel]  # type: ignore[union-attr]
        if many
        else [float(sigma_rel)]  # type: ignore[arg-type]
    )
    if not sigmas:
        raise ValueError("sigma_rel must name at least one value")
    for s in sigmas:
        check_sigma_rel(s)
    group = _group(process_group)
    targets = _targets(out, format, [f"sigma_rel-{s:.4f}" for s in sigmas], group)
    plans = [
        plan_synthesis(snapshot_dir, s, step=step, steps=steps, max_condition=max_condition)[0]
        for s in sigmas
    ]
    results: list[Any] = []
    for terms, target, s in zip(plans, targets, sigmas, strict=True):
        state = combine(
            terms,
            dtype=dtype,
            bucket_bytes=bucket_bytes,
            group=group,
            progress=f"sigma_rel={s:g}" if progress else None,
        )
        if target is None:
            results.append(state)
        else:
            info = {"sigma_rel": str(s), "step": str(terms[-1].step)}
            _write(state, target, group, info | _tracking(terms[-1].snapshot))
            results.append(target[0])
            del state
    return results if many else results[0]


def merge_snapshots(
    snapshot_dir: str | os.PathLike[str],
    *,
    last: int | None = None,
    weights: Mapping[int, float] | None = None,
    sigma_rel: float | None = None,
    out: str | os.PathLike[str] | None = None,
    format: Format | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    process_group: dist.ProcessGroup | None = None,
    progress: bool = False,
) -> Any:
    """Average snapshots with explicit weights (checkpoint averaging) on the same engine.

    Args:
        last: the uniform average of the ``last`` latest snapshots.
        weights: ``{step: weight}`` applied as given (warmup-stable-merge style; normalize
            them yourself if they should sum to 1).
        sigma_rel: which tracked profile to average (default: the narrowest, closest to the
            raw weights).

    ``out``, ``format``, ``dtype``, ``bucket_bytes``, ``process_group``, ``progress``,
    returns and memory: as for :func:`synthesize` with one ``sigma_rel``. **Collective**
    when a process group is initialized.

    Raises:
        ValueError: both or neither of ``last``/``weights``, a step with no snapshot, an
            untracked ``sigma_rel``, or snapshots of different models.
        CheckpointError: as for :func:`synthesize`.
    """
    terms = merge_terms(snapshot_dir, last=last, weights=weights, sigma_rel=sigma_rel)
    group = _group(process_group)
    (target,) = _targets(out, format, ["merged"], group)
    state = combine(
        terms,
        dtype=dtype,
        bucket_bytes=bucket_bytes,
        group=group,
        progress="merge" if progress else None,
    )
    if target is None:
        return state
    info = {"merged_steps": str([t.step for t in terms])}
    _write(state, target, group, info | _tracking(terms[-1].snapshot))
    return target[0]


# ------------------------------------------------------------------------- the engine
def combine(
    terms: Sequence[Term],
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
    progress: str | None = None,
) -> StateDict:
    """``sum_i weight_i * snapshot_i[key_i]`` for every tensor, bucket by bucket.

    **Collective** over ``group`` when given (every rank builds its ``Shard(0)`` pieces).
    Accumulates in float64; output in ``dtype`` or each tensor's EMA dtype.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    latest = terms[-1].snapshot
    spec = latest.tensors
    order = [k for k in latest.manifest["model_keys"] if k in spec]
    order += [k for k in spec if k not in set(order)]
    mesh = None if group is None else DeviceMesh.from_group(group, "cpu")
    active = [t for t in terms if t.weight != 0.0]
    opened = _open_snapshots(active, latest, group)
    sizes = [8 * math.prod(spec[k]["shape"]) for k in order]  # float64 accumulators
    buckets = list(consecutive_runs(order, sizes, bucket_bytes))
    bar = _progress_bar(len(buckets) * len(active), progress)
    out: StateDict = {}
    for bucket in buckets:
        acc = {
            k: torch.zeros(_local_shape(spec[k]["shape"], mesh), dtype=torch.float64)
            for k in bucket
        }
        for term in active:
            stored = {k: dtype_from_str(spec[k]["dtype"]) for k in bucket}
            target = {k: _empty(spec[k]["shape"], stored[k], mesh) for k in bucket}
            opened[term.snapshot.path].load({term.key: target}, group=group)
            for k in bucket:
                acc[k].add_(_local(target[k]), alpha=term.weight)
            del target
            if bar is not None:
                bar.update(1)
        for k in bucket:
            out_dtype = dtype or dtype_from_str(spec[k]["ema_dtype"])
            out[k] = _wrap(acc.pop(k).to(out_dtype), spec[k]["shape"], mesh)
    if bar is not None:
        bar.close()
    followed = _followed(latest, opened[latest.path], group)
    state: StateDict = {}
    for key in latest.manifest["model_keys"]:
        if key in out:
            state[key] = out[key]
        elif key in followed:
            state[key] = followed[key]
        elif key in latest.manifest.get("aliases", {}):
            state[key] = out[latest.manifest["aliases"][key]]
    state.update({k: v for k, v in out.items() if k not in state})
    return state


def _placements(shape: Sequence[int]) -> list[Shard | Replicate]:
    return [Shard(0)] if len(shape) else [Replicate()]


def _local_shape(shape: Sequence[int], mesh: DeviceMesh | None) -> list[int]:
    if mesh is None or not shape:
        return list(shape)
    _, length = chunk_range(shape[0], mesh.size(), mesh.get_local_rank())
    return [length, *shape[1:]]


def _empty(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh | None) -> torch.Tensor:
    return _wrap(torch.empty(_local_shape(shape, mesh), dtype=dtype), shape, mesh)


def _wrap(local: torch.Tensor, shape: Sequence[int], mesh: DeviceMesh | None) -> torch.Tensor:
    if mesh is None:
        return local
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(
        local, mesh, _placements(shape), run_check=False, shape=full, stride=stride
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _open_snapshots(
    active: Sequence[Term], latest: Snapshot, group: dist.ProcessGroup | None
) -> dict[Path, Checkpoint]:
    """Every snapshot's DCP checkpoint, its ``.metadata`` read safely, its data files
    checked, and every entry the terms read checked against the manifest (present, of the
    manifest's shape and dtype, its chunks covering it exactly once), before any tensor is
    read; all ranks agree (one flag all-reduce)."""
    reads: dict[Path, tuple[Snapshot, set[str]]] = {latest.path: (latest, set())}
    for term in active:
        reads.setdefault(term.snapshot.path, (term.snapshot, set()))[1].add(term.key)
    spec = latest.tensors
    opened: dict[Path, Checkpoint] = {}
    error: Exception | None = None
    try:
        for path, (snapshot, keys) in reads.items():
            opened[path] = checkpoint = open_checkpoint(path)
            _check_same_save(checkpoint, snapshot)
            wanted = {
                f"{key}.{fqn}": (v["shape"], v["dtype"])
                for key in sorted(keys)
                for fqn, v in spec.items()
            }
            if snapshot is latest:
                followed = latest.manifest["followed"].items()
                wanted.update({f"followed.{k}": (v["shape"], v["dtype"]) for k, v in followed})
            _check_entries(checkpoint, wanted)
    except (OSError, CheckpointError) as e:
        error = e
    agree(group, error, "reading the snapshots' metadata")
    return opened


def _check_same_save(checkpoint: Checkpoint, snapshot: Snapshot) -> None:
    """The snapshot's data, its checksum files and its manifest were written by one save:
    ``.metadata`` records the save id the manifest names, the checksum files record it too,
    and ``.metadata`` matches its recorded digest. Every later read is verified. Local.

    Raises:
        CheckpointError: the data was written by another save (another step's or run's
            files copied into the folder), or has no save id.
        ChecksumError: the folder has no checksum files, one of another save, or a
            ``.metadata`` that differs from the one saved.
    """
    wanted = snapshot.manifest["save_id"]
    if checkpoint.save_id != wanted:
        raise CheckpointError(
            f"{checkpoint.metadata_file}: written by save {checkpoint.save_id!r}, but the "
            f"snapshot's manifest names save {wanted!r}: the folder holds another snapshot's "
            "(or run's) data; refused before reading"
        )
    if not checkpoint.has_checksums:
        raise ChecksumError(
            f"{checkpoint.path}: has no checksum files (every snapshot records them): refused"
        )
    checkpoint.verify_metadata()


def _check_entries(checkpoint: Checkpoint, wanted: Mapping[str, tuple[list[int], str]]) -> None:
    """Refuse a snapshot whose DCP data does not hold, whole, each entry its manifest names
    (``{DCP key: (shape, dtype)}``): the reads fill ``torch.empty`` buffers, so every
    element must come from the file. Local.

    Raises:
        CheckpointError: naming the snapshot, the entry and what is wrong (missing, another
            shape or dtype). Chunks that leave a gap or overlap were refused when the
            snapshot was opened (:func:`~dtensor_ema.checkpoint.reader.check_coverage`).
    """
    saved = checkpoint.metadata.state_dict_metadata
    where = f"{checkpoint.path}"
    for key, (shape, dtype) in wanted.items():
        md = saved.get(key)
        if md is None:
            raise CheckpointError(
                f"{where}: its data has no entry {key!r}, which its manifest names (the folder "
                "holds another run's data, or the manifest was altered): refused before reading"
            )
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{where}: entry {key!r} is not a tensor in its data")
        if list(md.size) != list(shape) or str(md.properties.dtype) != dtype:
            raise CheckpointError(
                f"{where}: entry {key!r} is {tuple(md.size)} {md.properties.dtype} in its data "
                f"but {tuple(shape)} {dtype} in its manifest"
            )


def _followed(
    latest: Snapshot, checkpoint: Checkpoint, group: dist.ProcessGroup | None
) -> StateDict:
    spec = latest.manifest.get("followed", {})
    if not spec:
        return {}
    state = {k: torch.empty(v["shape"], dtype=dtype_from_str(v["dtype"])) for k, v in spec.items()}
    checkpoint.load({"followed": state}, group=group)
    return state


def _progress_bar(total: int, desc: str | None) -> Any:
    if desc is None or importlib.util.find_spec("tqdm") is None:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="read")


# ------------------------------------------------------------------------- outputs
def _targets(
    out: str | os.PathLike[str] | None,
    format: Format | None,
    names: list[str],
    group: dist.ProcessGroup | None,
) -> list[tuple[Path, Format] | None]:
    """Where each output goes and in which format (``None``: returned, not written)."""
    if out is None:
        if format is not None:
            raise ValueError(f"format={format!r} needs an out= path")
        return [None] * len(names)
    if format is not None and format not in ("safetensors", "pt", "dcp"):
        raise ValueError(f"format must be 'safetensors', 'pt' or 'dcp', got {format!r}")
    path = Path(out)
    suffix = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}.get(path.suffix)
    if suffix is not None:
        if len(names) > 1:
            raise ValueError(
                f"out={str(out)!r} is one file but {len(names)} outputs were asked for; pass "
                "a directory"
            )
        if format is not None and format != suffix:
            raise ValueError(f"format={format!r} contradicts the suffix of out={str(out)!r}")
        fmt: Format = suffix  # type: ignore[assignment]
        paths = [path]
        missing = check_destination(path)  # before any snapshot is read
        if missing is not None:
            raise missing
    else:
        if format is not None:
            fmt = format
        elif group is not None:
            fmt = "dcp"
        else:
            fmt = "safetensors" if importlib.util.find_spec("safetensors") else "pt"
        ext = {"dcp": "", "safetensors": ".safetensors", "pt": ".pt"}[fmt]
        paths = [path if len(names) == 1 and fmt == "dcp" else path / (n + ext) for n in names]
    if group is not None and fmt != "dcp":
        raise ValueError(
            f"a distributed synthesis writes a sharded DCP checkpoint, not {fmt!r}: pass a "
            "directory (format='dcp'), or run in one process for a single file"
        )
    if fmt == "safetensors" and importlib.util.find_spec("safetensors") is None:
        raise ImportError("writing .safetensors needs the safetensors package (pip install it)")
    if suffix is None and fmt != "dcp":
        # ``out`` names the directory that receives the files: create it (export_ema's
        # writer refuses a missing parent directory, which is right for one named file).
        path.mkdir(parents=True, exist_ok=True)
    return [(p, fmt) for p in paths]


def _tracking(snapshot: Snapshot) -> dict[str, str]:
    """The output file's note of the tensors it lacks (``track=``): their names."""
    if not snapshot.untracked:
        return {}
    return {"track": snapshot.manifest["track"], "untracked": json.dumps(snapshot.untracked)}


def _write(
    state: StateDict,
    target: tuple[Path, Format],
    group: dist.ProcessGroup | None,
    metadata: dict[str, str],
) -> None:
    path, fmt = target
    if fmt == "dcp":
        save_checkpoint(state, path, process_group=group)
    else:
        write_state_file(state, path, metadata)
