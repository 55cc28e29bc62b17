"""Mutation check: small realistic bugs planted one at a time in the library; a test suite that misses one has a gap.

    python scripts/mutation_check.py                          files of the five packages changed since HEAD
    python scripts/mutation_check.py --base main --per-file 8 --seed 0 --out results/mutation
    python scripts/mutation_check.py --all --jobs 2           every file of scheduling/ training/ ops/ data/ models/
    python scripts/mutation_check.py --files ops/adaln.py --list     the mutants it would run, without running them
    python scripts/mutation_check.py --only ops/adaln.py#41 scheduling/planner.py#7   re-run given mutants
    python scripts/mutation_check.py --recheck results/mutation.csv --out results   re-run an earlier run's survivors

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
Prints a table (file, line, mutation, status) and the kill rate per package; --out DIR writes mutation.csv and
mutation.json. Not a test (slow by nature): run it by hand before merging a change to the core.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import csv
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("scheduling", "training", "ops", "data", "models")
# Tests that reach a module without importing it (through train.py or a subprocess); keys are repo paths.
COVERED_BY = {
    "training/step.py": ["tests/test_train.py"],
    "training/checkpoint.py": ["tests/test_train.py"],
    "training/metrics.py": ["tests/test_train.py"],
    "training/metrics.py": ["tests/test_train.py"],
    "training/optim.py": ["tests/test_train.py"],
    "training/config.py": ["tests/test_train.py"],
    "training/busy.py": ["tests/test_distributed.py"],
    "training/dist.py": ["tests/test_distributed.py"],
    "models/build.py": ["tests/test_train.py"],
    "models/parallelize.py": ["tests/test_distributed.py"],
    "data/batch.py": ["tests/test_data.py"],
    "data/loader.py": ["tests/test_train.py"],
    "scheduling/efficiency.py": ["tests/test_simulate.py"],
}
CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
            ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
            ast.Pow: ast.Mult}
NAME_SWAP = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax", "amax": "amin",
             "argmin": "argmax", "argmax": "argmin", "clamp_min": "clamp_max", "clamp_max": "clamp_min"}
SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
          ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
          ast.Div: "/", ast.FloorDiv: "//", ast.Pow: "**", ast.And: "and", ast.Or: "or"}
QUIET_CALLS = re.compile(r"^(print|log|warn|debug|info|warning|error|exception|log_metrics|set_description|write)$")


# ----------------------------------------------------------------------------------------------------- the mutator
@dataclass
class Mutant:
    file: str          # repo-relative path
    index: int         # position among the file's candidates (the id is file#index)
    line: int
    col: int
    kind: str
    description: str
    start: int = field(repr=False, default=0)  # character offsets of the replaced text in the source
    end: int = field(repr=False, default=0)
    new: str = field(repr=False, default="")

    @property
    def id(self) -> str:
        return f"{self.file}#{self.index}"

    def apply(self, source: str) -> str:
        return source[:self.start] + self.new + source[self.end:]


def _offsets(source: str) -> list[int]:
    """Character offset of each line's start (ast positions are line + UTF-8 byte column)."""
    out, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        out.append(pos)
    return out


