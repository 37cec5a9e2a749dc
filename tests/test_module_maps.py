"""The module maps people read stay true: ``accelkit/checkpointing/__init__.py``'s list of
modules (its sub-packages' modules included) and the "Project layout" block of docs/layout.md
name every module that exists, and only those.
"""

from __future__ import annotations

import re
from pathlib import Path

import accelkit.checkpointing

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "accelkit"
CHECKPOINTING = PACKAGE / "checkpointing"


def _public_modules(folder: Path) -> set[str]:
    names = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    names |= {p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def _dotted_modules(folder: Path, prefix: str = "") -> set[str]:
    """Every public module under ``folder``, dotted from it: ``storage``, ``storage.base``..."""
    names: set[str] = set()
    for name in _public_modules(folder):
        if name.endswith("/"):
            package = name.rstrip("/")
            names.add(prefix + package)
            names |= _dotted_modules(folder / package, prefix + package + ".")
        else:
            names.add(prefix + name)
    return names


def test_checkpointing_docstring_lists_every_module() -> None:
    doc = accelkit.checkpointing.__doc__ or ""
    listed = set(re.findall(r":mod:`~accelkit\.checkpointing\.([\w.]+)`", doc))
    present = _dotted_modules(CHECKPOINTING)
    assert {
        "storage",
        "storage.base",
        "formats",
        "sharded",
    } <= present  # the walk sees sub-packages
    assert listed == present, (
        f"accelkit/checkpointing/__init__.py's module list is out of date: missing "
        f"{sorted(present - listed)}, no longer there {sorted(listed - present)}"
    )


def _layout_block() -> str:
    """The layout drawn in ``docs/layout.md`` (the README's Project layout moved there)."""
    page = (ROOT / "docs" / "layout.md").read_text()
    section = page.split("# Project layout", 1)[1]
    return section.split("```", 2)[1]


def test_docs_project_layout_names_every_top_level_module() -> None:
    block = _layout_block()
    named = set(re.findall(r"\b(_?[a-z][a-z0-9_]*)(?:\.py\b|/)", block))
    present = {name.rstrip("/") for name in _public_modules(PACKAGE)}
    # checkpointing's layers are named in the block too (their modules: the docstring above)
    present |= {name.rstrip("/") for name in _public_modules(CHECKPOINTING) if name.endswith("/")}
    top_level = {"accelkit", "examples", "tests", "benchmarks"}
    assert present <= named, f"docs/layout.md's Project layout misses {sorted(present - named)}"
    # a room's modules may be named too, where they exist
    anywhere = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*/")}
    stale = named - present - anywhere - top_level
    assert not stale, (
        f"docs/layout.md's Project layout names modules that do not exist: {sorted(stale)}"
    )
