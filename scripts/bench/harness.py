"""What the benchmarks in scripts/bench/ share: the output folder, timing, error figures, formatting, CSV/JSON.

Each benchmark imports it as `import harness` (a script's own folder is on sys.path). A benchmark writes into
`--out DIR` (default runs/bench/NAME; never results/ unless named): its rows as NAME.json (with a `meta` block:
device, date, versions, command) and NAME.csv. Benchmarks never assert: a failing implementation is a row that says
so.

Timing: `time_reps` is one forward + backward (or any callable) after warm-up, the device synchronised around each
repeat, the median reported (a shared machine only slows a repeat down; the median ignores the stragglers).
The memory-bound op benchmarks use `timer`: triton.testing.do_bench (CUDA events, L2 flushed before each call,
median) on a GPU, a single timed call on a CPU (a dry run under TRITON_INTERPRET=1: its numbers mean nothing).
"""
from __future__ import annotations

import csv
import datetime
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------ the output folder
def default_out(name: str) -> str:
    """runs/bench/NAME under the repo root: where a benchmark writes unless --out names a folder."""
    return os.path.join(ROOT, "runs", "bench", name)


def add_out(parser, name: str) -> None:
    """The --out DIR option every benchmark takes."""
    parser.add_argument("--out", default=default_out(name),
                        help=f"output folder (default runs/bench/{name}; nothing under results/ unless named)")


def add_op_options(parser, name: str, kernels: list) -> None:
    """The options every op benchmark takes: --out, --name (the files' stem: NAME_h200), --no-compile, --sweep and
    its --kernels, --rep-ms. Each adds its own shapes (and --tuned where its op has a TUNED table)."""
    add_out(parser, name)
    parser.add_argument("--name", default=f"{name}_h200", help=f"file stem of the outputs (default {name}_h200)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    parser.add_argument("--sweep", action="store_true", help="time the kernels over launch shapes instead")
    parser.add_argument("--kernels", nargs="+", default=list(kernels), help="--sweep: which kernels")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="milliseconds of repetitions a timing")


def wan_inputs(cfg: dict, shape, dev, dtype, text_len: int, seed: int = 0):
    """(latents [B, C, F, H, W], timesteps [B], text [B, text_len, text_dim]) of a Wan step at shape (B, F, H, W),
    seeded on the CPU so every column and device sees the same values; cfg: diffusers' Wan config."""
    import torch

    B, F, H, W = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg["in_channels"], F, H, W, generator=g).to(dev, dtype)
    t = (torch.rand(B, generator=g) * 1000).to(dev)
    ctx = torch.randn(B, text_len, cfg["text_dim"], generator=g).to(dev, dtype)
    return x, t, ctx


