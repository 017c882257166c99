"""Small collective helpers shared by the checkpoint, export and materialize paths.

* :func:`agree` / :func:`mesh_agree`: every rank learns whether any rank failed a step, so
  all raise or none does (one all-reduce of a flag per rank; per mesh dim on N-D meshes).
  Both then gather the failing ranks' messages in a fixed-size byte tensor (no pickling),
  so every rank raises the same error naming which rank saw what.
* :func:`collective` (a ``ModelEMA`` method) and :func:`entering` (any other block):
  mark a collective over a mesh or a process group. They name the call when a rank is
  missing: always when the backend's timeout fires, and early with
  ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>`` (a monitored barrier over the mesh or group
  before each such call; gloo groups only; costs one barrier per call, measured in
  ``benchmarks/checksums.py --collective-check``). Off by default: see :data:`CHECK_ENV`.
* :func:`all_gather_single`: the flat all-gather under its current name (torch 2.14
  deprecates ``all_gather_into_tensor``; older releases lack ``all_gather_single``). Every
  flat all-gather of the library goes through it.
* :func:`all_gather_single`, :func:`all_reduce` and :func:`gather` return only once the
  process group has let go of their tensors (:mod:`dtensor_ema._release`), so a process
  may exit right after any collective of this library without aborting in torch's
  teardown (gloo, pytorch#190489).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtensor_ema._release import released

__all__ = [
    "CALLS_ENV",
    "CHECK_ENV",
    "agree",
    "agree_on_call",
    "all_gather_single",
    "all_reduce",
    "check_all_ranks_enter",
    "check_group_enters",
    "collective",
    "describe",
    "entering",
    "gather",
    "group_gather_rows",
    "group_of",
    "is_mesh_first",
    "mesh_agree",
    "mesh_gather_rows",
    "quiet_single_process",
    "rank_of",
    "reduce_device",
    "same_error",
]

CHECK_ENV = "DTENSOR_EMA_CHECK_COLLECTIVES"
"""Seconds every rank of the mesh has to enter a collective call before it fails loudly.

Unset (the default): no check; a call that some ranks skip hangs until the backend's own
timeout, and the error then names the call. Not on by default because a short default
would fail healthy jobs in which one rank is legitimately late (rank 0 evaluating or
writing alone before a collective save), a default as long as the backend's timeout would
add nothing but the missing ranks' names, and the check exists on gloo only. Its cost is
small: one monitored barrier per checked call, 3-4 ms at W=2 on gloo CPU (a loaded
2-core machine; ``python benchmarks/checksums.py --collective-check``), against 0.6-2 s for
a swap, export, checkpoint save or construction of a ResNet-50 EMA there: below the
run-to-run noise."""

_all_gather_flat: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# torch 2.14 deprecates the old name all_gather_into_tensor (FutureWarning); older releases
# only have it.


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """The flat all-gather (``dist.all_gather_single``; ``all_gather_into_tensor`` before
    torch 2.14): ``output`` is every rank's ``input`` concatenated. **Collective** over
    ``group``. Returns once the process group has let go of both tensors
    (:func:`~dtensor_ema._release.released`)."""
    with released(output, input):
        _all_gather_flat(output, input, group=group)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_reduce`` (sum, in place). **Collective** over ``group``. Returns once the
    process group has let go of ``tensor`` (:func:`~dtensor_ema._release.released`)."""
    with released(tensor):
        dist.all_reduce(tensor, group=group)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    dst: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """``dist.gather`` of ``tensor`` into ``gather_list`` on global rank ``dst``.
    **Collective** over ``group``. Returns once the process group has let go of every
    tensor it was given (:func:`~dtensor_ema._release.released`)."""
    with released(tensor, *(gather_list or ())):
        dist.gather(tensor, gather_list, dst=dst, group=group)


F = TypeVar("F", bound=Callable[..., Any])


