"""Deprecated alias of scheduling.planner (renamed: it plans every strategy); kept for one release, with a FutureWarning on import."""
import sys
import warnings

import scheduling.planner as _module

warnings.warn(
    "scheduling.balance is deprecated and will be removed in the next release: import scheduling.planner",
    FutureWarning, stacklevel=2)
sys.modules[__name__] = _module
