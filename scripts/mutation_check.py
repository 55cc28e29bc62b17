"""Mutation check: small realistic bugs planted one at a time in the library; a test suite that misses one has a gap.

    python scripts/mutation_check.py                          files of the five packages changed since HEAD
    python scripts/mutation_check.py --base main --per-file 8 --seed 0 --out runs/mutation
    python scripts/mutation_check.py --all --jobs 2           every file of scheduling/ training/ ops/ data/ models/
    python scripts/mutation_check.py --files ops/adaln.py --list     the mutants it would run, without running them
    python scripts/mutation_check.py --only ops/adaln.py#41 scheduling/planner.py#7   re-run given mutants
    python scripts/mutation_check.py --recheck results/mutation.csv --out DIR   re-run an earlier run's survivors
    python scripts/mutation_check.py --recheck old/mutation.csv --recheck-rev 08e2774   ... whose sources have moved

Mutations (Python's ast; each replaces one node's source text, the rest of the file is left byte for byte):
    compare     <  ↔ <=,  > ↔ >=,  == ↔ !=,  is ↔ is not,  in ↔ not in
    arith       + ↔ −,  * ↔ /,  // → /,  ** → *   (also in augmented assignments: x += … → x −= …)
    const       integers n → n + 1 (1 → 0), floats 0.0 ↔ 1.0 and x → 2x, True ↔ False
    boolop      and ↔ or
    negate      the test of an if / while / conditional expression → not (test);  not x → x;  −x → x
    minmax      min ↔ max, .minimum ↔ .maximum, .min() ↔ .max(), .amin ↔ .amax, .argmin ↔ .argmax
    drop        a statement that only mutates (an augmented assignment, a bare call such as x.mul_(…)) → pass
Docstrings, f-strings, annotations, assert statements, raise statements and log/print calls are never mutated.

For each file up to --per-file mutants are drawn at random (seeded by --seed and the file's path, so a run is
reproducible); each runs in a temporary copy of the repository (tracked and untracked, not ignored, files: the
working tree is never written) with `pytest -x -q` on the tests that cover the file: the test files that import
its module (`from pkg.mod import …`, `import pkg.mod`, `from pkg import mod`, also through tests/ helpers they
import) plus the few in COVERED_BY, fastest first (timed once on the unmutated copy; a test file that fails there is
left out and reported). A mutant is killed when pytest fails, survives when it passes, and times out past
--timeout-factor × the tests' clean time + --timeout-pad seconds (counted as killed: the bug hangs the tests).
Prints a table (file, line, mutation, status) and the kill rate per package; --out DIR (default runs/mutation)
gets mutation.csv and mutation.json. The csv's `source` column is the line mutated, its replaced text in ⟦⟧, then ⇒
and the text that replaces it: --recheck finds each survivor again by it (and its mutation), wherever the line has
moved since; a csv without it (older runs) needs --recheck-rev, the revision whose sources that run mutated. A
survivor whose text is no longer in the file is reported `gone` (the code was rewritten: run a fresh pass on it)
and, like `no tests`, is not counted.
Not a test (slow by nature): run it by hand before merging a change to the core.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root

from training.mutation import PACKAGES, Mutant, candidates, covering_tests, draw, in_packages  # noqa: E402


# ------------------------------------------------------------------------------------------------ files and tests
def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def repo_files(root: str) -> list[str]:
    """Tracked and untracked, not ignored, files of the working tree (what a copy needs)."""
    out = git("ls-files", "-co", "--exclude-standard", "-z", cwd=root)
    return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f)))


def changed_files(root: str, base: str) -> list[str]:
    changed = git("diff", "--name-only", base, "--", *PACKAGES, cwd=root).split()
    untracked = git("ls-files", "-o", "--exclude-standard", "--", *PACKAGES, cwd=root).split()
    return sorted({f for f in changed + untracked if in_packages(f) and os.path.exists(os.path.join(root, f))})


# --------------------------------------------------------------------------------------------------------- running
def make_copy(root: str, files: list[str], dest: str) -> str:
    for f in files:
        target = os.path.join(dest, f)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, f), target)
    return dest


def run_pytest(python: str, copy: str, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout' | 'no tests', seconds, the first failing test id or '')."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", WANDB_MODE="disabled")  # no stale .pyc of a mutant
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header",
           f"--basetemp={os.path.join(copy, '.mutation_tmp')}", *tests]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the pytest we started and its children (training subprocesses)
        proc.communicate()
        return "timeout", time.perf_counter() - t0, ""
    secs = time.perf_counter() - t0
    if proc.returncode == 0:
        return "passed", secs, ""
    if proc.returncode == 5:  # pytest collected nothing (a module skipped on this machine, e.g. CUDA-only)
        return "no tests", secs, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return "failed", secs, failed[0] if failed else f"exit {proc.returncode}"


@dataclass
class Result:
    id: str
    file: str
    line: int
    kind: str
    mutation: str
    status: str        # killed | survived | timeout | no tests | gone (--recheck: its text is no longer in the file)
    seconds: float
    killed_by: str
    tests: int
    round: int = 1     # 1: its first run; n: re-run n − 1 times by --recheck (after tests were added)
    source: str = ""   # _source(m): the line mutated, what replaces the text in ⟦⟧: --recheck finds it by this


def _source(m: Mutant) -> str:
    """The line mutated (Mutant.context: its replaced text in ⟦⟧), then ` ⇒ ` and the text that replaces it."""
    return f"{m.context} ⇒ {' '.join(m.new.split())}"


def relocate(e: Result, cands: list[Mutant], ordinal: Optional[tuple[int, int]] = None) -> Optional[Mutant]:
    """The mutant of `cands` (a file's candidates now) that is the earlier run's `e`: the same mutation of the same
    text (e.source), wherever its line has moved. Where the text occurs more than once, the same occurrence
    (ordinal: (k, of n) in the earlier source) or else the nearest to e's old line; None when it is gone."""
    same = [m for m in cands if m.description == e.mutation and _source(m) == e.source]
    if not same:
        return None
    if ordinal and len(same) == ordinal[1]:
        return same[ordinal[0]]
    return min(same, key=lambda m: abs(m.line - e.line))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision: mutate the package files changed since it "
                                                   "(default HEAD: uncommitted changes)")
    ap.add_argument("--all", action="store_true", help="every file of the five packages, not only changed ones")
    ap.add_argument("--files", nargs="+", help="these files instead (repo-relative paths)")
    ap.add_argument("--only", nargs="+", help="run just these mutant ids (FILE#INDEX, as the table prints them)")
    ap.add_argument("--recheck", metavar="CSV", help="re-run the survivors of an earlier run's mutation.csv (same "
                    "sources, new tests; with --only, those of them) and report the merged table")
    ap.add_argument("--recheck-rev", metavar="REV", help="with --recheck of a csv that has no `source` column: the "
                    "git revision whose sources that run mutated (each survivor is found again by its text there)")
    ap.add_argument("--per-file", type=int, default=8, help="mutants drawn per file (0: all; default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("runs", "mutation"),
                    help="folder for mutation.csv and mutation.json (default runs/mutation)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run in parallel, each in its own copy")
    ap.add_argument("--timeout-factor", type=float, default=3.0)
    ap.add_argument("--timeout-pad", type=float, default=30.0)
    ap.add_argument("--skip-functions", help="regex: functions (by name) whose bodies are not mutated")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--list", action="store_true", help="list the drawn mutants and their tests; run nothing")
    ap.add_argument("--root", default=ROOT, help="the repository (only read; default: this script's)")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.root)

    earlier: list[Result] = []
    if args.recheck:
        with open(args.recheck, newline="") as f:
            earlier = [Result(r["id"], r["file"], int(r["line"]), r["kind"], r["mutation"], r["status"],
                              float(r["seconds"]), r["killed_by"], int(r["tests"]), int(r.get("round") or 1),
                              r.get("source") or "")
                       for r in csv.DictReader(f)]
        # rows, not ids: a merged table may hold the same id twice (rows last run on different sources)
        todo = [i for i, r in enumerate(earlier) if r.status == "survived" and (not args.only or r.id in args.only)]
        args.only = [earlier[i].id for i in todo]
        if not args.only:
            print(f"no survivors in {args.recheck}")
            return 0
        ordinals = _earlier_sources(earlier, root, args) if args.recheck_rev else {}
    if args.only:
        files = sorted({i.split("#")[0] for i in args.only})
    elif args.files:
        files = [os.path.relpath(os.path.abspath(f), root) if os.path.isabs(f) else f for f in args.files]
    elif args.all:
        files = [f for f in repo_files(root) if in_packages(f)]
    else:
        files = changed_files(root, args.base)
    if not files:
        print(f"no files to mutate (nothing in {', '.join(PACKAGES)} changed since {args.base}; try --all)")
        return 0
    cover = covering_tests(root)
    plan: list[tuple[Mutant, list[str]]] = []
    moved: dict[str, list[int]] = {}  # --recheck: a mutant's id now → its rows in the earlier table
    gone: dict[int, Result] = {}      # --recheck: survivors whose text is no longer in their file, by row
    for f in files:
        if earlier and not os.path.isfile(os.path.join(root, f)):
            cands = []  # the file is gone: so are its survivors
        else:
            cands = candidates(open(os.path.join(root, f), encoding="utf-8").read(), f, args.skip_functions)
        if earlier:  # each survivor found again by its text, wherever its line has moved
            chosen = []
            for i in (i for i in todo if earlier[i].file == f):
                e = earlier[i]
                if not e.source:
                    m = next((m for m in cands if m.id == e.id), None)
                    if m is None or (m.line, m.description) != (e.line, e.mutation):
                        raise SystemExit(f"{f} changed since {args.recheck} ({e.id} differs) and the csv has no "
                                         "source column: give --recheck-rev, the revision that run mutated")
                else:
                    m = relocate(e, cands, ordinals.get(i))
                if m is None:
                    gone[i] = Result(e.id, e.file, e.line, e.kind, e.mutation, "gone", 0.0, "", 0, e.round + 1,
                                     e.source)
                    print(f"gone     {e.id:30s} l.{e.line:<4d} {e.mutation}: `{e.source}` is no longer in {f}")
                    continue
                if m.id not in moved:
                    chosen.append(m)
                moved.setdefault(m.id, []).append(i)
        else:
            chosen = ([m for m in cands if m.id in args.only] if args.only
                      else draw(cands, args.per_file, args.seed, f))
        plan += [(m, cover.get(f, [])) for m in chosen]
    if args.list:
        for m, tests in plan:
            was = _was(m, moved, earlier, "  ")
            print(f"{m.id:32s} {m.line:5d}  {m.kind:8s} {m.description:60s} {len(tests)} test files{was}")
        return 0

    work = tempfile.mkdtemp(prefix="mutation_")
    results: list[Result] = []
    try:
        listing = repo_files(root)
        copies: "queue.Queue[str]" = queue.Queue()
        for j in range(max(1, args.jobs)):
            copies.put(make_copy(root, listing, os.path.join(work, f"copy{j}")))
        # the clean time of every test file involved: its timeout budget and the fastest-first order
        needed = sorted({t for _, ts in plan for t in ts})
        clean: dict[str, float] = {}
        broken = []
        base_copy = copies.get()
        print(f"timing {len(needed)} test files on the unmutated copy ...", flush=True)
        for t in needed:
            status, secs, _ = run_pytest(args.python, base_copy, [t], timeout=1800)
            if status == "passed":
                clean[t] = secs
            elif status == "no tests":
                print(f"  {t} runs no test on this machine: left out", flush=True)
            else:
                broken.append(t)
                print(f"  {t} fails without any mutant: left out", flush=True)
        copies.put(base_copy)
        lock = threading.Lock()
        t_start = time.perf_counter()

        def run_one(k: int, m: Mutant, tests: list[str]) -> Result:
            tests = sorted((t for t in tests if t in clean), key=lambda t: clean[t])
            if not tests:
                return Result(m.id, m.file, m.line, m.kind, m.description, "no tests", 0.0, "", 0, 1, _source(m))
            copy = copies.get()
            path = os.path.join(copy, m.file)
            original = open(path, "rb").read()
            try:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(m.apply(original.decode("utf-8")))
                timeout = args.timeout_factor * sum(clean[t] for t in tests) + args.timeout_pad
                status, secs, by = run_pytest(args.python, copy, tests, timeout)
            finally:
                with open(path, "wb") as fh:
                    fh.write(original)
                copies.put(copy)
            status = {"failed": "killed", "passed": "survived"}.get(status, status)
            r = Result(m.id, m.file, m.line, m.kind, m.description, status, round(secs, 1), by, len(tests), 1,
                       _source(m))
            was = _was(m, moved, earlier, " ")
            with lock:
                print(f"[{k + 1}/{len(plan)} {time.perf_counter() - t_start:6.0f}s] {r.status:8s} {m.id:30s} "
                      f"l.{m.line:<4d} {m.description}{was}" + (f"  ({by})" if by else ""), flush=True)
            return r

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda a: run_one(*a), [(k, m, ts) for k, (m, ts) in enumerate(plan)]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if earlier:  # the earlier table, its survivors replaced by this run's verdicts (ids and lines of today's source)
        new = dict(gone)
        for r in results:
            for i in moved[r.id]:
                new[i] = dataclasses.replace(r, round=earlier[i].round + 1)
        results = [new.get(i, e) for i, e in enumerate(earlier)]
        files = sorted({r.file for r in results})
    report(results, broken, args, files)
    return 0


