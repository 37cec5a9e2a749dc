"""save_state / load_state through a real Accelerator: commit protocol, retention, bad input."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from accelkit.checkpointing.formats.layout import SAVE_MARKER_NAME
from accelkit.checkpointing.storage import join
from accelkit.errors import ConfigurationError
from tests.checkpointing.conftest import Root


class Box:
    """A registered object."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


def _setup(project: str, seed: int = 0, width: int = 4, **config: Any) -> tuple[Any, ...]:
    acc = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, **config
        )
    )
    torch.manual_seed(seed)
    model = nn.Linear(width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return acc, model, opt, sched


def _names(acc: Any) -> list[tuple[str, str]]:
    return [(i.name, i.state) for i in acc._checkpoints.list_checkpoints()]


def _tree(path: str) -> dict[str, tuple[int, int]]:
    out = {}
    for folder, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(folder, f))
            out[os.path.join(folder, f)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.slow
def test_incomplete_folders_are_never_loaded_and_numbering_goes_past_them(root: Root) -> None:
    acc, *_ = _setup(root.url, storage_options=root.options)
    acc.save_state()
    box = Box(7.0)
    acc.register_for_checkpointing(box)
    with pytest.raises(CheckpointMismatchError, match="registered object"):
        acc.load_state()  # saved with no registered object
    first = acc.save_state()
    assert first.endswith("checkpoints/checkpoint_1")
    half = join(root.url, "checkpoints", "checkpoint_5")
    root.storage.write_bytes(join(half, SAVE_MARKER_NAME), b"{}")  # what a save writes first
    root.storage.write_bytes(join(half, "model.safetensors"), b"half written")
    box.value = 0.0

    fresh, *_ = _setup(root.url, seed=1, storage_options=root.options)
    fresh_box = Box()
    fresh.register_for_checkpointing(fresh_box)
    assert fresh.load_state() == first
    assert fresh_box.value == 7.0
    assert fresh.save_iteration == 6  # past checkpoint_5 too: never reuse a folder name
    assert ("checkpoint_5", "incomplete") in _names(fresh)
    with pytest.raises(CheckpointError, match=r"no accelkit\.json"):
        fresh.load_state(half)
    with pytest.raises(CheckpointError, match="does not exist"):
        fresh.load_state(join(root.url, "nowhere"))
    assert fresh.save_state().endswith("checkpoint_6")


def test_retention_after_commit_ignores_stray_and_incomplete_folders(root: Root) -> None:
    acc, *_ = _setup(root.url, total_limit=2, storage_options=root.options)
    ckdir = join(root.url, "checkpoints")
    best = acc.save_state(join(ckdir, "best"))  # a committed checkpoint with another name
    root.storage.write_bytes(join(ckdir, "notes", "readme.txt"), b"user folder")
    root.storage.write_bytes(join(ckdir, "checkpoint_0", SAVE_MARKER_NAME), b"{}")
    root.storage.write_bytes(join(ckdir, "checkpoint_0", "model.safetensors"), b"crashed save")
    acc.project_configuration.iteration = 1
    for _ in range(4):
        acc.save_state()
    names = dict(_names(acc))
    assert names == {
        "best": "committed",
        "checkpoint_0": "incomplete",
        "checkpoint_3": "committed",
        "checkpoint_4": "committed",
    }
    assert root.storage.exists(join(ckdir, "notes", "readme.txt"))
    assert best.endswith("/best")


def test_keep_best_and_keep_every_with_metrics(tmp_path: Any) -> None:
    acc, *_ = _setup(str(tmp_path), total_limit=1, keep_best=1, best_metric="loss", keep_every=3)
    for loss in (5.0, 1.0, 4.0, 3.0, 6.0):
        acc.save_state(metrics={"loss": loss}, metadata={"note": "x"})
    assert [n for n, _ in _names(acc)] == [
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_3",
        "checkpoint_4",
    ]
    manifest = json.loads((tmp_path / "checkpoints/checkpoint_4/accelkit.json").read_text())
    assert manifest["metrics"] == {"loss": 6.0} and manifest["metadata"] == {"note": "x"}
    assert manifest["iteration"] == 4 and manifest["world_size"] == 1


def test_restores_every_object_exactly(tmp_path: Any) -> None:
    acc, model, opt, sched = _setup(str(tmp_path))
    box = Box(3.5)
    acc.register_for_checkpointing(box)
    acc.gradient_state.optimizer_steps = 11
    acc.step = 1  # mid-accumulation: gradients are not saved, so a resume restarts the cycle
    path = acc.save_state()
    other, model2, opt2, sched2 = _setup(str(tmp_path), seed=5)
    box2 = Box()
    other.register_for_checkpointing(box2)
    assert other.load_state(path) == path
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert torch.equal(s1["state"][0]["momentum_buffer"], s2["state"][0]["momentum_buffer"])
    assert s1["param_groups"] == s2["param_groups"]
    assert sched2.state_dict() == sched.state_dict()
    assert box2.value == 3.5
    assert other.gradient_state.optimizer_steps == 11 and other.step == 0
    assert (
        json.loads((tmp_path / "checkpoints/checkpoint_0/accelkit.json").read_text())["step"] == 11
    )


def _corrupt_cases(tmp_path: Any) -> tuple[Any, str]:
    acc, *_ = _setup(str(tmp_path))
    acc.register_for_checkpointing(Box(1.0))
    return acc, acc.save_state(max_shard_size=32)


def _load_fails(tmp_path: Any, path: str, exc: type[Exception], match: str) -> None:
    acc, model, *_ = _setup(str(tmp_path), seed=3)
    box = Box(-1.0)
    acc.register_for_checkpointing(box)
    weight = model.weight.detach().clone()
    before = _tree(str(tmp_path))
    with pytest.raises(exc, match=match):
        acc.load_state(path)
    assert _tree(str(tmp_path)) == before  # a failed load touches nothing on disk
    assert torch.equal(model.weight, weight) and box.value == -1.0  # nor the live objects


def test_truncated_file(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    target = os.path.join(path, "optimizer.safetensors")
    data = Path(target).read_bytes()
    Path(target).write_bytes(data[:-5])
    _load_fails(tmp_path, path, CorruptCheckpointError, r"optimizer\.safetensors")


def test_flipped_byte_fails_the_checksum_and_verify_false_skips_it(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    target = os.path.join(path, "random_states_0.safetensors")
    data = bytearray(Path(target).read_bytes())
    data[-1] ^= 0x01
    Path(target).write_bytes(bytes(data))
    _load_fails(tmp_path, path, CorruptCheckpointError, r"random_states_0.*verify=False")
    acc, *_ = _setup(str(tmp_path))
    acc.register_for_checkpointing(Box())
    acc.load_state(path, verify=False)


def test_missing_shard(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    _load_fails(tmp_path, path, CorruptCheckpointError, r"model-00002-of-00002")


def test_manifest_checksum_mismatch(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    manifest_path = os.path.join(path, "accelkit.json")
    manifest = json.loads(Path(manifest_path).read_text())
    for entry in manifest["files"]:
        if entry["path"] == "scheduler.json":
            entry["checksum"] = "xxh3_128:" + "0" * 32
    Path(manifest_path).write_text(json.dumps(manifest))
    _load_fails(tmp_path, path, CorruptCheckpointError, r"scheduler\.json: checksum")


def test_corrupt_manifest(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    Path(os.path.join(path, "accelkit.json")).write_text('{"format_version": 1, "files": [')
    _load_fails(tmp_path, path, CorruptCheckpointError, r"accelkit\.json: not valid JSON")


def test_fewer_processes_load_with_a_warning(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    source, path = _corrupt_cases(tmp_path)
    manifest_path = os.path.join(path, "accelkit.json")
    manifest = json.loads(Path(manifest_path).read_text())
    manifest["world_size"] = 2
    Path(manifest_path).write_text(json.dumps(manifest))
    acc, model, *_ = _setup(str(tmp_path), seed=3)
    box = Box(-1.0)
    acc.register_for_checkpointing(box)
    with caplog.at_level("WARNING", logger="accelkit.checkpointing.restore.native"):
        acc.load_state(path)
    assert "saved by 2 process(es) and this run has 1" in caplog.text
    assert "--num_processes 2" in caplog.text
    assert box.value == 1.0
    assert torch.equal(model.weight, source.unwrap_model(source._models[0]).weight)


def test_model_key_mismatch_lists_keys(tmp_path: Any) -> None:
    acc, *_ = _setup(str(tmp_path))
    path = acc.save_state()
    other = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    model = other.prepare(nn.Sequential(nn.Linear(4, 2)))
    weight = model[0].weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \['0.weight', '0.bias'\]"):
        other.load_state(path)
    assert torch.equal(model[0].weight, weight)


def test_registered_object_count_mismatch(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    acc, *_ = _setup(str(tmp_path))
    acc.register_for_checkpointing(Box(), Box())
    with pytest.raises(CheckpointMismatchError, match="register_for_checkpointing"):
        acc.load_state(path)


def test_hooks_signatures_handles_and_extra_files(tmp_path: Any) -> None:
    acc, *_ = _setup(str(tmp_path))
    calls: list[Any] = []

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        calls.append(("save", len(models), sorted(weights[0]), output_dir))
        with open(os.path.join(output_dir, "config.yaml"), "w") as f:
            f.write("width: 4\n")

    def load_hook(models: list[Any], input_dir: str) -> None:
        calls.append(("load", len(models), input_dir))

    handle = acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    path = acc.save_state()
    manifest = json.loads(Path(os.path.join(path, "accelkit.json")).read_text())
    assert "config.yaml" in [f["path"] for f in manifest["files"]]  # part of the checkpoint
    acc.load_state()
    assert calls == [("save", 1, ["bias", "weight"], path), ("load", 1, path)]
    handle.remove()
    acc.save_state()
    assert len(calls) == 2

    def skip_model(models: list[Any], weights: list[Any], output_dir: str) -> None:
        weights.clear()

    acc.register_save_state_pre_hook(skip_model)
    path = acc.save_state()
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    acc.register_load_state_pre_hook(lambda models, input_dir: models.clear())
    acc.load_state(path)


def test_register_rejects_objects_without_state_dict_as_accelerate(tmp_path: Any) -> None:
    accelerate = pytest.importorskip("accelerate")
    invalid = (Box(), object(), Box(), [1, 2])
    # Accelerate's method reads only self._custom_objects: called on a stand-in, it shows
    # its error without creating Accelerate's process-wide state in this process.
    stand_in = SimpleNamespace(_custom_objects=[])
    with pytest.raises(Exception) as theirs:
        accelerate.Accelerator.register_for_checkpointing(stand_in, *invalid)
    acc = Accelerator(project_dir=str(tmp_path))
    with pytest.raises(Exception) as ours:
        acc.register_for_checkpointing(*invalid)
    # The same ValueError as Accelerate's, as accelkit's own kind of it: a script's
    # `except ValueError` catches both.
    assert type(theirs.value) is ValueError and isinstance(ours.value, ConfigurationError)
    # Both list the invalid items by name; accelkit gives their positions among the arguments.
    listed = re.findall(r"Item at index (\d+), `(\w+)`", str(ours.value))
    assert listed == [("1", "object"), ("3", "list")]
    assert [name for _, name in listed] == re.findall(r"`(\w+)`$", str(theirs.value), re.M)
    assert "state_dict() and load_state_dict()" in str(ours.value)
    assert stand_in._custom_objects == []


def test_resaving_into_a_folder_removes_stale_files(tmp_path: Any) -> None:
    acc = Accelerator()
    acc.prepare(nn.Linear(2, 2), nn.Linear(2, 3))
    out = str(tmp_path / "ck")
    acc.save_state(out)
    assert os.path.exists(os.path.join(out, "model_1.safetensors"))
    acc2 = Accelerator()
    acc2.prepare(nn.Linear(2, 2))
    acc2.save_state(out)
    files = sorted(os.listdir(out))
    assert "model_1.safetensors" not in files and "model.safetensors" in files
    manifest = json.loads(Path(os.path.join(out, "accelkit.json")).read_text())
    assert sorted(f["path"] for f in manifest["files"]) == [
        f for f in files if f != "accelkit.json"
    ]


def test_automatic_folder_is_never_overwritten(tmp_path: Any) -> None:
    acc, *_ = _setup(str(tmp_path))
    path = acc.save_state()
    before = _tree(path)
    acc.project_configuration.iteration = 0
    with pytest.raises(CheckpointError, match=r"checkpoint_0 already exists.*load_state"):
        acc.save_state()
    assert _tree(path) == before


def test_configuration_and_argument_errors(tmp_path: Any) -> None:
    acc = Accelerator(project_dir=str(tmp_path), project_config=ProjectConfiguration())
    assert acc.project_dir == str(tmp_path) and acc.logging_dir == str(tmp_path)
    assert acc.save_iteration == 0
    with pytest.raises(ValueError, match="automatic_checkpoint_naming"):
        acc.save_state()
    with pytest.raises(CheckpointError, match="No committed checkpoint"):
        acc.load_state()
    with pytest.raises(ValueError, match="project_dir"):
        Accelerator().load_state()
    with pytest.raises(TypeError, match="ProjectConfiguration"):
        Accelerator(project_config={"project_dir": "x"})


def test_accelerator_save_paths_urls_and_safetensors(tmp_path: Any) -> None:
    acc = Accelerator()
    acc.save({"a": [1, 2]}, str(tmp_path / "sub" / "obj.pt"))
    loaded = torch.load(str(tmp_path / "sub" / "obj.pt"), weights_only=True)
    assert loaded == {"a": [1, 2]}
    acc.save({"w": torch.ones(2)}, "memory://accelkit-tests/save/w.safetensors", True)
    from accelkit.checkpointing.formats.safetensors_io import read_safetensors
    from accelkit.checkpointing.storage import get_storage

    url = "memory://accelkit-tests/save/w.safetensors"
    tensors, _ = read_safetensors(get_storage(url), url)
    assert torch.equal(tensors["w"], torch.ones(2))
    with pytest.raises(TypeError, match="dict of tensors"):
        acc.save([1], str(tmp_path / "x.safetensors"), safe_serialization=True)


def test_grad_scaler_state_is_restored(tmp_path: Any) -> None:
    acc, *_ = _setup(str(tmp_path))
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    path = acc.save_state()
    other, *_ = _setup(str(tmp_path), seed=1)
    other.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    other.load_state(path)
    assert other.scaler.get_scale() == 1024.0
    assert other.scaler.state_dict()["growth_interval"] == 7


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_and_optimizer_roundtrip(tmp_path: Any) -> None:
    acc = Accelerator(project_dir=str(tmp_path))
    torch.manual_seed(0)
    model = nn.Linear(64, 64).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    model(torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)).sum().backward()
    opt.step()
    path = acc.save_state(str(tmp_path / "ck"))
    other = Accelerator(project_dir=str(tmp_path))
    torch.manual_seed(1)
    model2 = nn.Linear(64, 64).cuda().to(torch.bfloat16)
    opt2 = torch.optim.AdamW(model2.parameters())
    model2, opt2 = other.prepare(model2, opt2)
    other.load_state(path)
    assert torch.equal(model2.weight, model.weight) and model2.weight.is_cuda
    state = opt2.state_dict()["state"][0]
    assert state["exp_avg"].is_cuda
    assert torch.equal(state["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_flipped_byte_in_model_weights(tmp_path: Any) -> None:
    _, path = _corrupt_cases(tmp_path)
    target = Path(path) / "model-00001-of-00002.safetensors"
    data = bytearray(target.read_bytes())
    data[-2] ^= 0x40
    target.write_bytes(bytes(data))
    _load_fails(tmp_path, path, CorruptCheckpointError, r"model-00001-of-00002.*checksum")


def test_loaded_state_survives_rewrite_and_deletion_of_its_files(tmp_path: Any) -> None:
    acc, _, opt, _ = _setup(str(tmp_path))
    out = str(tmp_path / "ck")
    acc.save_state(out)
    expected = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    acc.load_state(out)  # local tensors may map the files (like torch.load(mmap=True))
    acc.save_state(out)  # rewriting the same folder writes new files, never in place
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))
    buffer = opt.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buffer, expected)
    buffer.add_(1.0)  # still writable (copy-on-write), and no longer tied to any file
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], expected + 1.0)


def test_the_run_counter_reads_and_writes_through_the_configuration(tmp_path: Any) -> None:
    """The manager owns the counter; ``ProjectConfiguration.iteration`` shows it, and a number
    the user writes there is the next one used (as Accelerate documents)."""
    acc, *_ = _setup(str(tmp_path), iteration=3)
    assert acc.save_state().endswith("checkpoint_3")
    assert acc.project_configuration.iteration == acc.save_iteration == 4
    acc.project_configuration.iteration = 10
    assert acc.save_iteration == 10 and acc.save_state().endswith("checkpoint_10")
    assert acc.project_configuration.iteration == 11
    with pytest.raises(CheckpointError, match="already exists"):
        acc.project_configuration.iteration = 3
        acc.save_state()
    # Refused once; the counter moves past every existing checkpoint_<n>, so the run is not
    # stuck: the next save succeeds.
    assert acc.save_iteration == 11
    assert acc.save_state().endswith("checkpoint_11")
    assert acc.save_iteration == 12
    fresh, *_ = _setup(str(tmp_path))
    fresh.load_state()
    assert fresh.project_configuration.iteration == fresh.save_iteration == 12