class _Collector(ast.NodeVisitor):
    def __init__(self, source: str, skip_functions: Optional[re.Pattern]):
        self.source, self.lines = source, source.splitlines(keepends=True)
        self.line_start = _offsets(source)
        self.skip_functions = skip_functions
        self.found: list[tuple[ast.AST, str, str, str]] = []  # (node, kind, description, replacement text)

    # positions ------------------------------------------------------------------------------------------------
    def _char(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1].encode()
        return self.line_start[lineno - 1] + len(line[:col_bytes].decode(errors="replace"))

    def span(self, node) -> tuple[int, int]:
        return self._char(node.lineno, node.col_offset), self._char(node.end_lineno, node.end_col_offset)

    def add(self, node, kind: str, description: str, new: str) -> None:
        self.found.append((node, kind, description, new))

    # what is never mutated --------------------------------------------------------------------------------------
    def visit_JoinedStr(self, node):  # f-strings: messages
        return

    def visit_Assert(self, node):
        return

    def visit_Raise(self, node):
        return

    def _body_without_docstring(self, node):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        return body

    def visit_Module(self, node):
        for stmt in self._body_without_docstring(node):
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test).replace("'", '"') == '__name__ == "__main__"':
                continue
            self.visit(stmt)

    def _visit_function(self, node):
        if self.skip_functions and self.skip_functions.search(node.name):
            return
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in self._body_without_docstring(node):
            self.visit(stmt)

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node):
        for stmt in self._body_without_docstring(node):
            self.visit(stmt)

    def visit_AnnAssign(self, node):  # the annotation is a type, the value may be mutated
        if node.value is not None:
            self.visit(node.value)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant):  # a bare string (a comment in code)
            return
        if isinstance(node.value, ast.Call):
            name = _call_name(node.value)
            if name and QUIET_CALLS.match(name):
                return
            self.add(node, "drop", f"drop `{_short(ast.unparse(node))}`", "pass")
        self.generic_visit(node)

    # mutations -------------------------------------------------------------------------------------------------
    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            swap = CMP_SWAP.get(type(op))
            if swap is None:
                continue
            ops = list(node.ops)
            ops[i] = swap()
            new = ast.Compare(left=node.left, ops=ops, comparators=node.comparators)
            self.add(node, "compare", f"`{SYMBOL[type(op)]}` → `{SYMBOL[swap]}`", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_BinOp(self, node):
        swap = BIN_SWAP.get(type(node.op))
        if swap is not None and not _is_string(node):
            new = ast.BinOp(left=node.left, op=swap(), right=node.right)
            self.add(node, "arith", f"`{SYMBOL[type(node.op)]}` → `{SYMBOL[swap]}`", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        swap = BIN_SWAP.get(type(node.op))
        if swap is not None:
            new = ast.AugAssign(target=node.target, op=swap(), value=node.value)
            self.add(node, "arith", f"`{SYMBOL[type(node.op)]}=` → `{SYMBOL[swap]}=`", ast.unparse(new))
        self.add(node, "drop", f"drop `{_short(ast.unparse(node))}`", "pass")
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        swap = ast.Or if isinstance(node.op, ast.And) else ast.And
        new = ast.BoolOp(op=swap(), values=node.values)
        self.add(node, "boolop", f"`{SYMBOL[type(node.op)]}` → `{SYMBOL[swap]}`", f"({ast.unparse(new)})")
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            self.add(node, "negate", "drop `not`", f"({ast.unparse(node.operand)})")
        elif isinstance(node.op, ast.USub) and not isinstance(node.operand, ast.Constant):
            self.add(node, "negate", "drop unary `-`", f"({ast.unparse(node.operand)})")
        self.generic_visit(node)

    def _negate_test(self, node):  # if / while / conditional expression
        t = node.test
        if not (isinstance(t, ast.Constant) or isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not)):
            self.add(t, "negate", f"`{_short(ast.unparse(t))}` → `not (…)`", f"(not ({ast.unparse(t)}))")
        self.generic_visit(node)

    visit_If = visit_While = visit_IfExp = _negate_test

    def visit_Constant(self, node):
        v = node.value
        if isinstance(v, bool):
            self.add(node, "const", f"`{v}` → `{not v}`", repr(not v))
        elif isinstance(v, int):
            w = 0 if v == 1 else v + 1
            self.add(node, "const", f"`{v}` → `{w}`", repr(w))
        elif isinstance(v, float) and v == v and abs(v) != float("inf"):
            w = 1.0 if v == 0 else 0.0 if v == 1 else 2 * v
            self.add(node, "const", f"`{v!r}` → `{w!r}`", repr(w))

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            self.add(node.func, "minmax", f"`{node.func.id}` → `{NAME_SWAP[node.func.id]}`", NAME_SWAP[node.func.id])
        elif isinstance(node.func, ast.Attribute) and node.func.attr in NAME_SWAP:
            # only the attribute's name: `a.b.max` → `a.b.min`
            self.add(node.func, "minmax", f"`.{node.func.attr}` → `.{NAME_SWAP[node.func.attr]}`",
                     f"{ast.unparse(node.func.value)}.{NAME_SWAP[node.func.attr]}"
                     if not isinstance(node.func.value, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp,
                                                         ast.IfExp, ast.Lambda))
                     else f"({ast.unparse(node.func.value)}).{NAME_SWAP[node.func.attr]}")
        self.generic_visit(node)

    def visit_keyword(self, node):  # keyword values are mutated; keyword names are not nodes
        self.visit(node.value)

    def visit_arg(self, node):  # annotations of arguments
        return

    def visit_Subscript(self, node):
        if isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and node.value.id in (
                "Optional", "Union", "list", "dict", "tuple", "Sequence", "Callable", "Iterable", "type"):
            return  # a type expression
        self.generic_visit(node)