def run_meta(device=None) -> dict:
    """The run's context: date, command, torch version and device (a GPU's name, or cpu)."""
    meta = {"date": datetime.date.today().isoformat(), "command": " ".join([os.path.basename(sys.executable)]
                                                                           + sys.argv)}
    if device is not None:
        import torch

        meta.update(torch=torch.__version__,
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return meta


def write_rows(out: str, name: str, meta: dict, rows: list[dict], csv_too: bool = True) -> str:
    """OUT/NAME.json ({"meta", "rows"}) and OUT/NAME.csv (one column per key any row has); returns OUT/NAME.
    Called after every shape, so a run cut short keeps what it measured."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    with open(stem + ".json.tmp", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    os.replace(stem + ".json.tmp", stem + ".json")
    if csv_too:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(stem + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    return stem


# ------------------------------------------------------------------------------------------------------ timing
def sync(dev) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def median(values):
    """The upper median (the middle one of an odd count), as every benchmark here has reported it."""
    return sorted(values)[len(values) // 2]


def time_reps(run, dev, warmup: int, reps: int, gc_off: bool = False) -> tuple[list[float], float]:
    """(ms of each repeat, peak GiB since the warm-up) of run(): warm-up calls, then each repeat between two device
    syncs on the host clock. gc_off: Python's collector runs before each repeat and is paused inside it. The peak is
    NaN on a CPU (the allocator's statistics are CUDA's)."""
    import torch

    for _ in range(warmup):
        run()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(reps):
        if gc_off:
            gc.collect()
            gc.disable()
        sync(dev)
        t0 = time.perf_counter()
        try:
            run()
            sync(dev)
        finally:
            gc.enable()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return times, peak


def timer(rep_ms: float):
    """bench(fn) → median ms: triton.testing.do_bench on a GPU (compile/autotune outside the timing), one timed
    call on a CPU (a dry run)."""
    import torch

    if torch.cuda.is_available():
        import triton.testing

        def bench(fn):
            fn()  # compile/autotune outside the timing
            return triton.testing.do_bench(fn, warmup=max(5, rep_ms / 4), rep=rep_ms, return_mode="median")
    else:  # a dry run on CPU (TRITON_INTERPRET=1) checks the script, its numbers mean nothing
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    return bench


def copy_bandwidth(bench, device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (bench(lambda: dst.copy_(src)) * 1e-3)


# ---------------------------------------------------------------------------------------- figures and formatting
def rel_err(a, ref) -> float:
    """‖a − ref‖ / ‖ref‖: a sanity figure beside the timings (the tests hold the real checks)."""
    return ((a.float() - ref).norm() / ref.norm()).item()


def fmt(v, spec: str) -> str:
    """v formatted by spec, or "-" where it was not measured."""
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def error_text(e: Exception, n: int = 200) -> str:
    """A failure as a row records it: the exception's type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:n] if str(e) else ''}"


def add_rates(rec: dict, floor_of, elems: int, copy_bw: float) -> None:
    """Per phase measured: GB/s of the phase's floor bytes (floor_of(phase)) and its share of the device-copy
    bandwidth; saved bytes per element where measured."""
    for phase in ("fwd", "bwd"):
        ms = rec.get(f"{phase}_ms")
        if ms is not None:
            floor = floor_of(phase)
            rec[f"{phase}_GBps"] = floor / (ms * 1e-3) / 1e9
            rec[f"{phase}_pct_copy"] = 100 * floor / copy_bw / (ms * 1e-3)
    if "saved_bytes" in rec:
        rec["saved_B_per_elem"] = rec["saved_bytes"] / elems
        rec["saved_new_B_per_elem"] = rec["saved_new_bytes"] / elems


def saved_bytes_of(fn, args, kept=(), callers=()):
    """(bytes of every tensor autograd saves while fn(*args) runs, bytes of those that are new allocations), unique
    storages. kept: tensors whose storage is not counted (the model holds them anyway); callers: inputs counted but
    not as new (saving them keeps alive what would otherwise be freed)."""
    import torch

    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    skip, old = {ptr(t) for t in kept}, {ptr(t) for t in callers}
    seen, total, new = set(), 0, 0

    def pack(t):
        nonlocal total, new
        p = ptr(t)
        if p not in seen and p not in skip:
            seen.add(p)
            total += t.untyped_storage().nbytes()
            new += 0 if p in old else t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total, new


# ------------------------------------------------------------------------------------- the op benchmarks' session
def load_tuned(path: str) -> dict:
    """{(kernel, per_token, D): KernelConfig} from a sweep's JSON: the fastest launch shape per kernel and shape."""
    from ops.triton_setup import KernelConfig

    best = {}
    for r in json.load(open(path))["rows"]:
        key = (r["kernel"], r["kind"] == "token", r["D"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return {k: KernelConfig(r["rows"], r["num_warps"], r["programs_per_sm"], r["block_d"], r["split"],
                            r["num_stages"]) for k, r in best.items()}


def run_bench(args, op_name: str, meta_of, run_table, run_sweep, cache_size: int = 256) -> None:
    """The session every op benchmark shares: the interpreter on a CPU (a dry run), compile limits, the op's tuned
    launch shapes (--tuned), the copy bandwidth measured in the same run, and rows saved as JSON + CSV after every
    shape (harness.write_rows). meta_of(op module) → the op's own metadata (byte floors, launch shapes, ...)."""
    import importlib

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if hasattr(torch, "_dynamo"):
        torch._dynamo.config.cache_size_limit = cache_size  # one graph per shape: dynamic=False, fair to compile
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = cache_size
    op = importlib.import_module(f"ops.{op_name}")
    if getattr(args, "tuned", None):
        op.TUNED.update(load_tuned(args.tuned))
    bench = timer(args.rep_ms)
    copy_bw = copy_bandwidth(bench, device)
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "copy_GBps": copy_bw / 1e9,
            **meta_of(op)}
    print(f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']} copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    name = args.name + ("_sweep" if args.sweep else "")
    (run_sweep if args.sweep else run_table)(args, bench, device, copy_bw,
                                             lambda rows: write_rows(args.out, name, meta, rows))
    print(f"wrote {os.path.join(args.out, name)}.csv/.json")
