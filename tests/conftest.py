"""Test-wide settings: CPU-friendly threads, no wandb network, Triton's interpreter where CUDA is absent.

TRITON_INTERPRET must be set before any @triton.jit decorates a kernel, so it is set here at import time.
"""
import os
import sys

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture
def wide_interpreter_tiles(monkeypatch):
    """Tests of whole models under Triton's interpreter run their kernels on 64-row tiles (ops/triton_setup.py
    INTERPRETER_ROWS): the ops' own tests cover the tile and span boundaries at 4 rows."""
    import ops.triton_setup as ts

    monkeypatch.setattr(ts, "INTERPRETER_ROWS", 64)
