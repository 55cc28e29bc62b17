"""The import graph's layers (STYLE.md's arrows): read with `ast` from every .py file of the packages and train.py,
imports inside functions included, so that a new arrow fails here rather than in a review.

    train.py → training, models, data, scheduling;  training → models, data, scheduling;  models → ops;
    data → scheduling;  scheduling and ops → no other package;  nothing outside scripts/ imports scripts.
Also: an op module never reaches for a sibling op's private (underscore) name; models, ops, data and scheduling
import neither Hydra/OmegaConf, wandb nor accelerate; only models/parallelize.py imports FSDP2; scheduling imports
no torch (it knows tokens, shapes and times, and is handed what it must run).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PACKAGES = ("data", "models", "ops", "scheduling", "training")
# the packages each layer may import (its own aside)
ALLOWED = {
    "train": {"training", "models", "data", "scheduling"},
    "training": {"models", "data", "scheduling"},
    "models": {"ops"},
    "data": {"scheduling"},
    "scheduling": set(),
    "ops": set(),
}
FRAMEWORKS = ("hydra", "omegaconf", "wandb", "accelerate")  # the entry points' business, not the libraries'
FSDP = "torch.distributed.fsdp"


def sources(root: str = ROOT) -> list[str]:
    """Repo-relative paths of train.py and every .py file under the packages."""
    out = ["train.py"]
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            out += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def layer(path: str) -> str:
    return "train" if path == "train.py" else path.split(os.sep)[0]


def imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every absolute import, at any depth; `import a.b` → ("a.b", [])."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def private_op_uses(tree: ast.AST, own: str) -> list[str]:
    """Private names of another ops module that this file imports or reads as `module._name`."""
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("ops.") and node.module != own:
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if node.module == "ops":
                aliases.update({a.asname or a.name: f"ops.{a.name}" for a in node.names if f"ops.{a.name}" != own})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names
                            if a.asname and a.name.startswith("ops.") and a.name != own})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def violations(root: str = ROOT) -> list[str]:
    """Every import that breaks a rule of the module docstring, as 'path:line: what'."""
    bad = []
    for path in sources(root):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        src = layer(path)
        for module, _, line in imports(tree):
            top = module.split(".")[0]
            where = f"{path}:{line}: imports {module}"
            if top == "scripts":
                bad.append(f"{where} (scripts are entry points: move what is shared into a package)")
            elif top in PACKAGES and top != src and top not in ALLOWED[src]:
                bad.append(f"{where} ({src} may import only {sorted(ALLOWED[src]) or 'no other package'})")
            if src in ("models", "ops", "data", "scheduling") and top in FRAMEWORKS:
                bad.append(f"{where} (the libraries take plain values; {top} belongs to train.py and training/)")
            if module.startswith(FSDP) and path != os.path.join("models", "parallelize.py"):
                bad.append(f"{where} (FSDP2 is applied from outside, in models/parallelize.py only)")
            if src == "scheduling" and top == "torch":
                bad.append(f"{where} (scheduling knows tokens, shapes and times; it is handed what it runs)")
        if src == "ops":
            own = path[:-3].replace(os.sep, ".")
            bad += [f"{path}: uses {name} (a sibling op's private name: make it public or move it to "
                    f"ops/triton_setup.py)" for name in private_op_uses(tree, own)]
    return bad


def test_the_import_graph_keeps_its_layers():
    assert violations() == []


def test_tests_run_scripts_as_commands_never_import_them():
    folder = os.path.join(ROOT, "tests")
    bad = []
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read(), name)
        bad += [f"tests/{name}:{line}: imports {m}" for m, _, line in imports(tree) if m.split(".")[0] == "scripts"]
    assert bad == []


@pytest.mark.parametrize("path, line, why", [
    ("data/loader.py", "from models.flow_matching import shift_t", "data may import only"),
    ("models/layers.py", "from training.config import load_config", "models may import only"),
    ("ops/adaln.py", "from ops.gelu_ffn import _kernel", "a sibling op's private name"),
    ("ops/adaln.py", "import ops.gelu_ffn as g\nx = g._secret", "a sibling op's private name"),
    ("scheduling/planner.py", "import torch", "scheduling knows tokens"),
    ("training/step.py", "def f():\n    from scripts.sample import main", "scripts are entry points"),
    ("train.py", "from ops.adaln import adaln_modulate", "train may import only"),
    ("data/raw.py", "import omegaconf", "the libraries take plain values"),
    ("training/dist.py", "from torch.distributed.fsdp import fully_shard", "FSDP2 is applied from outside"),
])
@pytest.mark.slow
def test_an_added_arrow_fails(tmp_path, path, line, why):
    """A copy of the tree with one forbidden import added: the check names it (a check that cannot fail is a bug)."""
    for rel in sources():
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(open(os.path.join(ROOT, rel), encoding="utf-8").read(), encoding="utf-8")
    target = tmp_path / path
    target.write_text(target.read_text(encoding="utf-8") + "\n" + line + "\n", encoding="utf-8")
    found = violations(str(tmp_path))
    assert len(found) == 1 and found[0].startswith(path) and why in found[0], found


@pytest.mark.parametrize("old, new", [("scheduling.balance", "scheduling.planner"),
                                      ("scheduling.metrics", "scheduling.efficiency"),
                                      ("training.metrics_log", "training.metrics"),
                                      ("training.step_metrics", "training.metrics")])
@pytest.mark.slow
def test_a_renamed_module_still_imports_for_one_release_with_a_warning(old, new):
    """Old module names are aliases of the new modules (the same objects), and say so once on import."""
    code = (f"import warnings; warnings.simplefilter('error', FutureWarning)\n"
            f"try:\n    import {old}\nexcept FutureWarning as w:\n    print('warned:', w)\n"
            f"warnings.simplefilter('ignore')\nimport importlib, {new}\n"
            f"print(importlib.import_module('{old}') is {new})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"warned: {old} is deprecated" in done.stdout and f"import {new}" in done.stdout
    assert done.stdout.strip().endswith("True")
