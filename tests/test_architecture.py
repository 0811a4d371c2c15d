"""The code's shape, checked: imports point downward, functions stay short, `train()` reads in one screen.

The layer order below is the one docs/ARCHITECTURE.md describes; a module may import only modules
listed before it. Function-local imports of finetune modules are allowed in cli.py alone (each
command imports only what it runs, so `finetune plan` does not load the training loop).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "finetune"
LAYERS = [
    "errors",
    "fileio",
    "syncs",
    "tasks",
    "config",
    "config_io",
    "config_docs",
    "faults",
    "budget",
    "formats",
    "sources",
    "precision",
    "families",
    "model",
    "window",
    "collate",
    "packing",
    "reading",
    "data",
    "optim",
    "trackers",
    "runtime",
    "memory",
    "peak",
    "planner",
    "metrics",
    "calibrate",
    "checkpoint",
    "final",
    "predict",
    "card",
    "recipe",
    "scaffold",
    "initconfig",
    "export",
    "nodes",
    "assemble",
    "train",
    "sweep",
    "cli",
]


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def _finetune_imports(tree: ast.Module) -> list[tuple[str, ast.stmt]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "finetune":
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune."):
            found.append((node.module.split(".")[1], node))
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".")[1], node) for a in node.names if a.name.startswith("finetune.")]
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted(_modules()) == sorted(LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_imports_point_downward(module: str) -> None:
    tree = _modules()[module]
    for imported, node in _finetune_imports(tree):
        assert LAYERS.index(imported) < LAYERS.index(module), f"{module} imports {imported} (line {node.lineno})"
        if module != "cli":
            assert node.col_offset == 0, f"{module}: function-local import of finetune.{imported} (line {node.lineno})"


def test_no_module_is_over_800_lines() -> None:
    # a module past this has grown a second concern: split it along its seam (docs/ARCHITECTURE.md)
    sizes = {p.stem: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert not {m: n for m, n in sizes.items() if n > 800}


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
