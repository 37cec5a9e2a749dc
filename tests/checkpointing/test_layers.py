"""The layers of ``accelkit.checkpointing`` hold: storage/ at the bottom, formats/ on it, sharded/
on both, the commit protocol on top; no layer imports one above it, no module imports itself
back round a circle, and the old module paths (now re-exports) still give the same names.

Read from the source (imports anywhere in a module, deferred ones included), so a new import
that breaks a layer fails here before anyone draws the structure.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "accelkit"
CHECKPOINTING = "accelkit.checkpointing"

# What each layer may import from accelkit.checkpointing: its own package, the layers below it,
# and errors (a leaf that every layer raises from).
ALLOWED = {
    "storage": {"storage", "errors"},
    "formats": {"formats", "storage", "errors"},
    "sharded": {"sharded", "formats", "storage", "errors"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


MODULES = _all_modules()


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The accelkit modules ``path`` imports (a ``from M import N`` names ``M.N`` where that is a
    module), optionally only the imports run when it is imported (not deferred, not typing)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST]
    if top_level_only:
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("accelkit")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("accelkit"):
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


def _part(module: str) -> str | None:
    """The layer or top-level module of accelkit.checkpointing that ``module`` is in."""
    if module == CHECKPOINTING:
        return "__init__"
    if not module.startswith(CHECKPOINTING + "."):
        return None
    return module[len(CHECKPOINTING) + 1 :].split(".")[0]


def _layer_modules(layer: str) -> list[str]:
    return sorted(m for m in MODULES if _part(m) == layer)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_layer_imports_upward(layer: str) -> None:
    modules = _layer_modules(layer)
    assert len(modules) > 1, f"layer {layer}/ not found"
    upward = {
        f"{module} -> {target}"
        for module in modules
        for target in _imports(MODULES[module])
        if (part := _part(target)) is not None and part not in ALLOWED[layer]
    }
    assert not upward, f"{layer}/ imports above its layer: {sorted(upward)}"


def test_no_import_circle_in_checkpointing() -> None:
    graph = {
        m: {t for t in _imports(MODULES[m], top_level_only=True) if _part(t) and t != m}
        for m in MODULES
        if _part(m)
    }
    done: set[str] = set()

    def visit(module: str, stack: list[str]) -> None:
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join([*stack, module]))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*stack, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def _shims() -> dict[str, str]:
    """Old module path -> new one, for every module kept only so old imports work."""
    out = {}
    for module, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        moved = re.match(r"Moved to :mod:`([\w.]+)`; kept so old imports work", doc)
        if moved:
            out[module] = moved.group(1)
    return out


SHIMS = _shims()


def test_old_paths_are_kept() -> None:
    kept = {m.rsplit(".", 1)[1] for m in SHIMS}
    assert {"checksum", "layout", "safetensors_io", "state_io", "model_io", "manifest"} <= kept


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_old_path_gives_the_same_names(old: str) -> None:
    before, after = importlib.import_module(old), importlib.import_module(SHIMS[old])
    assert sorted(before.__all__) == sorted(set(before.__all__))
    assert set(after.__all__) <= set(before.__all__), f"{old} lacks names of {SHIMS[old]}"
    for name in before.__all__:
        assert getattr(before, name) is getattr(after, name), f"{old}.{name}"


def test_accelkit_imports_no_old_path() -> None:
    users = {
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if module not in SHIMS
        for target in _imports(path)
        if target in SHIMS
    }
    assert not users, f"accelkit modules import a kept old path (use the new one): {users}"
