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


def test_import_does_not_load_optional_backends() -> None:
    code = (
        "import sys, accelkit\n"
        "from accelkit import Accelerator\n"
        "Accelerator(cpu=True)\n"
        "heavy = {'wandb', 'mlflow', 'comet_ml', 'tensorboard', 's3fs', 'torchdata',"
        " 'accelerate'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
