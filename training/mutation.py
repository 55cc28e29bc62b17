"""Mutation testing of the packages: the mutator (small realistic bugs, one AST node each, planted by replacing that
node's source text) and the map from a package file to the tests that cover it. scripts/mutation_check.py runs the
mutants; its docstring lists the mutations and how a mutant is judged.
"""
from __future__ import annotations

import ast
import os
import random
import re
from dataclasses import dataclass, field
from typing import Optional

PACKAGES = ("scheduling", "training", "ops", "data", "models")
# Tests that reach a module without importing it (through train.py or a subprocess); keys are repo paths.
COVERED_BY = {
    "training/step.py": ["tests/test_train.py"],
    "training/checkpoint.py": ["tests/test_train.py"],
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
    "training/bucket_report.py": ["tests/test_scripts.py"],
    # modules moved out of scripts/: the tests that run their script (or a module that calls them) cover them
    "training/cli.py": ["tests/test_scripts.py", "tests/test_finetune.py", "tests/test_replay.py"],
    "training/load.py": ["tests/test_scripts.py", "tests/test_finetune.py", "tests/test_mmdit.py"],
    "training/sampling.py": ["tests/test_scripts.py"],
    "training/export.py": ["tests/test_scripts.py"],
    "training/compare.py": ["tests/test_scripts.py"],
    "data/synthetic_raw.py": ["tests/test_scripts.py"],
    "models/convert_wan.py": ["tests/test_scripts.py"],
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
    context: str = field(repr=False, default="")  # the mutated line(s), the replaced text in ⟦⟧: finds it again

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


def _context(source: str, start: int, end: int) -> str:
    """The line(s) holding source[start:end], whitespace collapsed, the replaced text marked: `if n ⟦>⟧ 0:`."""
    a = source.rfind("\n", 0, start) + 1
    b = source.find("\n", end)
    b = len(source) if b < 0 else b
    one = lambda t: " ".join(t.split())  # noqa: E731
    return f"{one(source[a:start])}⟦{one(source[start:end])}⟧{one(source[end:b])}".strip()


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
        m = Mutant(file, len(out), node.lineno, node.col_offset, kind, description, start, end, new,
                   _context(source, start, end))
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
def in_packages(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] in PACKAGES and not path.endswith("__init__.py")


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