def _was(m: Mutant, moved: dict[str, list[int]], earlier: list[Result], sep: str) -> str:
    old = {earlier[i].id for i in moved.get(m.id, [])} - {m.id}
    return f"{sep}(was {', '.join(sorted(old))})" if old else ""


def _earlier_sources(earlier: list[Result], root: str, args) -> dict[int, tuple[int, int]]:
    """--recheck-rev: fill each earlier row's `source` from the file at that revision (where it has none); returns,
    per row (its index), which occurrence of its (mutation, source) it was there: (k, of n)."""
    ordinals: dict[int, tuple[int, int]] = {}
    for f in sorted({e.file for e in earlier}):
        try:
            old = candidates(git("show", f"{args.recheck_rev}:{f}", cwd=root), f, args.skip_functions)
        except subprocess.CalledProcessError:
            raise SystemExit(f"{f} is not in {args.recheck_rev}")
        for i, e in ((i, e) for i, e in enumerate(earlier) if e.file == f):
            idx = int(e.id.split("#")[1])
            m = old[idx] if idx < len(old) else None
            if m is None or (m.line, m.description) != (e.line, e.mutation):
                raise SystemExit(f"{e.id} is not line {e.line}, {e.mutation} in {args.recheck_rev}: not the "
                                 "revision that run mutated")
            e.source = e.source or _source(m)
            same = [o for o in old if (o.description, _source(o)) == (m.description, _source(m))]
            ordinals[i] = (same.index(m), len(same))
    return ordinals


