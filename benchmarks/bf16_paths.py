"""Ways to update an fp32 EMA from bf16 parameters, timed on one process (CPU or CUDA).

    python benchmarks/bf16_paths.py                  # ResNet-50, CPU, 1 thread
    python benchmarks/bf16_paths.py --model gpt2 --device cuda

* ``upcast_lerp``: ``_foreach_lerp_(ema, [s.to(fp32) for s in src], w)``: fresh fp32
  temporaries every step (what dtensor_ema does today for mixed dtypes).
* ``staged_lerp``: the same arithmetic, upcasting tensor by tensor into one reused fp32
  buffer (no fresh memory); bit-identical to ``upcast_lerp`` (checked here).
* ``mul_add``: ``_foreach_mul_(ema, d); _foreach_add_(ema, src, alpha=1 - d)`` (timm V3 for
  mixed dtypes): no temporary, a different rounding (<= ~5e-7 from lerp).
* ``fp32_lerp``: lerp from fp32 sources, the bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import build_model, get_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build_model(get_spec(args.model), torch.bfloat16, device)
    unique = {id(t): t.detach() for t in model.state_dict(keep_vars=True).values()}
    src = [t for t in unique.values() if t.is_floating_point()]
    ema = [t.float().clone() for t in src]
    stage = torch.empty(max(t.numel() for t in src), device=device)
    w = 1e-3

    def upcast_lerp() -> None:
        torch._foreach_lerp_(ema, [s.to(torch.float32) for s in src], w)

    def staged_lerp() -> None:
        for e, s in zip(ema, src, strict=True):
            buf = stage[: s.numel()].view(s.shape)
            buf.copy_(s)
            e.lerp_(buf, w)

    def mul_add() -> None:
        torch._foreach_mul_(ema, 1 - w)
        torch._foreach_add_(ema, src, alpha=w)

    fp32_src = [s.float() for s in src]

    def fp32_lerp() -> None:
        torch._foreach_lerp_(ema, fp32_src, w)

    # Same arithmetic, same bits: staged == upcast.
    start = [e.clone() for e in ema]
    upcast_lerp()
    after_upcast = [e.clone() for e in ema]
    for e, s in zip(ema, start, strict=True):
        e.copy_(s)
    staged_lerp()
    exact = all(torch.equal(a, b) for a, b in zip(ema, after_upcast, strict=True))

    impls: dict[str, Callable[[], None]] = {
        "upcast_lerp": upcast_lerp,
        "staged_lerp": staged_lerp,
        "mul_add": mul_add,
        "fp32_lerp": fp32_lerp,
    }
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():
        fn()
    for rep in range(args.reps):
        names = list(impls)
        for name in names[rep % 4 :] + names[: rep % 4]:
            sync()
            t0 = time.perf_counter()
            impls[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    numel = sum(s.numel() for s in src)
    print(f"{args.model}: {numel / 1e6:.1f}M bf16 values in {len(src)} tensors on {device}")
    for name, samples in times.items():
        print(f"  {name:12s} {statistics.median(samples) * 1e3:8.2f} ms (median of {args.reps})")
    print(f"  staged_lerp bit-identical to upcast_lerp: {exact}")


if __name__ == "__main__":
    main()
