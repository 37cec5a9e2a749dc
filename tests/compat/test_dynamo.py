"""Accelerator(dynamo_backend=...) compiles prepared models with torch.compile."""

from __future__ import annotations

import os

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


_LAUNCH_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
    "ACCELERATE_DYNAMO_MODE": "reduce-overhead",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "true",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
}


@pytest.mark.parametrize(
    ("environment", "kwargs"),
    [
        ({}, {}),
        ({}, {"backend": "eager", "mode": "max-autotune", "use_regional_compilation": True}),
        (_LAUNCH_ENV, {}),
        ({"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER"}, {"fullgraph": True, "dynamic": False}),
    ],
)
def test_to_kwargs_equals_accelerates(
    environment: dict[str, str], kwargs: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The settings a launch put in the environment are settings, not defaults: to_kwargs
    # passes them on, with the backend as a lower-case name.
    accelerate_dataclasses = pytest.importorskip("accelerate.utils.dataclasses")
    for name in list(os.environ):
        if "_DYNAMO_" in name:
            monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    theirs = accelerate_dataclasses.TorchDynamoPlugin(**kwargs).to_kwargs()
    before = dict(os.environ)
    ours = TorchDynamoPlugin(**kwargs).to_kwargs()
    assert ours == theirs
    assert dict(os.environ) == before  # the environment emptied for the defaults is back
    assert all(type(value) is not DynamoBackend for value in ours.values())