def group_of(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to coordinate on, or ``None`` for one process with no process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return process_group if process_group is not None else dist.group.WORLD


def rank_of(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _reduce_device(group: dist.ProcessGroup) -> torch.device:
    """A device the group's backend can all-reduce on (CPU for gloo, else the accelerator)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def reduce_device(group: dist.ProcessGroup) -> torch.device:
    """A device the group's backend can all-reduce on (CPU for gloo, else the accelerator)."""
    return _reduce_device(group)


MESSAGE_BYTES = 2048
"""Bytes of each failing rank's message that :func:`agree` gathers (UTF-8, cut beyond)."""
MESSAGE_RANKS = 8
"""How many failing ranks' messages :func:`agree` gathers (the lowest ranks)."""


def agree(group: dist.ProcessGroup | None, error: BaseException | None, what: str) -> None:
    """All ranks of ``group`` learn which ranks failed ``what``; every rank raises if any did.

    One all-reduce of an int32 flag per rank. When some rank failed, one more all-reduce of
    a ``(failing ranks, MESSAGE_BYTES)`` uint8 tensor, each failing rank filling its row with
    its error's type and message (UTF-8; no pickling), so every rank raises the same
    message: ``"<what> failed on rank 1: ChecksumError: ..."``, or one line per distinct
    message (at most :data:`MESSAGE_RANKS` ranks' messages, each cut at
    :data:`MESSAGE_BYTES` bytes). The exception's type is the first failing rank's when it
    is a builtin exception or one of this package's (else ``RuntimeError``); on a failing
    rank it chains the rank's own error. A group of one rank (or none) raises ``error``
    itself.
    """
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    ranks = list(range(dist.get_world_size(group)))
    _agree_over([group], ranks, dist.get_rank(group), error, what)


def _agree_over(
    groups: list[dist.ProcessGroup],
    ranks: list[int],
    rank: int,
    error: BaseException | None,
    what: str,
) -> None:
    """:func:`agree`'s flag and message all-reduces, each summed over every one of
    ``groups`` (together spanning ``ranks``, as they name them; ``rank``: this one's)."""
    flags = torch.zeros(len(ranks), dtype=torch.int32, device=_reduce_device(groups[0]))
    flags[ranks.index(rank)] = int(error is not None)
    for group in groups:
        all_reduce(flags, group=group)
    failed = [ranks[i] for i in flags.nonzero().flatten().tolist()]
    if not failed:
        return
    shown = failed[:MESSAGE_RANKS]
    rows = torch.zeros(len(shown), MESSAGE_BYTES, dtype=torch.uint8, device=flags.device)
    if error is not None and rank in shown:
        encoded = _encode(error)
        rows[shown.index(rank), : len(encoded)] = torch.frombuffer(encoded, dtype=torch.uint8)
    for group in groups:
        all_reduce(rows, group=group)
    messages = dict(zip(shown, (_decode(row) for row in rows.cpu()), strict=True))
    raise same_error(what, failed, messages) from error


def describe(error: BaseException) -> tuple[str, str]:
    """``(qualified type name, message)`` of ``error``: what :func:`same_error` takes."""
    return f"{type(error).__module__}.{type(error).__qualname__}", str(error)


def _encode(error: BaseException) -> bytearray:
    kind, message = describe(error)
    data = f"{kind}\0{message}".encode(errors="replace")
    if len(data) > MESSAGE_BYTES:
        data = data[: MESSAGE_BYTES - 4] + b"..."
    return bytearray(data)


def _decode(row: torch.Tensor) -> tuple[str, str]:
    """``(qualified type name, message)`` from one gathered row (NUL padding dropped)."""
    text = bytes(row.numpy().tobytes()).rstrip(b"\0").decode(errors="ignore")
    kind, _, message = text.partition("\0")
    return kind, message


def _error_type(kind: str) -> type[Exception]:
    """The exception class named ``kind`` when it is a builtin or one of this package's
    (already imported, never imported here); else ``RuntimeError``."""
    module, _, name = kind.rpartition(".")
    if module == "builtins":
        found = getattr(builtins, name, None)
    elif module.split(".")[0] == "dtensor_ema" and module in sys.modules:
        found = getattr(sys.modules[module], name, None)
    else:
        found = None
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError


def same_error(what: str, failed: list[int], messages: dict[int, tuple[str, str]]) -> Exception:
    """The error every rank raises when ranks ``failed`` failed ``what``: who failed, and
    each distinct message (``messages``: rank -> :func:`describe`, for the ranks shown),
    of the first shown rank's type when it is a builtin or ours, else ``RuntimeError``."""
    by_message: dict[tuple[str, str], list[int]] = {}
    for r, seen in messages.items():
        by_message.setdefault(seen, []).append(r)
    where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    if len(by_message) == 1 and len(messages) == len(failed):
        ((kind, message),) = by_message
        detail = f"{kind.rpartition('.')[2]}: {message}"
    else:
        detail = "; ".join(
            f"{f'rank {ranks[0]}' if len(ranks) == 1 else f'ranks {ranks}'}: "
            f"{kind.rpartition('.')[2]}: {message}"
            for (kind, message), ranks in by_message.items()
        )
        if len(failed) > len(messages):
            detail += f"; {len(failed) - len(messages)} more failing ranks not shown"
    text = f"{what} failed on {where}: {detail}"
    cls = _error_type(next(iter(messages.values()))[0])
    try:
        return cls(text)
    except Exception:  # a type whose constructor wants more than a message
        return RuntimeError(text)


def mesh_agree(mesh: DeviceMesh | None, error: BaseException | None, what: str) -> None:
    """:func:`agree` over every rank of ``mesh`` (any number of dims), with no new group:
    one all-reduce per mesh dim sums the flags over the whole mesh; when some rank failed,
    one more all-reduce per dim sums the failing ranks' message rows, as :func:`agree`
    does, so every rank raises the same error naming which rank (global rank) saw what.
    ``mesh=None``: this process alone."""
    if mesh is None or mesh.size() == 1:  # this process alone: its own error, as agree
        agree(None, error, what)
        return
    ranks = mesh.mesh.flatten().tolist()
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "mesh_agree called on a rank outside the mesh"
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    _agree_over(groups, ranks, dist.get_rank(), error, what)


def mesh_gather_rows(mesh: DeviceMesh, values: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank of ``mesh`` learns every rank's ``values`` (a few int64s): one
    all-gather per mesh dim of size > 1 (each gathers the blocks the previous dims built,
    so the last holds the whole mesh), with no new group. Returns one ``(global rank,
    *values)`` row per rank of the mesh (under a fake process group, which copies the
    input into every slot, ``W`` copies of this rank's row). Peak extra memory:
    ``W * (len(values) + 1)`` int64s."""
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    return _gather_rows(groups, values)


def group_gather_rows(group: dist.ProcessGroup, values: Sequence[int]) -> list[tuple[int, ...]]:
    """:func:`mesh_gather_rows` over one process group: one all-gather."""
    return _gather_rows([group] if dist.get_world_size(group) > 1 else [], values)


def _gather_rows(groups: list[dist.ProcessGroup], values: Sequence[int]) -> list[tuple[int, ...]]:
    device = _reduce_device(groups[0]) if groups else torch.device("cpu")
    block = torch.tensor([[dist.get_rank(), *values]], dtype=torch.int64, device=device)
    for group in groups:
        size = dist.get_world_size(group)
        out = torch.empty(size * block.numel(), dtype=torch.int64, device=device)
        all_gather_single(out, block.flatten().contiguous(), group=group)
        block = out.view(size * block.shape[0], block.shape[1])
    return sorted(tuple(int(v) for v in row) for row in block.tolist())


CALLS_ENV = "DTENSOR_EMA_AGREE_CALLS"
"""``0`` turns off the agreement on each collective call (:func:`agree_on_call`), which is
on by default: one all-gather of seven int64s per mesh dim before the call (measured in
``benchmarks/agreement.py``)."""

CallIdentity = Callable[[], tuple[int, int]]
"""``() -> (digest of which EMA or EMAs, update count)`` of a collective call's subject."""

_NAME_WORDS = 4  # a call's name travels as 32 UTF-8 bytes in 4 int64s


def agree_on_call(
    name: str,
    identity: CallIdentity,
    *,
    mesh: DeviceMesh | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Before the collective ``name``: every rank of ``mesh`` (or ``group``) checks that
    all ranks are making this call, on the same EMA (``identity``'s digest: its plan and
    options), after the same number of updates. Otherwise every rank raises the same error
    naming who called what, instead of pairing the wrong collectives (a row-by-row mix of
    two EMAs, or a hang). **Collective**: one all-gather of 7 int64s per mesh dim (the
    rank, 32 bytes of the call's name, the digest, the count; :func:`mesh_gather_rows`),
    or one over ``group``; nothing for one process, a one-rank mesh, or with
    ``DTENSOR_EMA_AGREE_CALLS=0``.

    Raises:
        ValueError: the ranks disagree.
    """
    if os.environ.get(CALLS_ENV, "1").strip() == "0":
        return
    if mesh is not None:
        if mesh.size() == 1:
            return
        gather = functools.partial(mesh_gather_rows, mesh)
    elif group is not None and dist.get_world_size(group) > 1:
        gather = functools.partial(group_gather_rows, group)
    else:
        return
    digest, count = identity()
    raw = name.encode()[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    rows = gather([*words, digest, count])
    if len({row[1:] for row in rows}) == 1:
        return
    by_row: dict[tuple[int, ...], list[int]] = {}
    for row in rows:
        by_row.setdefault(row[1:], []).append(row[0])
    parts = []
    for seen, ranks in by_row.items():
        called = b"".join(w.to_bytes(8, "little", signed=True) for w in seen[:_NAME_WORDS])
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(
            f"{who}: {called.rstrip(bytes(1)).decode(errors='replace')}() on EMA "
            f"{seen[_NAME_WORDS] & 0xFFFFFFFF:08x} at updates={seen[_NAME_WORDS + 1]}"
        )
    raise ValueError(
        f"{name}(): the ranks disagree on this collective call ({'; '.join(parts)}). Every "
        "rank must make the same collective calls, in the same order, on the same EMA (the "
        "same model, tracked set and options), after the same number of update() calls"
    )


def is_mesh_first(mesh: DeviceMesh | None) -> bool:
    """Whether this rank is the mesh's first (coordinate ``(0, ..., 0)``); ``True`` without
    a mesh."""
    if mesh is None:
        return True
    coordinate = mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c in coordinate)


def check_all_ranks_enter(mesh: DeviceMesh | None, name: str) -> None:
    """With ``DTENSOR_EMA_CHECK_COLLECTIVES=<seconds>``: a monitored barrier over each dim
    of ``mesh`` (gloo groups), so a rank that never calls ``name`` makes the others fail
    after that many seconds, naming the call and the missing ranks, instead of hanging."""
    if mesh is None or not os.environ.get(CHECK_ENV):
        return
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    _check_groups(groups, mesh.mesh.flatten().tolist(), name, "the EMA's mesh")


def check_group_enters(group: dist.ProcessGroup | None, name: str) -> None:
    """:func:`check_all_ranks_enter` over one process group (``None``: one process, no
    check)."""
    if group is None or not os.environ.get(CHECK_ENV) or dist.get_world_size(group) == 1:
        return
    _check_groups([group], dist.get_process_group_ranks(group), name, "the process group")


def _check_groups(groups: list[dist.ProcessGroup], ranks: list[int], name: str, what: str) -> None:
    seconds = os.environ.get(CHECK_ENV, "")
    try:
        timeout = timedelta(seconds=float(seconds))
    except ValueError:
        raise ValueError(f"{CHECK_ENV} must be a number of seconds, got {seconds!r}") from None
    for group in groups:
        if "gloo" not in str(dist.get_backend(group)):
            warnings.warn(
                f"{CHECK_ENV} checks only gloo groups; {name}() runs unchecked on "
                f"{dist.get_backend(group)}",
                stacklevel=4,
            )
            return
        try:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(
                f"{name}() is a collective: every rank of {what} (global ranks {ranks}) must "
                f"call it, but not all did within {seconds} s ({CHECK_ENV}): {e}"
            ) from e


_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed")


def collective(name: str, *, communicates: Callable[[Any], bool] | None = None) -> Callable[[F], F]:
    """Decorate a ``ModelEMA`` method that is a collective over ``self.mesh``.

    Runs :func:`check_all_ranks_enter` first, then :func:`agree_on_call` (which call, which
    EMA: ``self.engine.call_identity``, which update count), and turns a backend timeout
    inside the call (a rank never joined) into a ``RuntimeError`` that names the call.
    ``communicates(self)``: whether this call communicates at all (``False``: a local call
    on this layout, e.g. the swap of 1-D FSDP2 parameters, gets no agreement either).
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            mesh = getattr(self, "mesh", None)
            with entering(name, mesh=mesh):
                if communicates is None or communicates(self):
                    agree_on_call(name, self.engine.call_identity, mesh=mesh)
                return fn(self, *args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


@contextlib.contextmanager
def entering(
    name: str, *, mesh: DeviceMesh | None = None, group: dist.ProcessGroup | None = None
) -> Iterator[None]:
    """The block is the collective ``name`` over ``mesh`` or ``group`` (``None``: one
    process, nothing to check): :func:`check_all_ranks_enter` / :func:`check_group_enters`
    on entry, and a backend timeout inside it becomes a ``RuntimeError`` naming the call."""
    if mesh is not None:
        check_all_ranks_enter(mesh, name)
        ranks = mesh.mesh.flatten().tolist()
    elif group is not None:
        check_group_enters(group, name)
        ranks = dist.get_process_group_ranks(group)
    else:
        yield
        return
    try:
        yield
    except RuntimeError as e:
        text = str(e).lower()
        if not any(w in text for w in _TIMEOUT_WORDS) or CHECK_ENV in str(e):
            raise
        if os.environ.get(CHECK_ENV):  # every rank entered some checked call: not this one
            hint = (
                f"{CHECK_ENV} is set and no rank was missing at the entry check, so the ranks "
                "entered different collective calls (or the same calls in another order)"
            )
        else:
            hint = f"set {CHECK_ENV}=<seconds> to find the missing ranks early"
        raise RuntimeError(
            f"{name}() timed out in a collective: every rank (global ranks {ranks}) must call "
            f"it; {hint}"
        ) from e


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*assuming the intent is to", UserWarning)
        yield
