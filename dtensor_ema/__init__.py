"""dtensor_ema: an exponential moving average of model weights, sharded across ranks.

Each EMA tensor is a DTensor (``Shard(0)`` over a 1-D mesh; FSDP2 parameters keep their own
mesh and placements), updated locally with no communication, materialized only on request,
and checkpointed with ``torch.distributed.checkpoint`` at any world size.
"""

from importlib.metadata import PackageNotFoundError, version

from dtensor_ema.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dtensor_ema.decay import (
    CallableDecay,
    ConstantDecay,
    DecaySchedule,
    HalfLifeDecay,
    RampDecay,
    RunningMeanDecay,
    WarmupDecay,
)
from dtensor_ema.export import convert_checkpoint, export_ema
from dtensor_ema.layout import chunk_range
from dtensor_ema.model_ema import ModelEMA
from dtensor_ema.multi import MultiModelEMA
from dtensor_ema.options import AveragingFunction
from dtensor_ema.posthoc import PostHocEMA, merge_snapshots, synthesize

try:
    __version__ = version("dtensor_ema")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AveragingFunction",
    "CallableDecay",
    "CheckpointError",
    "ConstantDecay",
    "DecaySchedule",
    "HalfLifeDecay",
    "ModelEMA",
    "MultiModelEMA",
    "PostHocEMA",
    "RampDecay",
    "RunningMeanDecay",
    "WarmupDecay",
    "__version__",
    "chunk_range",
    "convert_checkpoint",
    "export_ema",
    "load_checkpoint",
    "merge_snapshots",
    "save_checkpoint",
    "synthesize",
]