def _call_name(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_string(node: ast.BinOp) -> bool:
    return any(isinstance(x, (ast.JoinedStr,)) or isinstance(x, ast.Constant) and isinstance(x.value, str)
               for x in (node.left, node.right))


def _short(text: str, n: int = 50) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"


def candidates(source: str, file: str = "<string>", skip_functions: Optional[str] = None) -> list[Mutant]:
    """Every mutant of `source`, in source order; each one's mutated text parses and differs from the original."""
    tree = ast.parse(source)
    col = _Collector(source, re.compile(skip_functions) if skip_functions else None)
    col.visit(tree)
    original = ast.dump(tree)
    out: list[Mutant] = []
    seen = set()
    found = sorted(((col.span(node), node, kind, description, new) for node, kind, description, new in col.found),
                   key=lambda x: x[0])
    for (start, end), node, kind, description, new in found:
        if (start, end, new) in seen:
            continue
        seen.add((start, end, new))
        m = Mutant(file, len(out), node.lineno, node.col_offset, kind, description, start, end, new)
        try:
            changed = ast.dump(ast.parse(m.apply(source))) != original
        except SyntaxError:
            continue
        if changed:
            out.append(m)
    for i, m in enumerate(out):
        m.index = i
    return out


def draw(mutants: list[Mutant], n: int, seed: int, file: str) -> list[Mutant]:
    """Up to n mutants of one file, the same for the same (seed, file) whatever else is drawn: the kinds in turn
    (a seeded order), a seeded choice within each, so that constants, which outnumber the rest, do not crowd out
    comparisons and arithmetic."""
    if n <= 0 or len(mutants) <= n:
        return list(mutants)
    rng = random.Random(f"{seed}:{file}")
    kinds = sorted({m.kind for m in mutants})
    rng.shuffle(kinds)
    pools = {k: rng.sample([m for m in mutants if m.kind == k], sum(m.kind == k for m in mutants)) for k in kinds}
    chosen: list[Mutant] = []
    while len(chosen) < n:
        for k in kinds:
            if pools[k] and len(chosen) < n:
                chosen.append(pools[k].pop())
    return sorted(chosen, key=lambda m: m.index)


# ------------------------------------------------------------------------------------------------ files and tests
def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def repo_files(root: str) -> list[str]:
    """Tracked and untracked, not ignored, files of the working tree (what a copy needs)."""
    out = git("ls-files", "-co", "--exclude-standard", "-z", cwd=root)
    return sorted(f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f)))


def in_packages(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] in PACKAGES and not path.endswith("__init__.py")


def changed_files(root: str, base: str) -> list[str]:
    changed = git("diff", "--name-only", base, "--", *PACKAGES, cwd=root).split()
    untracked = git("ls-files", "-o", "--exclude-standard", "--", *PACKAGES, cwd=root).split()
    return sorted({f for f in changed + untracked if in_packages(f) and os.path.exists(os.path.join(root, f))})


