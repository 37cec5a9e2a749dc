"""The module paths Accelerate's scripts import from beyond ``accelerate.utils`` itself:
``accelerate.utils.modeling`` and ``accelerate.utils.random``, as ``accelkit.utils.modeling`` and
``accelkit.utils.random``.

Every function those reference modules define either exists here, bindable the same way and the
very object ``accelkit.utils`` exports, or imports and refuses by name with
:class:`OutOfScopeError`. ``load_checkpoint_in_model`` puts into a model exactly the tensors of
the file (safetensors, ``.bin``, or shards with an index), as the reference's function does.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import accelkit.utils
from accelkit.out_of_scope import OUT_OF_SCOPE, OutOfScopeError
from tests.compat._signatures import incompatibilities

reference_modeling = pytest.importorskip("accelerate.utils.modeling")
reference_random = pytest.importorskip("accelerate.utils.random")

PATHS = {
    "accelerate.utils.modeling": ("accelkit.utils.modeling", reference_modeling),
    "accelerate.utils.random": ("accelkit.utils.random", reference_random),
}


def _defined_names() -> list[object]:
    """Every public function and class the reference module defines itself (not its imports)."""
    return [
        pytest.param(path, name, id=f"{path}.{name}")
        for path, (_, module) in PATHS.items()
        for name, value in sorted(vars(module).items())
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


@pytest.mark.parametrize(("path", "name"), _defined_names())
def test_reference_name_is_provided_or_refused_by_name(path: str, name: str) -> None:
    ours_path, theirs_module = PATHS[path]
    ours = importlib.import_module(ours_path)
    exec(f"from {ours_path} import {name}", {})  # the port of `from {path} import {name}`
    value = getattr(ours, name)
    if name in OUT_OF_SCOPE:
        with pytest.raises(OutOfScopeError, match=rf"^{name}: {re.escape(OUT_OF_SCOPE[name])}"):
            value()
        return
    assert name in ours.__all__
    assert value is getattr(accelkit.utils, name), "re-exported, not a second copy"
    assert incompatibilities(getattr(theirs_module, name), value) == []


def test_random_path_seeds_as_accelkit_utils() -> None:
    from accelkit.utils.random import set_seed

    set_seed(7)
    first = torch.rand(3)
    accelkit.utils.set_seed(7)
    assert torch.equal(first, torch.rand(3))


def test_names_outside_the_reference_module_are_not_served() -> None:
    import accelkit.utils.modeling

    # an out-of-scope name of another reference module is not importable from this path
    assert "DeepSpeedPlugin" in OUT_OF_SCOPE
    with pytest.raises(ImportError, match="DeepSpeedPlugin"):
        exec("from accelkit.utils.modeling import DeepSpeedPlugin", {})
    assert inspect.ismodule(accelkit.utils.modeling)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
        self.norm = torch.nn.BatchNorm1d(3)  # buffers, an int64 one included


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = _Net()
    net.norm.running_mean.uniform_()
    net.norm.num_batches_tracked.fill_(5)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _write(kind: str, folder: Path, weights: dict[str, torch.Tensor]) -> str:
    """Write ``weights`` as ``kind`` under ``folder``; returns what to pass as ``checkpoint``."""
    if kind == "safetensors file":
        save_file(weights, folder / "model.safetensors")
        return str(folder / "model.safetensors")
    if kind == "bin file":
        torch.save(weights, folder / "pytorch_model.bin")
        return str(folder / "pytorch_model.bin")
    # shards of another writer's naming, with the only *.index.json in the folder
    names = sorted(weights)
    shards = {"weights-1-of-2.safetensors": names[::2], "weights-2-of-2.safetensors": names[1::2]}
    for file_name, keys in shards.items():
        save_file({k: weights[k] for k in keys}, folder / file_name)
    weight_map = {k: file_name for file_name, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "weights.safetensors.index.json").write_text(json.dumps(index))
    return str(folder)


@pytest.mark.parametrize("kind", ["safetensors file", "bin file", "sharded folder"])
def test_load_checkpoint_in_model_loads_the_file_bit_for_bit(kind: str, tmp_path: Path) -> None:
    from accelkit.utils.modeling import load_checkpoint_in_model

    weights = _weights(seed=1)
    checkpoint = _write(kind, tmp_path, weights)
    ours, theirs = _Net(), _Net()
    assert not torch.equal(ours.body[0].weight, weights["body.0.weight"])

    load_checkpoint_in_model(ours, checkpoint)
    reference_modeling.load_checkpoint_in_model(theirs, checkpoint)

    loaded, reference = ours.state_dict(), theirs.state_dict()
    assert loaded.keys() == weights.keys() == reference.keys()
    for key, stored in weights.items():
        for got in (loaded[key], reference[key]):
            assert got.dtype == stored.dtype and got.shape == stored.shape, key
            assert got.view(-1).view(torch.uint8).tolist() == (
                stored.view(-1).view(torch.uint8).tolist()
            ), key


def test_load_checkpoint_in_model_refuses_a_folder_with_two_indexes(tmp_path: Path) -> None:
    from accelkit.utils.modeling import load_checkpoint_in_model

    _write("sharded folder", tmp_path, _weights(seed=2))
    index = tmp_path / "weights.safetensors.index.json"
    (tmp_path / "other.safetensors.index.json").write_text(index.read_text())
    with pytest.raises(ValueError, match=r"several indexes .*other\.safetensors\.index\.json"):
        load_checkpoint_in_model(_Net(), str(tmp_path))
    load_checkpoint_in_model(model := _Net(), str(index))  # naming the index works
    assert torch.equal(model.embed.weight, _weights(seed=2)["embed.weight"])
