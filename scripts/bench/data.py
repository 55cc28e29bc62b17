"""Benchmark the raw-data path on this machine's CPU: clips decoded/s and samples/s per loader worker.

    python scripts/bench/data.py                       (≈ 3 min on 2 cores; the corpora are cached in .cache/)
    python scripts/bench/data.py --videos 24 --images 48 --seconds 10 --out DIR

Cases (what a loader worker does for one sample of the bucket):
    480p 33f clip   3 s 854×480 h264 (libx264 veryfast, crf 23, keyframe every 2 s) at 30 fps → bucket v480_33f:
                    33 frames at 16 fps (a random clip: seek to the keyframe before it, decode to its last frame),
                    resized to cover 480×832 and centre-cropped
    720p image      1280×720 jpg (q 90) → bucket i720
Rows: `decode` = decode_video / decode_image from bytes in memory (uint8 out); `sample` = what a Loader worker runs
per sample: pread from the shard, caption, decode (the cast to float [−1, 1] happens on the encoder's device).
Each is timed on 1 worker, then on N worker threads and N worker processes (processes pay for pickling frames back);
each number is the best of five windows, since other work on a shared machine only slows a window down.
Prints a table and writes OUT/data_loading.json (--out, default runs/bench/data); results/data_loading.md discusses
the numbers against the H200 step times (how many workers keep one GPU fed per bucket).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repo root, ahead of this folder: `data` is the package, not this file

import harness  # noqa: E402

# Wan 2.1 1.3B on one H200 (fwd + bwd, the scheduling calibration): (B, S) → ms
H200_STEPS = {"i480": (16, 1560, 848.0), "v480_33f": (2, 14040, 1459.0)}

_CORPUS = {}


def _worker_init(root: str, bucket: str, fps: float):
    from data.buckets import bucket_table
    from data.index import SampleIndex
    from data.raw import RawConfig
    from training.config import compose_config

    table = bucket_table(compose_config(["data=wan"]).data.buckets)
    _CORPUS.update(index=SampleIndex.load(root), bucket=table[bucket], raw=RawConfig(fps=fps))


def _sample(args) -> int:
    """One loader sample as a worker reads it: pread + caption + decode. Returns the bytes of pixels produced."""
    from data.raw import load_raw

    row, start = args
    return load_raw(_CORPUS["index"], row, _CORPUS["bucket"], _CORPUS["raw"], start)[0].nbytes


def _decode(args) -> int:
    from data.decode import decode_image, decode_video

    row, start = args
    ix, b, raw = _CORPUS["index"], _CORPUS["bucket"], _CORPUS["raw"]
    r = ix.records[row]
    data = ix.read(row, r["media"])
    if r["kind"] == "image":
        return decode_image(data, b.height, b.width).nbytes
    return decode_video(data, b.frames, b.height, b.width, raw.fps, start).nbytes


def _return_frames(args):
    """For process workers: the uint8 pixels themselves, as a process loader must hand them back."""
    from data.raw import load_raw

    row, start = args
    return load_raw(_CORPUS["index"], row, _CORPUS["bucket"], _CORPUS["raw"], start)[0]


def _timed(fn, jobs, workers: int, kind: str, root: str, bucket: str, fps: float, min_s: float,
           windows: int = 5) -> float:
    """Items per second of fn over jobs on `workers` threads or processes: the best of `windows` windows of at
    least min_s each (the best, because other work on a shared machine only ever slows a window down)."""
    if kind == "serial":
        run = lambda: [fn(j) for j in jobs]  # noqa: E731
        ex = None
    else:
        if kind == "thread":
            ex = ThreadPoolExecutor(workers)
        else:
            import multiprocessing as mp

            ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                     initargs=(root, bucket, fps))
        run = lambda: list(ex.map(fn, jobs))  # noqa: E731
    try:
        list(ex.map(fn, jobs[:workers])) if ex else fn(jobs[0])  # warm-up: workers started, shards opened
        best = 0.0
        for _ in range(windows):
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < min_s:
                run()
                n += len(jobs)
            best = max(best, n / (time.perf_counter() - t0))
        return best
    finally:
        if ex:
            ex.shutdown()


def _ensure(root: str, **kw) -> str:
    from data.buckets import bucket_table
    from data.index import SampleIndex
    from data.raw import RawConfig, index_corpus
    from data.synthetic_raw import write_raw_corpus
    from training.config import compose_config

    try:
        SampleIndex.load(root)
        return root
    except FileNotFoundError:
        pass
    t0 = time.time()
    shards = write_raw_corpus(root, **kw)
    index_corpus(shards, root, bucket_table(compose_config(["data=wan"]).data.buckets), RawConfig())
    print(f"made {root} in {time.time() - t0:.0f} s", file=sys.stderr)
    return root


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=os.path.join(ROOT, ".cache", "bench-data"))
    p.add_argument("--videos", type=int, default=12)
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--seconds", type=float, default=2.0, help="length of each of the 5 timing windows per row")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    harness.add_out(p, "data")
    a = p.parse_args(argv)
    vid = _ensure(os.path.join(a.cache, "v480"), images=0, videos=a.videos, size=(480, 480), seconds=(3.0, 3.0),
                  fps=(30,), samples_per_shard=8, seed=1, preset="veryfast", aspects=((16, 9),))
    img = _ensure(os.path.join(a.cache, "i720"), images=a.images, videos=0, size=(720, 720), samples_per_shard=16,
                  seed=2, aspects=((16, 9),))
    rng = np.random.default_rng(0)
    rows = []
    for name, root, bucket in (("480p 33f clip", vid, "v480_33f"), ("720p image", img, "i720")):
        _worker_init(root, bucket, 16.0)
        recs = _CORPUS["index"].records
        assert all(r["bucket"] == bucket for r in recs), f"{root}: samples not in {bucket}"
        mb = sum(os.path.getsize(os.path.join(root, s)) for s in _CORPUS["index"].meta["shards"]) / len(recs) / 1e6
        jobs = [(i, float(rng.random())) for i in range(len(recs))]
        for what, fn in (("decode", _decode), ("sample", _sample)):
            one = _timed(fn, jobs, 1, "serial", root, bucket, 16.0, a.seconds)
            row = {"case": name, "bucket": bucket, "what": what, "MB_per_sample": round(mb, 3),
                   "per_worker_per_s": round(one, 2), "ms_per_item": round(1000 / one, 1)}
            if a.workers > 1:
                row[f"threads{a.workers}_per_s"] = round(_timed(fn, jobs, a.workers, "thread", root, bucket, 16.0,
                                                                 a.seconds), 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        if a.workers > 1:
            procs = _timed(_return_frames, jobs, a.workers, "process", root, bucket, 16.0, a.seconds)
            rows[-1][f"processes{a.workers}_per_s"] = round(procs, 2)
        if name.startswith("480p"):  # the whole source, every frame decoded, none converted: the codec's own rate
            import av

            r0 = recs[0]
            data = _CORPUS["index"].read(0, r0["media"])
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 2.0:
                with av.open(__import__("io").BytesIO(data)) as c:
                    s = c.streams.video[0]
                    s.thread_count = 1
                    n += sum(1 for _ in c.decode(s))
            rows.append({"case": name, "bucket": bucket, "what": "h264 decode only, 854×480 frames",
                         "per_worker_per_s": round(n / (time.perf_counter() - t0), 1)})
    feed = []
    sample_rate = {r["bucket"]: r["per_worker_per_s"] for r in rows if r["what"] == "sample"}
    # i720 on the H200: the (16, 1560) step's token count, 6 · 3600 = 21600 ≈ 24960, takes about as long
    steps = dict(H200_STEPS, i720=(6, 3600, 848.0 * 21600 / 24960))
    for bucket, (B, S, ms) in steps.items():
        need = B / (ms / 1000)
        have = sample_rate.get(bucket, sample_rate.get("i720") if bucket.startswith("i") else None)
        feed.append({"bucket": bucket, "B": B, "S": S, "h200_ms": round(ms), "gpu_samples_per_s": round(need, 2),
                     "worker_samples_per_s": have, "workers_per_gpu": round(need / have, 2) if have else None,
                     "estimated_step": bucket == "i720"})
    print(f"\n{'case':<15}{'what':<34}{'per worker /s':>14}{'ms each':>9}" +
          (f"{f'{a.workers} threads /s':>14}{f'{a.workers} procs /s':>13}" if a.workers > 1 else ""))
    for r in rows:
        print(f"{r['case']:<15}{r['what']:<34}{r['per_worker_per_s']:>14}{r.get('ms_per_item', ''):>9}" +
              (f"{r.get(f'threads{a.workers}_per_s', ''):>14}{r.get(f'processes{a.workers}_per_s', ''):>13}"
               if a.workers > 1 else ""))
    print(f"\n{'bucket':<10}{'B':>4}{'S':>7}{'H200 ms':>9}{'GPU needs /s':>14}{'worker /s':>11}{'workers/GPU':>13}")
    for f in feed:
        print(f"{f['bucket']:<10}{f['B']:>4}{f['S']:>7}{f['h200_ms']:>9}{f['gpu_samples_per_s']:>14}"
              f"{f['worker_samples_per_s']:>11}{f['workers_per_gpu']:>13}" + ("  (step estimated)" if
                                                                                f["estimated_step"] else ""))
    info = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.processor() or _cpu_name()}", "python": platform.python_version(),
            "av": __import__("av").__version__, "pillow": __import__("PIL").__version__, "rows": rows, "feed": feed}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "data_loading.json")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print(f"\nwrote {path}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