def kill_rate(rs: list[Result]) -> tuple[int, int]:
    counted = [r for r in rs if r.status not in ("no tests", "gone")]
    return sum(r.status in ("killed", "timeout") for r in counted), len(counted)


def report(results: list[Result], broken: list[str], args, files: list[str]) -> None:
    print()
    print(f"{'file':32s} {'line':>5s}  {'mutation':60s} status")
    for r in results:
        print(f"{r.file:32s} {r.line:5d}  {r.mutation[:60]:60s} {r.status}")
    print()
    for pkg in PACKAGES:
        k, n = kill_rate([r for r in results if r.file.startswith(pkg + "/")])
        if n:
            print(f"{pkg + '/':14s} {k:4d} / {n:<4d} killed ({100 * k / n:.0f} %)")
    k, n = kill_rate(results)
    no_tests = sum(r.status == "no tests" for r in results)
    n_gone = sum(r.status == "gone" for r in results)
    print(f"{'all':14s} {k:4d} / {n:<4d} killed ({100 * k / max(1, n):.0f} %); timeouts count as killed"
          + (f"; {no_tests} mutants in files no test covers" if no_tests else "")
          + (f"; {n_gone} survivors gone (their code was rewritten), not counted" if n_gone else ""))
    if broken:
        print(f"left out (failing without a mutant): {', '.join(broken)}")
    survivors = [r.id for r in results if r.status == "survived"]
    if survivors:
        print(f"survivors: {' '.join(survivors)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        rows = [asdict(r) for r in results]
        with open(os.path.join(args.out, "mutation.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["id"])
            w.writeheader()
            w.writerows(rows)
        meta = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                "seed": args.seed, "per_file": args.per_file, "files": files, "broken_tests": broken,
                "results": rows}
        with open(os.path.join(args.out, "mutation.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {args.out}/mutation.csv and mutation.json")


if __name__ == "__main__":
    sys.exit(main())
