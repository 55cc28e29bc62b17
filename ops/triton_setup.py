"""What every fused op here shares around its kernels: Triton's availability and import, the interpreter, the store
cast, dtypes, and the launch-shape helpers (KernelConfig, tuned tables, persistent-grid spans, row segments).

No op lives here: each op's file (ops/adaln.py, ops/qk_norm_rope.py, ...) holds its kernels, launchers,
autograd.Function, functional API and plain-PyTorch reference, and imports these public names.

Triton is imported on first use (`import_triton`), never at module import: triton.language jits its own helpers
(tl.cdiv, tl.sum's combine) when it is imported, in whatever mode TRITON_INTERPRET names then, and the tests set it
only after finding no CUDA (tests/conftest.py). `HAS_TRITON` is a module constant, so torch.compile traces the
checks that read it.

backend, for every op: "torch" (the reference), "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "auto" (Triton
on CUDA tensors the op supports, the reference otherwise).

Launch shapes: a kernel's grid is a persistent one of `programs_per_sm · SMs` programs over all samples, each
owning a contiguous span of row tiles (`span`), or one tile per program (programs_per_sm = 0). A row of D features
is held as two power-of-two segments [0, BLOCK_A) and [BLOCK_A, BLOCK_A + BLOCK_B) (`segments`): D = 1536 =
1024 + 512 and 5120 = 4096 + 1024 need no masked lanes (one power-of-two tile would mask a quarter and three eighths).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels load and store
MAX_D = 16384  # one row lives in registers; wider rows would spill (auto falls back to the reference)

tl = None  # set by store_cast(): its jitted helpers resolve `tl` from this module's globals


# --------------------------------------------------------------------------------------------- Triton and interpreter
def interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton(op: str, available: bool) -> None:
    if not available:
        raise RuntimeError(f"{op}: backend='triton' needs the `triton` package (pip install triton); "
                           "use backend='torch' or 'auto'")


def import_triton(op: str, interpret: bool, available: bool):
    """(triton, triton.language), imported on first use by every fused op here: the interpreter must have been
    chosen (TRITON_INTERPRET) before triton's first import, which this checks."""
    require_triton(op, available)
    import triton
    import triton.language as tl

    if interpret and type(tl.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError(f"{op}: TRITON_INTERPRET=1 was set after triton was imported; set it before any import "
                           "of triton (tests/conftest.py does so when CUDA is absent)")
    return triton, tl


def _cast_impl(v, dtype: tl.constexpr):
    return v.to(dtype)


def _cast_rne_impl(v, dtype: tl.constexpr):
    # Triton's interpreter casts fp32 → bf16 by truncation, the GPU to nearest even: under the interpreter the
    # kernels store through this cast, which rounds to the nearest-even bf16 by integer arithmetic first (as
    # ops/qk_norm_rope.py), so CPU tests see the GPU's numbers. The GPU compiles _cast_impl: a plain cast.
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


def device_fn(triton_, fn, interpret: bool):
    """fn as a helper the kernels call: jitted on the GPU. Under the interpreter, the function as the interpreter
    rewrites it, called as plain Python: the kernel calling it has already patched triton.language for its run,
    and Triton's interpreter (3.9) patches it again on every helper call (one store cast a store: 5-17 % of a tiny
    qk-norm or AdaLN step's interpreted time)."""
    jitted = triton_.jit(fn)
    return jitted.rewrite() if interpret and hasattr(jitted, "rewrite") else jitted


def store_cast(interpret: bool):
    """The jitted store cast the kernels of a module call as `_cast(v, PTR.dtype.element_ty)` (after that module's
    import_triton, so `tl` exists for the annotations)."""
    global tl
    triton_, tl = import_triton("store_cast", interpret, HAS_TRITON)
    return device_fn(triton_, _cast_rne_impl if interpret else _cast_impl, interpret)


# ------------------------------------------------------------------------------------------------------ launch shapes
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one kernel. rows: rows per tile; programs_per_sm: the persistent grid's programs per SM
    (over all samples; each program owns a contiguous span of tiles), 0 = one tile per program; block_d: features per
    program (the D-tile kernel only; 0 = all of D); split: a row as two unmasked power-of-two segments, or one
    masked tile (None: split when the smaller segment still gets 16-byte vectors); num_stages: software-pipelining
    depth of the loop over a program's tiles."""
    rows: int
    num_warps: int
    programs_per_sm: int
    block_d: int = 0
    split: bool | None = None
    num_stages: int = 1


# Rows a tile under the interpreter (CPU tests), which pays per tile and op, not per row: 4 makes the ops' own tests
# cross tile and span boundaries at small shapes; tests of whole models, whose boundaries those tests cover, widen it
# (tests/conftest.py, wide_interpreter_tiles: 64 rows run a tiny model's kernels 3-5x faster).
INTERPRETER_ROWS = 4


def interpreter_config(**kw) -> KernelConfig:
    """The launch shape off CUDA (the interpreter): few, wide programs (~1 ms per program and per loop step)."""
    return KernelConfig(rows=INTERPRETER_ROWS, num_warps=4, programs_per_sm=2, **kw)


def nearest_tuned(table: dict, prefix: tuple, D: int) -> tuple[int, KernelConfig]:
    """(D0, config) of the tuned entry whose key is prefix + (D0,) with D0 nearest D on a log scale (the ops'
    TUNED tables: a width not tuned starts from its nearest tuned neighbour)."""
    D = max(D, 1)  # an empty width launches nothing, but still asks for a shape (on CUDA: log2 of k / 0 raised)
    key = min((k for k in table if k[:-1] == prefix), key=lambda k: abs(math.log2(k[-1] / D)))
    return key[-1], table[key]


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def span(n_tiles: int, B: int, cfg: KernelConfig, device: torch.device) -> tuple[int, int]:
    """(programs per sample, tiles per program) for a grid of contiguous spans."""
    if n_tiles == 0:
        return 0, 1
    target = n_tiles if cfg.programs_per_sm == 0 else max(1, cdiv(cfg.programs_per_sm * sm_count(device), B))
    tiles_per_prog = cdiv(n_tiles, min(n_tiles, target))
    return cdiv(n_tiles, tiles_per_prog), tiles_per_prog


def segments(D: int, cfg: KernelConfig, elem_bytes: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B): a row as two power-of-two segments (the module docstring). An empty segment b is one
    masked lane."""
    block_a = 1 << (D.bit_length() - 1)
    block_b = next_pow2(D - block_a) if D > block_a else 1
    split = cfg.split
    if split is None:  # a thread's share of the small segment should fill a 16-byte load
        split = block_b == 1 or cfg.rows * block_b * elem_bytes >= 16 * 32 * cfg.num_warps
    return (block_a, block_b) if split else (next_pow2(D), 1)


def mod_layout(t: torch.Tensor, B: int, N: int) -> tuple[bool, int, int, int]:
    """(per token, batch stride, token stride, feature stride) of a [B|1, N|1, D] modulation; stride 0 broadcasts."""
    per_token = t.shape[1] == N and N > 1
    return per_token, t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if per_token else 0, t.stride(2)


def on_device(device: torch.device):
    """Launch on the tensors' GPU; entering a device context costs more than the small launches it guards."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def rows_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()  # x and dy: rows are read contiguously
