"""The code's shape, checked: imports point downward, functions stay short, `train()` reads in one screen.

The package order and layer order below are the ones docs/ARCHITECTURE.md describes: a module imports only from its
own subpackage or those below it, and only modules listed before it. Function-local imports of finetune modules are
allowed in cli.py alone (each command imports only what it runs, so `finetune plan` does not load the training loop).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
# subpackages from the bottom up: a module imports only from its own package or those before it
GROUPS = ["core", "config", "model", "data", "training", "memory", "evaluation", "deploy", "init", ""]
LAYERS = [
    "core.errors",
    "core.fileio",
    "core.syncs",
    "core.faults",
    "config.tasks",
    "config.schema",
    "config.files",
    "config.docs",
    "model.sources",
    "model.precision",
    "model.families",
    "model.pooling",
    "model.load",
    "model.probe",
    "data.window",
    "data.collate",
    "data.packing",
    "data.reading",
    "data.build",
    "training.budget",
    "training.optim",
    "training.trackers",
    "training.ranks",
    "training.runtime",
    "training.checkpoint",
    "training.nodes",
    "memory.monitor",
    "memory.peak",
    "memory.planner",
    "evaluation.metrics",
    "evaluation.calibrate",
    "evaluation.issues",
    "deploy.final",
    "deploy.predict",
    "deploy.teacher",
    "deploy.card",
    "deploy.export",
    "init.formats",
    "init.sniff",
    "init.recipe",
    "init.write",
    "assemble",
    "train",
    "sweep",
    "audit",
    "cli",
]


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _modules() -> dict[str, ast.Module]:
    return {_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py")) if p.stem != "__init__"}


def _group(module: str) -> str:
    return module.rpartition(".")[0]


def _finetune_imports(tree: ast.Module) -> list[tuple[str, ast.stmt]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "finetune":
            package = node.module.removeprefix("finetune").lstrip(".")
            if package in LAYERS:  # from finetune.a.b import name
                found.append((package, node))
            else:  # from finetune[.a] import module
                found += [((f"{package}.{alias.name}" if package else alias.name), node) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("finetune."), node) for a in node.names if a.name.startswith("finetune.")]
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted(_modules()) == sorted(LAYERS)


def test_every_subpackage_says_what_lives_there() -> None:
    for group in filter(None, GROUPS):
        doc = ast.get_docstring(ast.parse((PACKAGE / group / "__init__.py").read_text()))
        said = " ".join((doc or "").split())
        assert "May import" in said, f"finetune/{group}/__init__.py: say what lives there and what it may import"
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        filter(None, GROUPS)
    )


@pytest.mark.parametrize("module", LAYERS)
def test_imports_point_downward(module: str) -> None:
    tree = _modules()[module]
    for imported, node in _finetune_imports(tree):
        assert imported in LAYERS, f"{module} imports finetune.{imported}, which is not a module (line {node.lineno})"
        assert GROUPS.index(_group(imported)) <= GROUPS.index(_group(module)), (
            f"{module} imports {imported}: package {_group(imported)} sits above {_group(module) or 'the top'}"
        )
        assert LAYERS.index(imported) < LAYERS.index(module), f"{module} imports {imported} (line {node.lineno})"
        if module != "cli":
            assert node.col_offset == 0, f"{module}: function-local import of finetune.{imported} (line {node.lineno})"


def test_functions_are_short_and_train_reads_in_one_screen() -> None:
    too_long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = 120 if (name, node.name) == ("train", "train") else 80
                if lines > limit:
                    too_long.append(f"{name}.{node.name}: {lines} lines (limit {limit})")
    assert not too_long, too_long


def test_user_errors_are_documented_where_raised() -> None:
    # a public function that raises UserError itself says so in a `Raises:` section
    missing = []
    for name, tree in _modules().items():
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            raises = any(
                isinstance(n, ast.Raise) and "UserError" in ast.unparse(n.exc or ast.Constant(None))
                for n in ast.walk(node)
            )
            if raises and "Raises:" not in (ast.get_docstring(node) or ""):
                missing.append(f"{name}.{node.name}")
    assert not missing, missing
