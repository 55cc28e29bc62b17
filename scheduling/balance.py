"""Deprecated alias of scheduling.planner (renamed: it plans every strategy); kept for one release."""
import sys

import scheduling.planner as _module

sys.modules[__name__] = _module
