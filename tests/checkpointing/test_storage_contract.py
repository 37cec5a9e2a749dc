"""The storage contract cannot drift: every attribute the package uses on a storage object is
declared, and documented, by :class:`~accelkit.checkpointing.storage.Storage`, the type the
checkpoint code is annotated with; and the shipped ``StorageContract`` refuses a storage that
is not one.

Read from the source: every ``<name>.<attribute>`` where ``<name>`` is a parameter annotated
with a storage type, and every ``self.<field>.<attribute>`` where ``__init__`` stored one."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

import accelkit
from accelkit.checkpointing.storage import Storage, WrappedStorage, get_storage
from accelkit.checkpointing.storage.confined import ConfinedStorage
from accelkit.testing import StorageContract

PACKAGE = Path(accelkit.__file__).resolve().parent
STORAGE_TYPES = {"Storage", "WrappedStorage", "ConfinedStorage"}
# Attributes of a view, used where the code has checked the class first
# (``storage.inner if isinstance(storage, ConfinedStorage)``, a view re-rooting itself).
OF_A_VIEW = {"inner", "_relative", "root"}


def _is_storage(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).strip("'\"")
    return any(part.strip() in STORAGE_TYPES for part in text.split("|"))


def _used_attributes() -> dict[str, set[str]]:
    """attribute name -> the modules that use it on a storage object: on a parameter annotated
    with a storage type, or on ``self.<x>`` where ``__init__`` stored such a parameter."""
    used: dict[str, set[str]] = {}

    def record(node: ast.AST, names: set[str], fields: set[str], module: str) -> None:
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Attribute):
                continue
            value = sub.value
            if (isinstance(value, ast.Name) and value.id in names) or (
                isinstance(value, ast.Attribute)
                and isinstance(value.value, ast.Name)
                and value.value.id == "self"
                and value.attr in fields
            ):
                used.setdefault(sub.attr, set()).add(module)

    for path in PACKAGE.rglob("*.py"):
        module = str(path.relative_to(PACKAGE.parent))
        tree = ast.parse(path.read_text())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            fields: set[str] = set()
            for init in cls.body:
                if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                    params = {a.arg for a in init.args.args if _is_storage(a.annotation)}
                    for stmt in ast.walk(init):
                        if isinstance(stmt, ast.Assign) and (
                            isinstance(stmt.value, ast.Name) and stmt.value.id in params
                        ):
                            fields |= {
                                t.attr
                                for t in stmt.targets
                                if isinstance(t, ast.Attribute)
                                and isinstance(t.value, ast.Name)
                                and t.value.id == "self"
                            }
            if fields:
                record(cls, set(), fields, module)
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
                names = {a.arg for a in args if _is_storage(a.annotation)}
                if names:
                    record(func, names, set(), module)
    return used


def test_the_scan_sees_the_checkpoint_codes_calls() -> None:
    used = _used_attributes()
    for name in ("exists", "write_bytes", "open_write", "local_path", "links_out", "is_symlink"):
        assert name in used, f"the scan no longer finds `storage.{name}`: fix RECEIVERS"


def test_every_attribute_used_on_a_storage_is_declared_by_the_contract() -> None:
    undeclared = {
        name: sorted(modules)
        for name, modules in _used_attributes().items()
        if not hasattr(Storage, name) and name not in OF_A_VIEW
    }
    assert not undeclared, f"used on a storage but not declared by Storage: {undeclared}"


def test_every_method_of_the_contract_says_what_it_promises() -> None:
    public = [n for n, _ in inspect.getmembers(Storage) if not n.startswith("_")]
    assert {"exists", "open_sink", "open_write", "links_out"} <= set(public)
    undocumented = [n for n in public if not (inspect.getdoc(getattr(Storage, n)) or "").strip()]
    assert not undocumented, f"Storage methods without a docstring: {undocumented}"


def test_a_view_forwards_every_method_of_the_contract() -> None:
    # A method WrappedStorage inherits instead of forwarding would reach the base class's
    # default (e.g. links_out -> False) instead of the wrapped storage.
    derived = {"walk_files", "read_bytes"}  # built on the view's own primitives, on purpose
    public = {n for n, _ in inspect.getmembers(Storage) if not n.startswith("_")} - {"protocol"}
    not_forwarded = sorted(n for n in public - derived if n not in vars(WrappedStorage))
    assert not not_forwarded, f"WrappedStorage does not forward: {not_forwarded}"


class _DuckStorage:
    """Every method of the contract by name, but not a Storage: the contract refuses it."""

    def __getattr__(self, name: str) -> Any:
        inner = get_storage("memory://duck")
        return getattr(inner, name)


class _Lacking(Storage):
    """A backend that forgot a primitive (``rmtree``)."""

    exists = isdir = isfile = size = listdir = open_read = open_sink = Storage.exists
    create_exclusive = makedirs = remove = Storage.exists


def test_a_storage_that_lacks_a_primitive_cannot_be_made() -> None:
    with pytest.raises(TypeError, match="rmtree"):
        _Lacking()  # type: ignore[abstract]


def test_the_contract_suite_refuses_what_is_not_a_storage(tmp_path: Path) -> None:
    suite = StorageContract()
    with pytest.raises(AssertionError, match="not a subclass of"):
        suite.test_is_a_storage((_DuckStorage(), "memory://duck/root"))
    view = ConfinedStorage(get_storage(str(tmp_path)), str(tmp_path))
    suite.test_is_a_storage((view, str(tmp_path)))
