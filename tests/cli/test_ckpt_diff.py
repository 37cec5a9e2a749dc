"""`accelkit ckpt diff A B`: checkpoints written by the real `Accelerator.save_state` on CPU,
compared through the console entry point (exit 0 equal, 1 different, 2 error)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog import diff as diff_module
from accelkit.checkpointing.catalog.diff import diff_checkpoints
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage import get_storage
from accelkit.cli.main import main
from tests.checkpointing.test_diff_values import _rules


class Counter:
    """A registered custom object."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "history": torch.arange(3.0) * self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))


def _save(
    folder: Path,
    edit: Callable[[torch.nn.Module, Any], None] | None = None,
    model: torch.nn.Module | None = None,
    counter: int = 1,
    rng_seed: int = 0,
) -> str:
    """One AdamW step on a fixed batch, ``edit(model, optimizer)``, then ``save_state``."""
    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=str(folder.parent))
    )
    model = model if model is not None else _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(Counter(counter))
    batch = torch.arange(12.0).reshape(3, 4) / 12
    accelerator.backward(model(batch).square().sum())
    optimizer.step()
    if edit is not None:
        with torch.no_grad():
            edit(model, optimizer)
    torch.manual_seed(rng_seed)
    return accelerator.save_state(str(folder))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save(tmp_path_factory.mktemp("a") / "ckpt")


