"""Saving and loading EMA checkpoints: commits that survive a crash, readers that trust nothing.

* :mod:`~dtensor_ema.checkpoint.save_load`: :func:`save_checkpoint` / :func:`load_checkpoint`
  around DCP (commit when every rank finished, staged loads, background saves through
  :mod:`~dtensor_ema.checkpoint.background`, one path and save id through
  :mod:`~dtensor_ema.checkpoint.same_path`, checksums through
  :mod:`~dtensor_ema.checkpoint.checksums`).
* :mod:`~dtensor_ema.checkpoint.reader`: every read of a checkpoint or snapshot, with no code
  run, over :mod:`~dtensor_ema.checkpoint.files` (the files as first seen),
  :mod:`~dtensor_ema.checkpoint.metadata_check`, :mod:`~dtensor_ema.checkpoint.coverage`,
  :mod:`~dtensor_ema.checkpoint.pickle_scan` and :mod:`~dtensor_ema.checkpoint.bounded_json`.
"""

from dtensor_ema.checkpoint.reader import (
    CheckpointChangedError,
    ChecksumError,
    UnverifiedCheckpointWarning,
)
from dtensor_ema.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointChangedError",
    "CheckpointError",
    "ChecksumError",
    "UnverifiedCheckpointWarning",
    "load_checkpoint",
    "save_checkpoint",
]
