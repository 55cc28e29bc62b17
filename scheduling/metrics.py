"""Deprecated alias of scheduling.efficiency (renamed: it holds the step's efficiency formulas); kept for one release, with a FutureWarning on import."""
import sys
import warnings

import scheduling.efficiency as _module

warnings.warn(
    "scheduling.metrics is deprecated and will be removed in the next release: import scheduling.efficiency",
    FutureWarning, stacklevel=2)
sys.modules[__name__] = _module
