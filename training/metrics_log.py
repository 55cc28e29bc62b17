"""Deprecated alias of training.metrics (renamed: one module holds the metrics row and its logger); kept for one release."""
import sys

import training.metrics as _module

sys.modules[__name__] = _module