def _diff(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["ckpt", "diff", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _json(a: str, b: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code, out, _ = _diff(a, b, "--json", capsys=capsys)
    return code, json.loads(out)


def test_equal_checkpoints_exit_0(base: str, tmp_path: Path, capsys) -> None:
    other = _save(tmp_path / "ckpt")
    code, out, _ = _diff(base, other, capsys=capsys)
    assert code == 0, out
    assert "Equal" in out
    code, doc = _json(base, other, capsys)
    assert code == 0 and doc["equal"] is True and doc["tensors"] == [] and doc["values"] == []
    assert doc["tensors_compared"] > 4 and doc["bytes_read"] > 0


def test_one_changed_weight_is_named_with_its_max_abs_and_rel_diff(
    base: str, tmp_path: Path, capsys
) -> None:
    def edit(model: torch.nn.Module, optimizer: Any) -> None:
        model[0].weight[1, 2] *= 1.25  # relative change 0.25 exactly (a power of two)

    other = _save(tmp_path / "ckpt", edit)
    code, out, _ = _diff(base, other, capsys=capsys)
    assert code == 1
    assert "model/0.weight" in out
    code, doc = _json(base, other, capsys)
    assert code == 1
    (change,) = doc["tensors"]
    value = float(load_file(str(Path(base) / "model.safetensors"))["0.weight"][1, 2])
    assert change["name"] == "model/0.weight" and change["change"] == "values"
    assert change["changed_elements"] == 1
    assert change["max_abs_diff"] == pytest.approx(abs(value) * 0.25, rel=1e-6)
    assert change["max_rel_diff"] == pytest.approx(0.25, rel=1e-6)
    assert doc["values"] == []


def test_dtype_and_shape_changes(base: str, tmp_path: Path, capsys) -> None:
    def edit(model: torch.nn.Module, optimizer: Any) -> None:
        model[1].bias.data = model[1].bias.data.double()  # after the step, before the save

    other = _save(tmp_path / "ckpt", edit)
    code, doc = _json(base, other, capsys)
    assert code == 1
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/1.bias"]["change"] == "dtype"
    assert by_name["model/1.bias"]["dtype"] == ["F32", "F64"]
    assert by_name["model/1.bias"]["max_abs_diff"] == 0.0  # same values, compared in float64

    wide = _save(tmp_path / "wide", model=_model(width=16))
    code, doc = _json(base, wide, capsys)
    assert code == 1
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/0.weight"]["change"] == "shape"
    assert by_name["model/0.weight"]["shape"] == [[8, 4], [16, 4]]
    assert by_name["optimizer/state/0/exp_avg"]["change"] == "shape"


def test_added_and_removed_tensors(base: str, tmp_path: Path, capsys) -> None:
    model = _model()
    model.register_buffer("extra", torch.ones(3))
    other = _save(tmp_path / "ckpt", model=model)
    code, doc = _json(base, other, capsys)
    assert code == 1
    assert {(t["name"], t["change"]) for t in doc["tensors"]} == {("model/extra", "added")}
    code, doc = _json(other, base, capsys)
    assert code == 1
    assert {(t["name"], t["change"]) for t in doc["tensors"]} == {("model/extra", "removed")}


def test_optimizer_hyperparameters_custom_object_and_rng(base: str, tmp_path: Path, capsys) -> None:
    def edit(model: torch.nn.Module, optimizer: Any) -> None:
        optimizer.param_groups[0]["lr"] = 0.5

    other = _save(tmp_path / "ckpt", edit, counter=2, rng_seed=1)
    code, doc = _json(base, other, capsys)
    assert code == 1
    values = {v["name"]: (v["a"], v["b"]) for v in doc["values"]}
    assert values["optimizer/param_groups/0/lr"] == (0.01, 0.5)
    assert values["custom_checkpoint_0/value"] == (1, 2)
    names = {t["name"] for t in doc["tensors"]}
    assert "custom_checkpoint_0/history" in names
    assert "random_states_0/torch" in names  # torch's generator state
    assert not any(n.startswith("model/") for n in names)


def test_different_iteration_and_step(tmp_path: Path, capsys) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    accelerator.prepare(_model(), torch.optim.SGD(_model().parameters()))
    first = accelerator.save_state()
    second = accelerator.save_state()
    code, doc = _json(first, second, capsys)
    assert code == 1
    assert {v["name"]: (v["a"], v["b"]) for v in doc["values"]} == {"checkpoint/iteration": (0, 1)}
    assert doc["tensors"] == []


def test_bad_paths_exit_2_with_the_path_and_the_fix(base: str, tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nope")
    code, out, err = _diff(base, missing, capsys=capsys)
    assert code == 2 and out == ""
    assert missing in err and "does not exist" in err and "accelkit.json" in err
    assert "accelkit ckpt ls" in err
    folder = tmp_path / "empty"
    folder.mkdir()
    code, _, err = _diff(str(folder), base, capsys=capsys)
    assert code == 2 and str(folder) in err and "accelkit.json" in err


def test_a_damaged_file_is_an_error_not_a_difference(base: str, tmp_path: Path, capsys) -> None:
    other = Path(_save(tmp_path / "ckpt"))
    data = bytearray((other / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    (other / "model.safetensors").write_bytes(bytes(data))
    code, _, err = _diff(base, str(other), capsys=capsys)
    assert code == 2
    assert "model.safetensors" in err and "checksum" in err


def test_python_function_on_fsspec_memory(base: str, tmp_path: Path) -> None:
    local = get_storage(base)
    url = f"memory://accelkit-diff-tests/{tmp_path.name}/ckpt"
    remote = get_storage(url)
    for name in local.walk_files(base):
        remote.write_bytes(f"{url}/{name}", local.read_bytes(f"{base}/{name}"))
    diff = diff_checkpoints(local, base, remote, url)
    assert diff.equal, diff.to_json()


# ----------------------------------------------------------------- read ahead, piece by piece


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("accelkit-diff-read")]


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 8 bytes and one piece read ahead: every tensor spans many pieces, and the
    readers wait on the comparison all the time."""
    monkeypatch.setattr(diff_module, "_PIECE", 8)
    monkeypatch.setattr(diff_module, "_READ_AHEAD", 1)


def test_tensors_in_another_order_and_dtype_give_the_same_figures(
    tmp_path: Path, small_pieces: None
) -> None:
    """A stores 1.bias (F64) first; B stores 0.weight (F64 there) first, so it is read ahead of
    its twin and compared whole with A's F32 one; 1.weight (F16 in A, BF16 in B) comes last
    on both sides and is compared whole too; A's extra buffer is read past; the rest is
    compared piece by piece. Every figure is the elementwise rules' on the tensors as stored."""

    def edit_a(model: torch.nn.Module, optimizer: Any) -> None:
        model[1].bias.data = model[1].bias.data.double()
        model[0].weight[0, 0] = 0.0
        model[1].weight.data = model[1].weight.data.half()
        model.register_buffer("extra", torch.ones(5))

    def edit_b(model: torch.nn.Module, optimizer: Any) -> None:
        model[1].bias.data = model[1].bias.data.double() * 2
        model[0].weight.data = model[0].weight.data.double()
        model[0].weight[0, 0] = 0.5  # 0 in A: an infinite relative difference
        model[1].weight.data = model[1].weight.data.bfloat16()
        model[1].weight[1, 1] = math.nan

    a = _save(tmp_path / "a", edit_a)
    b = _save(tmp_path / "b", edit_b)
    diff = diff_checkpoints(get_storage(a), a, get_storage(b), b)
    tensors_a = load_file(str(Path(a) / "model.safetensors"))
    tensors_b = load_file(str(Path(b) / "model.safetensors"))
    got = {t.name: t for t in diff.tensors if t.name.startswith("model/")}
    assert got.pop("model/extra").change == "removed"
    for key in tensors_b:
        expected = _rules(tensors_a[key], tensors_b[key])
        change = got.get(f"model/{key}")
        if tensors_a[key].dtype != tensors_b[key].dtype:
            assert change is not None and change.change == "dtype"
            assert (change.max_abs, change.max_rel, change.changed) == (expected or (0.0, 0.0, 0))
        elif expected is None:
            assert change is None, change
        else:
            assert change is not None and change.change == "values"
            assert (change.max_abs, change.max_rel, change.changed) == expected
    assert got["model/0.weight"].max_rel == math.inf
    assert got["model/1.weight"].change == "dtype"
    assert got["model/1.weight"].max_abs == math.inf  # a NaN on one side only
    assert not _reader_threads()


def test_equal_checkpoints_holding_nans_and_infinities(
    tmp_path: Path, small_pieces: None, capsys
) -> None:
    def edit(model: torch.nn.Module, optimizer: Any) -> None:
        model[0].weight[0] = torch.tensor([math.nan, math.inf, -math.inf, -0.0])

    a = _save(tmp_path / "a", edit)
    b = _save(tmp_path / "b", edit)
    code, doc = _json(a, b, capsys)
    assert code == 0 and doc["equal"] is True, doc
    assert not _reader_threads()


def test_damaged_a_raises_and_stops_both_readers(
    base: str, tmp_path: Path, small_pieces: None, capsys
) -> None:
    """A's model file is damaged in its first tensor: the error comes out once A's reader
    reaches the file's end, while B's reader waits for a buffer; both threads end."""
    damaged = Path(_save(tmp_path / "ckpt"))
    data = bytearray((damaged / "model.safetensors").read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header] ^= 0xFF  # the first data byte: same size, only the checksum can tell
    (damaged / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*checksum"):
        diff_checkpoints(get_storage(base), str(damaged), get_storage(base), base)
    assert not _reader_threads()
    code, _, err = _diff(str(damaged), base, capsys=capsys)
    assert code == 2 and "checksum" in err


def test_damaged_b_behind_many_pieces_raises(base: str, tmp_path: Path, small_pieces: None) -> None:
    damaged = Path(_save(tmp_path / "ckpt"))
    data = bytearray((damaged / "optimizer.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (damaged / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.safetensors.*checksum"):
        diff_checkpoints(get_storage(base), base, get_storage(base), str(damaged))
    assert not _reader_threads()


def test_a_reader_closed_early_stops_waiting_for_buffers(base: str, small_pieces: None) -> None:
    """A consumer that stops after one piece (an error of its own): close() ends the thread,
    which is waiting for a buffer, and the file it was reading is closed."""
    side = diff_module._Side.open(get_storage(base), base)
    reader = diff_module._Reader(side, side.models["model"])
    pieces = iter(reader)
    _, _, offset, piece = next(pieces)
    assert offset == 0 and piece.numel() <= 8
    reader.close()
    assert not _reader_threads()
