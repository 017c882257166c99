"""The chunked offload pipeline (``offload=True`` on CUDA once proven on a GPU), its pure
planning on CPU, and which updater ``offload=True`` picks.

:func:`offload_chunks` and :func:`host_runs` decide every copy the CUDA pipeline makes; they
are pure and checked here. :class:`ChunkedOffloadUpdater` runs the same pipeline inline on
a device without streams, so its slicing, merging and upcasting are checked on CPU against
the inline EMA and a reference written here, with chunks small enough to split tensors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import mismatches
from torch import nn

import dtensor_ema.engine as engine
from dtensor_ema import ModelEMA
from dtensor_ema.update import updater as updaters
from dtensor_ema.update.updater import (
    ChunkedOffloadUpdater,
    OffloadUpdater,
    host_runs,
    offload_chunks,
)


@pytest.mark.parametrize(
    ("numels", "chunk"),
    [
        ([5, 0, 3, 12, 1], 4),
        ([5, 0, 3, 12, 1], 1),
        ([5, 0, 3, 12, 1], 100),
        ([8, 8], 8),
        ([0, 0], 3),
        ([], 3),
        ([7], 3),
    ],
)
def test_offload_chunks_cover_every_element_once_within_the_bound(
    numels: list[int], chunk: int
) -> None:
    chunks = offload_chunks(numels, chunk)
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in chunks:
        assert c, "no empty chunk"
        assert sum(b - a for _, a, b, _ in c) <= chunk
        offset = 0
        for index, start, stop, at in c:
            assert stop > start and at == offset
            offset += stop - start
            covered.setdefault(index, []).append((start, stop))
    # Every chunk but the last is full (fewest chunks).
    assert all(sum(b - a for _, a, b, _ in c) == chunk for c in chunks[:-1])
    for index, numel in enumerate(numels):
        pieces = covered.get(index, [])
        if pieces:
            assert [a for a, _ in pieces] == [0] + [b for _, b in pieces[:-1]]
        assert sum(b - a for a, b in pieces) == numel
    order = [i for c in chunks for i, *_ in c]
    assert order == sorted(order)
    assert len(chunks) == math.ceil(sum(numels) / chunk)


def test_offload_chunks_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="chunk_numel must be an int >= 1, got 0"):
        offload_chunks([3], 0)
    with pytest.raises(ValueError, match=r"numels\[1\] must be >= 0, got -2"):
        offload_chunks([3, -2], 4)


def test_host_runs_merge_adjacent_slices_only() -> None:
    # Tensors 0 and 1 adjacent in storage 7; tensor 2 in another storage; tensor 3 after a gap.
    starts = [(7, 0), (7, 5), (9, 0), (7, 20)]
    chunk = [(0, 2, 5, 0), (1, 0, 4, 3), (2, 0, 2, 7), (3, 0, 1, 9)]
    assert host_runs(chunk, starts) == [(7, 2, 0, 7), (9, 0, 7, 2), (7, 20, 9, 1)]
    # Same storage, a gap between the tensors: two copies.
    assert host_runs([(0, 0, 5, 0), (1, 0, 2, 5)], [(7, 0), (7, 10)]) == [
        (7, 0, 0, 5),
        (7, 10, 5, 2),
    ]
    # A tensor split across chunks: the second chunk's run starts where the first ended.
    first, second = offload_chunks([6, 4], 5)
    assert host_runs(first, [(1, 0), (1, 6)]) == [(1, 0, 0, 5)]
    assert host_runs(second, [(1, 0), (1, 6)]) == [(1, 5, 0, 5)]
    assert host_runs(second, [(1, 0), (2, 0)]) == [(1, 5, 0, 1), (2, 0, 1, 4)]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(11, 13)
        self.register_buffer("stat", torch.randn(5))


def _perturb(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.1)


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_offload_equals_inline_and_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bucket_view: bool
) -> None:
    """28-byte chunks (7 fp32 values) split most tensors; a channels_last conv weight
    moves whole; ``fc.bias`` is copied; the first call copies (update_after_step)."""
    made: list[ChunkedOffloadUpdater] = []

    def chunked(groups: Any, *, capturable: bool, offload: bool, **_: Any) -> Any:
        assert offload and not capturable
        made.append(ChunkedOffloadUpdater(groups, chunk_bytes=28))
        return made[-1]

    model = ConvNet().to(dtype)
    model.conv.to(memory_format=torch.channels_last)
    opts: dict[str, Any] = {"decay": 0.8, "tau": 2.0, "update_after_step": 1}
    inline = ModelEMA(model, exclude=["fc.bias"], **opts)
    monkeypatch.setattr(engine, "make_updater", chunked)
    offloaded = ModelEMA(
        model, exclude=["fc.bias"], offload=True, parameters_as_bucket_view=bucket_view, **opts
    )
    assert len(made) == 1
    plans = made[0]._plans
    slices = sum(len(c) for p in plans for c in p[2])
    runs = sum(len(r) for p in plans for r in p[3])
    assert runs < slices if bucket_view else runs == slices
    assert any(p[5] for p in plans), "the channels_last weight moves whole"
    ref = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    for step in range(1, 6):
        _perturb(model, step)
        inline.update()
        offloaded.update()
        d = 0.0 if step <= 1 else 0.8 * (1 - math.exp(-(step - 1) / 2.0))
        for k, v in model.state_dict().items():
            ref[k].lerp_(v.float(), 1 - d) if k != "fc.bias" else ref[k].copy_(v.float())
    assert all(torch.isfinite(v).all() for v in ref.values())
    got = {k: v.detach().clone() for k, v in offloaded.ema_tensors().items()}
    assert mismatches(got, {k: v.detach() for k, v in inline.ema_tensors().items()}) == []
    assert mismatches(got, ref) == []
    assert offloaded.updates == inline.updates == 5
    offloaded.close()


def test_cpu_models_keep_the_worker_thread_and_chunk_size_is_checked() -> None:
    ema = ModelEMA(nn.Linear(3, 2), offload=True)
    assert isinstance(ema.engine.updater, OffloadUpdater)
    ema.close()
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1, got 0"):
        ChunkedOffloadUpdater([], chunk_bytes=0)


def test_cuda_offload_uses_the_path_last_proven_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``offload=True`` on CUDA takes the snapshot + worker updater (the one the last GPU run
    measured) until ``CUDA_OFFLOAD`` names the chunked pipeline; CPU models and non-lerp
    formulas always take the worker (issue 25)."""
    made: list[str] = []
    monkeypatch.setattr(updaters, "OffloadUpdater", lambda groups: made.append("worker"))
    monkeypatch.setattr(updaters, "ChunkedOffloadUpdater", lambda groups: made.append("chunked"))

    def groups(device: str, formula: str = "lerp") -> list[Any]:
        source = SimpleNamespace(device=torch.device(device))
        return [SimpleNamespace(source_locals=[source], formula=formula)]

    def pick(*args: Any) -> str:
        engine.make_updater(groups(*args), capturable=False, offload=True)
        return made.pop()

    assert updaters.CUDA_OFFLOAD == "worker"
    assert [pick("cuda"), pick("cpu")] == ["worker", "worker"]
    monkeypatch.setattr(updaters, "CUDA_OFFLOAD", "chunked")
    assert [pick("cuda"), pick("cpu"), pick("cuda", "subtract")] == ["chunked", "worker", "worker"]
