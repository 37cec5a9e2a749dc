"""The table of object kinds is the one source of file names: every name a save writes is
recognised as a state file, every pattern agrees with the stems, and Hugging Face accelerate's
files are told apart from accelkit's."""

from __future__ import annotations

import pytest

from accelkit.checkpointing.formats.layout import (
    KINDS,
    STRUCTURE_SUFFIX,
    TENSORS_SUFFIX,
    TORCH_SUFFIX,
    custom_stem,
    dataloader_stem,
    index_name,
    is_state_file,
    looks_like_accelerate,
    model_file,
    object_stem,
    random_states_stem,
    shard_names,
)


def _written_names() -> list[str]:
    names = [model_file(i) for i in range(3)] + [index_name("model"), index_name("model_1")]
    names += shard_names("model", 3) + shard_names("model_2", 2)
    stems = [object_stem(k, i) for k in ("optimizer", "scheduler") for i in range(3)]
    stems += [object_stem("scaler"), dataloader_stem(0), custom_stem(4), random_states_stem(7)]
    for suffix in (STRUCTURE_SUFFIX, TENSORS_SUFFIX, TORCH_SUFFIX):
        names += [stem + suffix for stem in stems]
    return names


def test_every_name_a_save_writes_is_a_state_file_and_nothing_else_is() -> None:
    names = _written_names()
    assert [n for n in names if not is_state_file(n)] == []
    assert model_file(0) == "model.safetensors" and model_file(2) == "model_2.safetensors"
    assert shard_names("model", 2) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    strangers = [
        "notes.txt",
        "model_x.safetensors",
        "scaler_1.json",  # there is one scaler
        "dataloader.json",  # dataloaders are always numbered
        "optimizer.bin",
        "model-00001-of-00002.safetensors.index.json",
        "best",
    ]
    assert [n for n in strangers if is_state_file(n)] == []
    # "scaler.pt" is in both tables (accelerate's scaler file has that very name; accelkit
    # writes it only for a scaler state JSON cannot hold); every other name tells them apart.
    assert [n for n in names if looks_like_accelerate([n])] == ["scaler.pt"]


def test_kind_patterns_capture_the_index_of_the_stem() -> None:
    for kind, kind_table in KINDS.items():
        if kind in ("model", "scaler"):
            continue
        regex = kind_table.regex((STRUCTURE_SUFFIX,))
        for index in (0, 1, 12):
            match = regex.match(object_stem(kind, index) + STRUCTURE_SUFFIX)
            assert match is not None and int(match.group(1) or 0) == index, (kind, index)
        assert regex.match(object_stem(kind, 1) + TENSORS_SUFFIX) is None
    model = KINDS["model"].regex(shards=False)
    assert [int(model.match(n).group(1) or 0) for n in (model_file(0), index_name("model_3"))] == [
        0,
        3,
    ]
    assert model.match(shard_names("model", 2)[0]) is None


def test_accelerate_checkpoints_are_recognised() -> None:
    for name in ("optimizer.bin", "pytorch_model_1.bin", "scaler.pt", "random_states_0.pkl"):
        assert looks_like_accelerate(["model.safetensors", name]), name
    assert not looks_like_accelerate(["sub/optimizer.bin", "model.safetensors"])


def test_bad_kinds_and_indexes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Unknown object kind 'optimiser'.*'optimizer'"):
        object_stem("optimiser")
    with pytest.raises(ValueError, match="only one 'scaler'"):
        object_stem("scaler", 1)


def test_accelerates_file_names_come_from_one_table() -> None:
    from accelkit.checkpointing.formats.layout import ACCELERATE_KINDS
    from accelkit.checkpointing.interop import accelerate_format as reader

    for kind, pattern in reader._INDEXED.items():
        if kind != "model":
            assert pattern.pattern == ACCELERATE_KINDS[kind].regex().pattern, kind
    assert reader._RNG_FILE.pattern == ACCELERATE_KINDS["random_states"].regex().pattern
    model = reader._INDEXED["model"]
    written = [
        "model.safetensors",
        "model_1.safetensors",
        "pytorch_model.bin",
        "pytorch_model_2.bin",
    ]
    never = ["model_1.bin", "pytorch_model_1.safetensors", "model-00001-of-00002.safetensors"]
    assert all(model.match(n) for n in written)
    assert not any(model.match(n) for n in never)
