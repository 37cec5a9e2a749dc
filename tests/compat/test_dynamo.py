"""Accelerator(dynamo_backend=...) compiles prepared models with torch.compile."""

from __future__ import annotations

import pytest
import torch

from accelkit import Accelerator, TorchDynamoPlugin
from accelkit.training.dynamo import DynamoBackend
from accelkit.utils import is_compiled_module


def test_prepare_compiles_and_unwrap_can_drop_the_compile_wrapper() -> None:
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = torch.nn.Linear(4, 2)
    prepared = accelerator.prepare(model)
    assert is_compiled_module(prepared)
    x = torch.randn(3, 4)
    torch.testing.assert_close(prepared(x), model(x))
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
    assert is_compiled_module(accelerator.unwrap_model(prepared))


def test_backend_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "true")
    plugin = TorchDynamoPlugin()
    assert plugin.backend is DynamoBackend.EAGER and plugin.fullgraph is True
    assert plugin.to_dict()["backend"] == "eager"


def test_no_backend_leaves_models_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    monkeypatch.delenv("ACCELKIT_DYNAMO_BACKEND", raising=False)
    assert not is_compiled_module(Accelerator(cpu=True).prepare(torch.nn.Linear(2, 2)))


def test_regional_compilation_compiles_repeated_blocks_in_place() -> None:
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)]))
    plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    prepared = Accelerator(cpu=True, dynamo_plugin=plugin).prepare(model)
    assert prepared is model
    assert all(is_compiled_module(block) for block in model[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dynamo_backend": "nope"}, "Unknown dynamo backend 'nope'"),
        ({"dynamo_backend": "torchxla_trace_once"}, "XLA/TPU, which accelkit does not support"),
        (
            {"dynamo_backend": "eager", "dynamo_plugin": TorchDynamoPlugin(backend="eager")},
            "not both",
        ),
    ],
)
def test_bad_dynamo_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Accelerator(cpu=True, **kwargs)  # type: ignore[arg-type]
