"""Deprecated alias of training.metrics (renamed: one module holds the metrics row and its logger); kept for one release, with a FutureWarning on import."""
import sys
import warnings

import training.metrics as _module

warnings.warn(
    "training.metrics_log is deprecated and will be removed in the next release: import training.metrics",
    FutureWarning, stacklevel=2)
sys.modules[__name__] = _module
