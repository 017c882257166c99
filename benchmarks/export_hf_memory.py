"""Peak host memory of torchtitan's Hugging Face export of an EMA, on one rank of a large job.

One process acts as rank ``--rank`` of ``--world`` ranks (torch's fake process group:
collectives return at once, so only this rank's own memory is real). torchtitan 0.3.0's
llama3 model of ``--flavor`` (Llama-3 shapes; cut to ``--layers`` blocks so that a whole
copy still fits a small host for the comparison) is built on the meta device, sharded with
``fully_shard`` (each block, then the root) over the world, and only this rank's shards
are allocated (bf16 parameters, fp32 EMA). Side by side, each measured as the peak
resident set size above the size just before (``/proc/self/clear_refs``, ``VmHWM``;
run with glibc's mmap threshold lowered, so freed buffers leave the heap):

* ``streamed``: :func:`dtensor_ema.integrations.torchtitan.hf.stream_hf` (what
  ``EMATrainer.export_hf`` runs): buckets of ``--bucket-mib`` of full tensors gathered to
  the writer, converted with torchtitan's ``to_hf`` and written tensor by tensor;
* ``whole``: the export before this change, the whole EMA gathered on rank 0
  (``get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)``) then written;
* ``another stage``: the streamed export as the first rank of a pipeline stage without
  rank 0 (rank ``W/2``; its buckets are all-gathered, then written by it). Before, every
  rank of such a stage gathered its stage's whole part, and its first rank pickled it
  once more to send it to rank 0.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/export_hf_memory.py --flavor 8B --layers 2

Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from rss import reset_peak, status_kib  # noqa: E402
from shapes import fake_world, materialize  # noqa: E402

from dtensor_ema.integrations.torchtitan import TorchtitanEMA  # noqa: E402
from dtensor_ema.integrations.torchtitan.hf import export_hf, stream_hf  # noqa: E402

MIB = 1024 * 1024


def _peak_mib(fn: Any) -> float:
    """Peak resident MiB above the resident size before ``fn()``."""
    gc.collect()
    before = reset_peak()
    fn()
    gc.collect()
    return (status_kib("VmHWM") - before) / 1024


def _build(spec: Any, tag: str) -> tuple[Any, Any]:
    """This rank's shards of the model (bf16) and its EMA (fp32), FSDP2 over the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = spec.model.build().to(torch.bfloat16)
    # A new dim name per fake world: torch reuses an equal mesh made in an earlier one.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(f"dp{tag}",))
    for block in model.layers.values():  # torchtitan's layers: a ModuleDict
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, "cpu")
    return model, TorchtitanEMA(
        TorchtitanEMA.Config(enable=True, decays=[0.999]), model_parts=[model]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B", help="torchtitan llama3 flavor (Llama-3 shapes)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--bucket-mib", type=int, default=256)
    args = parser.parse_args()
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(args.flavor)
    spec.model.layers = spec.model.layers[: args.layers]
    adapter = spec.state_dict_adapter(spec.model, None)
    bucket = args.bucket_mib * MIB
    rows = []
    with tempfile.TemporaryDirectory() as out:
        with fake_world(args.world, rank=0):
            model, ema = _build(spec, "a")
            sizes = [v.numel() * 2 for v in model.state_dict().values()]  # bf16 full tensors
            total, largest = sum(sizes), max(sizes)
            rows.append(("streamed, rank 0 writes", _peak_mib(
                lambda: stream_hf(ema, [model], adapter, Path(out, "a"), bucket_bytes=bucket)
            )))  # fmt: skip

            def whole() -> None:
                state = ema.get_ema_state_dict(only_rank0_receives=True, cpu_offload=True)
                export_hf(state, adapter, Path(out, "c"))

            rows.append(("whole model on rank 0 (before)", _peak_mib(whole)))
            del model, ema
        half = args.world // 2
        with fake_world(args.world, rank=half):
            model, ema = _build(spec, "b")
            stage = list(range(half, args.world))  # a stage without rank 0: this rank writes
            Path(out, "b").mkdir()  # rank 0 would have written the header: its file, as made
            shutil.copyfile(
                Path(out, "a", "model.safetensors"), Path(out, "b", "model.safetensors")
            )
            rows.append(("streamed, first rank of another stage", _peak_mib(
                lambda: stream_hf(ema, [model], adapter, Path(out, "b"), bucket_bytes=bucket,
                                  stage_ranks=stage)
            )))  # fmt: skip
    print(
        f"torchtitan llama3 {args.flavor} shapes, {args.layers} layers: full weights "
        f"{total / MIB:.0f} MiB (bf16), largest tensor {largest / MIB:.0f} MiB, bucket "
        f"{args.bucket_mib} MiB; one rank of W={args.world} (fake process group), torch "
        f"{torch.__version__}"
    )
    print("export                                  peak extra MiB  / (largest + bucket)  / full")
    for label, peak in rows:
        print(f"{label:<39} {peak:>14.0f}  {peak * MIB / (largest + bucket):>20.2f}  "
              f"{peak * MIB / total:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