def _imported_paths(path: str, root: str) -> set[str]:
    """Repo files a Python file imports anywhere in it (module level or inside functions)."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError):
        return set()
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)  # `from ops import adaln`
    out = set()
    for m in mods:
        rel = m.replace(".", "/")
        for cand in (rel + ".py", rel + "/__init__.py"):
            if os.path.isfile(os.path.join(root, cand)):
                out.add(cand)
    return out


def covering_tests(root: str) -> dict[str, list[str]]:
    """Repo file → the test files that cover it (import it, directly or through a tests/ helper; COVERED_BY)."""
    tests = sorted(f"tests/{f}" for f in os.listdir(os.path.join(root, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    helpers = {f"tests/{f}" for f in os.listdir(os.path.join(root, "tests"))
               if f.endswith(".py") and not f.startswith("test_")}
    cover: dict[str, set[str]] = {}
    for t in tests:
        reached = _imported_paths(os.path.join(root, t), root)
        text = open(os.path.join(root, t), encoding="utf-8").read()
        for h in helpers:  # helpers imported, or run as a script (dist_worker.py)
            if h in reached or re.search(rf"\b{os.path.basename(h)[:-3]}\b", text):
                reached |= _imported_paths(os.path.join(root, h), root)
        for f in reached:
            cover.setdefault(f, set()).add(t)
    for f, ts in COVERED_BY.items():
        cover.setdefault(f, set()).update(t for t in ts if os.path.isfile(os.path.join(root, t)))
    return {f: sorted(ts) for f, ts in cover.items()}


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
    status: str        # killed | survived | timeout | no tests
    seconds: float
    killed_by: str
    tests: int
    round: int = 1     # 1: its first run; n: re-run n − 1 times by --recheck (after tests were added)


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
    ap.add_argument("--per-file", type=int, default=8, help="mutants drawn per file (0: all; default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for mutation.csv and mutation.json")
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
                              float(r["seconds"]), r["killed_by"], int(r["tests"]), int(r.get("round") or 1))
                       for r in csv.DictReader(f)]
        args.only = [r.id for r in earlier if r.status == "survived" and (not args.only or r.id in args.only)]
        if not args.only:
            print(f"no survivors in {args.recheck}")
            return 0
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
    for f in files:
        source = open(os.path.join(root, f), encoding="utf-8").read()
        cands = candidates(source, f, args.skip_functions)
        chosen = ([m for m in cands if m.id in args.only] if args.only
                  else draw(cands, args.per_file, args.seed, f))
        if earlier:  # an id names the same mutant only in the same source: refuse to recheck an edited file
            was = {r.id: (r.line, r.mutation) for r in earlier}
            stale = [m.id for m in chosen if was[m.id] != (m.line, m.description)]
            stale += sorted({i for i in args.only if i.split("#")[0] == f} - {m.id for m in chosen})
            if stale:
                raise SystemExit(f"{f} changed since {args.recheck} (mutants {stale[:3]} differ): recheck on the "
                                 "sources that run used, or run a fresh pass")
        plan += [(m, cover.get(f, [])) for m in chosen]
    if args.list:
        for m, tests in plan:
            print(f"{m.id:32s} {m.line:5d}  {m.kind:8s} {m.description:60s} {len(tests)} test files")
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
                return Result(m.id, m.file, m.line, m.kind, m.description, "no tests", 0.0, "", 0)
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
            r = Result(m.id, m.file, m.line, m.kind, m.description, status, round(secs, 1), by, len(tests))
            with lock:
                print(f"[{k + 1}/{len(plan)} {time.perf_counter() - t_start:6.0f}s] {r.status:8s} {m.id:30s} "
                      f"l.{m.line:<4d} {m.description}" + (f"  ({by})" if by else ""), flush=True)
            return r

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda a: run_one(*a), [(k, m, ts) for k, (m, ts) in enumerate(plan)]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if earlier:  # the earlier table, its survivors replaced by this run's verdicts
        new = {r.id: r for r in results}
        for r in new.values():
            r.round = next(e.round for e in earlier if e.id == r.id) + 1
        results = [new.get(e.id, e) for e in earlier]
        files = sorted({r.file for r in results})
    report(results, broken, args, files)
    return 0


def kill_rate(rs: list[Result]) -> tuple[int, int]:
    counted = [r for r in rs if r.status != "no tests"]
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
    print(f"{'all':14s} {k:4d} / {n:<4d} killed ({100 * k / max(1, n):.0f} %); timeouts count as killed"
          + (f"; {no_tests} mutants in files no test covers" if no_tests else ""))
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
