"""``python -m dtensor_ema.posthoc``: see :mod:`dtensor_ema.posthoc.cli`."""

from dtensor_ema.posthoc.cli import main

raise SystemExit(main())
