"""Deprecated alias of scheduling.efficiency (renamed: it holds the step's efficiency formulas); kept for one release."""
import sys

import scheduling.efficiency as _module

sys.modules[__name__] = _module
