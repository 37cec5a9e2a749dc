"""save_model / load_checkpoint_in_model: one file, HF-style shards, tied weights, stale files."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from accelkit.checkpointing import load_checkpoint_in_model, save_model
from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.checkpointing.storage import join
from tests.checkpointing.conftest import Root


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))


def _fresh(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_single_file_roundtrip_with_tied_weights(root: Root) -> None:
    model = _fresh(0)
    names = save_model(model, root.url, storage_options=root.options)
    assert names == ["model.safetensors"]
    other = _fresh(1)
    load_checkpoint_in_model(other, root.url, storage_options=root.options)
    assert _same(model, other)
    assert other.head.weight is other.embed.weight  # still tied after loading


def test_sharded_save_is_hugging_face_format(root: Root) -> None:
    model = _fresh(0)
    names = save_model(model, root.url, max_shard_size="4KB", storage_options=root.options)
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in names
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads(root.storage.read_bytes(join(root.url, "model.safetensors.index.json")))
    own = model.state_dict()
    assert set(index["weight_map"]) == set(own) - {"head.weight"}  # tied copy stored once
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in own.items() if k != "head.weight"
    )
    assert set(index["weight_map"].values()) == set(shards)
    for target in (root.url, join(root.url, "model.safetensors.index.json")):
        other = _fresh(2)
        load_checkpoint_in_model(other, target, storage_options=root.options)
        assert _same(model, other)


def test_local_shards_open_with_safetensors(tmp_path: Any) -> None:
    model = _fresh(0)
    save_model(model, str(tmp_path), max_shard_size=3000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for name, file_name in index["weight_map"].items():
        with safe_open(str(tmp_path / file_name), "pt") as f:
            assert torch.equal(f.get_tensor(name), model.state_dict()[name])


def test_stale_files_of_an_earlier_save_are_removed(tmp_path: Any) -> None:
    first = _fresh(0)
    save_model(first, str(tmp_path), max_shard_size="2KB")
    (tmp_path / "pytorch_model.bin").write_bytes(b"old pickle")
    (tmp_path / "config.json").write_text("{}")
    second = _fresh(5)
    assert save_model(second, str(tmp_path)) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = _fresh(9)
    load_checkpoint_in_model(loaded, str(tmp_path))
    assert _same(loaded, second)
    save_model(first, str(tmp_path), max_shard_size="2KB")  # and back to shards
    assert not (tmp_path / "model.safetensors").exists()
    load_checkpoint_in_model(loaded, str(tmp_path))
    assert _same(loaded, first)


def test_index_leaving_the_folder_is_refused(tmp_path: Any) -> None:
    save_model(_fresh(0), str(tmp_path / "m"), max_shard_size="2KB")
    index_path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for bad in ("../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"):
        key = next(iter(index["weight_map"]))
        index["weight_map"][key] = bad
        index_path.write_text(json.dumps(index))
        with pytest.raises(CorruptCheckpointError, match=r"inside|allowed|relative"):
            load_checkpoint_in_model(_fresh(1), str(index_path))


def test_missing_shard_names_it(tmp_path: Any) -> None:
    names = save_model(_fresh(0), str(tmp_path), max_shard_size="2KB")
    (tmp_path / names[1]).unlink()
    with pytest.raises(CorruptCheckpointError, match=names[1]):
        load_checkpoint_in_model(_fresh(1), str(tmp_path))


def test_key_mismatch_lists_missing_and_unexpected(tmp_path: Any) -> None:
    save_model(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), str(tmp_path))
    target = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint_in_model(target, str(tmp_path))
    message = str(info.value)
    assert "missing keys ['2.weight', '2.bias']" in message
    assert "unexpected keys ['1.bias', '1.weight']" in message
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # untouched
    partial = nn.Sequential(nn.Linear(3, 4))
    load_checkpoint_in_model(partial, str(tmp_path / "model.safetensors"), strict=False)


def test_device_map_and_bad_arguments(tmp_path: Any) -> None:
    model = _fresh(0)
    save_model(model, str(tmp_path))
    other = _fresh(3)
    load_checkpoint_in_model(other, str(tmp_path), device_map={"": "cpu"})
    assert _same(model, other)
    with pytest.raises(ValueError, match="offloading"):
        load_checkpoint_in_model(other, str(tmp_path), device_map={"body": "disk"})
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        load_checkpoint_in_model(other, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No model\.safetensors"):
        load_checkpoint_in_model(other, str(tmp_path / "empty"))


class _Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("touch /tmp/accelkit-model-pwned",))


def test_pickled_weights_on_request_and_never_unsafely_loaded(tmp_path: Any) -> None:
    model = _fresh(0)
    assert save_model(model, str(tmp_path), safe_serialization=False) == ["pytorch_model.bin"]
    other = _fresh(1)
    load_checkpoint_in_model(other, str(tmp_path))
    assert _same(model, other) and other.head.weight is other.embed.weight
    names = save_model(model, str(tmp_path), max_shard_size="3KB", safe_serialization=False)
    assert "pytorch_model.bin.index.json" in names and "pytorch_model.bin" not in names
    load_checkpoint_in_model(_fresh(2), str(tmp_path / "pytorch_model.bin.index.json"))
    save_model(model, str(tmp_path))  # back to safetensors: the pickles go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]

    torch.save({"w": _Evil()}, str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(CorruptCheckpointError, match="weights_only"):
        load_checkpoint_in_model(_fresh(3), str(tmp_path / "pytorch_model.bin"))
    assert not os.path.exists("/tmp/accelkit-model-pwned")


def test_index_through_a_symlinked_folder_is_refused(tmp_path: Any) -> None:
    outside = tmp_path / "outside"
    save_model(_fresh(0), str(outside), max_shard_size="2KB")
    folder = tmp_path / "m"
    save_model(_fresh(1), str(folder), max_shard_size="2KB")
    (folder / "sub").symlink_to(outside)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        load_checkpoint_in_model(_fresh(2), str(index_path))


def test_load_checkpoint_in_model_takes_accelerates_dtype_and_refuses_offloading(
    tmp_path: Any,
) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    save_model(source, str(tmp_path))
    target = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    # Positionally, as Accelerate's signature has it: device_map, offload_folder, dtype.
    load_checkpoint_in_model(
        target, str(tmp_path), None, None, torch.bfloat16, keep_in_fp32_modules=["1"]
    )
    assert target[0].weight.dtype == torch.bfloat16
    assert target[1].weight.dtype == torch.float32  # kept in float32
    assert torch.equal(target[0].weight, source[0].weight.to(torch.bfloat16))
    assert torch.equal(target[1].weight, source[1].weight)
    for option in (
        {"offload_folder": str(tmp_path / "off")},
        {"offload_state_dict": True},
        {"offload_8bit_bnb": True},
        {"broadcast_from_rank0": True},
        {"full_state_dict": False},
    ):
        name = next(iter(option))
        with pytest.raises(ValueError, match=rf"{name}=.*out of accelkit's scope"):
            load_checkpoint_in_model(target, str(tmp_path), **option)
    with pytest.raises(ValueError, match="not a torch dtype"):
        load_checkpoint_in_model(target, str(tmp_path), dtype="float99")
