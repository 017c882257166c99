"""Post-hoc EMA (EDM2): track power-function EMAs sharded, snapshot them, and choose the EMA
length after training.

* :class:`PostHocEMA` tracks the profiles (no communication per update) and writes sharded
  DCP snapshots with a manifest.
* :func:`synthesize` reconstructs any ``sigma_rel`` from the snapshots, streaming bucket by
  bucket, in one process or distributed; :func:`merge_snapshots` averages snapshots with
  explicit weights.
* ``python -m dtensor_ema.posthoc {list,synthesize,merge} ...`` does both from the shell.

The formulas are in :mod:`dtensor_ema.posthoc.phema_math`.
"""

from dtensor_ema.posthoc.ema import PostHocEMA, PowerDecay
from dtensor_ema.posthoc.snapshots import Snapshot, SnapshotError, list_snapshots
from dtensor_ema.posthoc.synthesis import Term, merge_snapshots, plan_synthesis, synthesize

__all__ = [
    "PostHocEMA",
    "PowerDecay",
    "Snapshot",
    "SnapshotError",
    "Term",
    "list_snapshots",
    "merge_snapshots",
    "plan_synthesis",
    "synthesize",
]
