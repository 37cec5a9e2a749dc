"""Every advertised public name resolves, and importing accelkit stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import accelkit
import accelkit.utils


@pytest.mark.parametrize("module", [accelkit, accelkit.utils], ids=lambda m: m.__name__)
def test_every_public_name_resolves(module: object) -> None:
    for name in module.__all__:  # type: ignore[attr-defined]
        assert getattr(module, name) is not None, name


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Acelerator'"):
        accelkit.Acelerator  # noqa: B018


@pytest.mark.slow
def test_import_does_not_load_optional_backends() -> None:
    code = (
        "import sys, accelkit\n"
        "from accelkit import Accelerator\n"
        "Accelerator(cpu=True)\n"
        "heavy = {'wandb', 'mlflow', 'comet_ml', 'tensorboard', 's3fs', 'torchdata', 'trackio',"
        " 'swanlab', 'clearml', 'accelerate'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lazy_names_and_the_typed_names_are_the_same_list() -> None:
    """``accelkit/__init__.py`` lists each public name in ``_PUBLIC`` (where it lives) and in
    its ``TYPE_CHECKING`` block (what type checkers see): the two must not drift."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(accelkit.__file__).read_text())
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for item in node.body:
                assert isinstance(item, ast.ImportFrom) and item.module
                typed.update({alias.name: item.module for alias in item.names})
    lazy = accelkit._PUBLIC  # type: ignore[attr-defined]
    public = {name: module for name, module in lazy.items() if module != "accelkit.out_of_scope"}
    assert typed == public
    assert set(accelkit.__all__) == {"AccelkitError", "__version__", *public}
