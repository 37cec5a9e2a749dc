"""Safetensors headers read without loading tensors, object-state tensors named by their place
in the state (`accelkit ckpt inspect`), and the CLI's table helpers."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from accelkit.checkpointing.catalog.inspect import read_safetensors_header, safetensors_files
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.cli._table import format_age, format_size, render_table
from accelkit.cli.main import main


@pytest.fixture
def mem() -> tuple[Storage, str]:
    url = f"memory://accelkit-inspect-tests/{uuid.uuid4().hex[:12]}"
    return get_storage(url), url


def test_header_matches_the_safetensors_library(mem: tuple[Storage, str], tmp_path) -> None:
    storage, root = mem
    tensors = {
        "a.bf16": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b.i64": torch.arange(7),
        "c.bool": torch.ones(2, 2, 2, dtype=torch.bool),
        "d.scalar": torch.tensor(1.5),
        "e.empty": torch.zeros(0, 4),
    }
    data = save(tensors, metadata={"format": "pt"})
    storage.write_bytes(join(root, "m.safetensors"), data)
    header = read_safetensors_header(storage, join(root, "m.safetensors"))
    assert header.metadata == {"format": "pt"}
    assert header.file_size == len(data)
    local = tmp_path / "m.safetensors"
    local.write_bytes(data)
    with safe_open(str(local), framework="pt") as f:
        expected = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    got = {t.name: (t.dtype, list(t.shape)) for t in header.tensors}
    assert got == expected
    sizes = {t.name: t.nbytes for t in header.tensors}
    assert sizes == {k: v.numel() * v.element_size() for k, v in tensors.items()}


def _t(shape: list[int], offsets: list[int], dtype: str | None = "F32") -> dict[str, object]:
    entry: dict[str, object] = {"shape": shape, "data_offsets": offsets}
    if dtype is not None:
        entry["dtype"] = dtype
    return {"t": entry}


def _file(header: object, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "shorter than the 8-byte prefix"),
        (struct.pack("<Q", 10**12) + b"{}", "header length prefix"),
        (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
        (_file([1, 2]), "not a JSON object"),
        (_file(_t([2], [0, 16]), b"\0" * 8), "data_offsets"),
        (_file(_t([3], [0, 8]), b"\0" * 8), "needs 12 bytes"),
        (_file(_t([-1], [0, 0])), "shape"),
        (_file(_t([1], [0, 4], dtype=None), b"\0" * 4), "dtype"),
    ],
)  # fmt: skip
def test_damaged_headers_are_refused(
    mem: tuple[Storage, str], content: bytes, message: str
) -> None:
    storage, root = mem
    url = join(root, "bad.safetensors")
    storage.write_bytes(url, content)
    with pytest.raises(CorruptCheckpointError) as info:
        read_safetensors_header(storage, url)
    assert message in str(info.value) and url in str(info.value)


def test_index_files_must_stay_in_their_folder(mem: tuple[Storage, str]) -> None:
    storage, root = mem
    index = join(root, "model.safetensors.index.json")
    storage.write_bytes(
        index, json.dumps({"weight_map": {"w": "../../secret.safetensors"}}).encode()
    )
    with pytest.raises(CorruptCheckpointError, match=r"\.\."):
        safetensors_files(storage, index)
    storage.write_bytes(index, json.dumps({"weight_map": {"w": "a.safetensors"}}).encode())
    assert safetensors_files(storage, index) == [("a.safetensors", join(root, "a.safetensors"))]


def test_table_helpers() -> None:
    assert [format_size(n) for n in (0, 1023, 1536, 3 * 1024**3, None)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "3.0 GiB",
        "-",
    ]
    assert [format_age(s) for s in (-3, 59, 61, 7380, 3 * 86400, None)] == [
        "0s",
        "59s",
        "1m",
        "2h",
        "3d",
        "-",
    ]
    table = render_table(["A", "NUM"], [["x", "1"], ["long", "100"]], right=["NUM"])
    assert table.splitlines() == ["A     NUM", "x       1", "long  100"]


# --------------------------------------------------------------------------- object-state names


def _save(folder: Path, named: bool) -> dict[str, torch.Size]:
    """Save a real checkpoint of a 2-layer model and AdamW; returns parameter name -> shape."""
    from accelkit import Accelerator

    accelerator = Accelerator(project_dir=str(folder.parent / "project"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    params = model.named_parameters() if named else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    accelerator.save_state(str(folder))
    return shapes


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["ckpt", "inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
def test_optimizer_tensors_are_named_by_their_place_in_the_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], named: bool
) -> None:
    folder = tmp_path / "ckpt"
    shapes = _save(folder, named)
    code, out, err = _inspect(capsys, str(folder), "--json")
    assert code == 0, err
    tensors = [t for t in json.loads(out)["tensors"] if t["file"] == "optimizer.safetensors"]
    # Parameter ids are positions in the order the optimizer was given its parameters; torch
    # saves their names too when it was built from named_parameters().
    labels = list(shapes) if named else [str(i) for i in range(len(shapes))]
    expected = [
        (f"optimizer/state/{label}/{field}", [] if field == "step" else list(shape))
        for label, shape in zip(labels, shapes.values(), strict=True)
        for field in ("step", "exp_avg", "exp_avg_sq")
    ]
    assert [(t["name"], t["shape"]) for t in tensors] == expected
    assert all(t["key"].startswith("t") for t in tensors)  # the key in the file stays available
    code, table, _ = _inspect(capsys, str(folder))
    assert code == 0
    assert f"optimizer/state/{labels[2]}/exp_avg_sq" in table
    assert not any(line.startswith("t1 ") for line in table.splitlines())
    assert "random_states_0/torch " in table


def test_a_tensor_stored_once_for_two_places_names_both(mem: tuple[Storage, str]) -> None:
    from accelkit.checkpointing.catalog.inspect import state_tensor_names
    from accelkit.checkpointing.formats.state_io import write_state

    storage, root = mem
    shared = torch.ones(3)
    state = {"a": shared, "nested": {"__dict__": 1, "list": [torch.zeros(2), shared]}}
    write_state(storage, root, "custom_checkpoint_0", state)
    names = state_tensor_names(storage, join(root, "custom_checkpoint_0.safetensors"))
    assert sorted(names.values()) == [
        "custom_checkpoint_0/a, custom_checkpoint_0/nested/list/1",
        "custom_checkpoint_0/nested/list/0",
    ]


def test_files_without_an_accelkit_structure_keep_their_keys(mem: tuple[Storage, str]) -> None:
    from accelkit.checkpointing.catalog.inspect import state_tensor_names

    storage, root = mem
    storage.write_bytes(join(root, "model.safetensors"), save({"w": torch.zeros(1)}))
    assert state_tensor_names(storage, join(root, "model.safetensors")) == {}
    storage.write_bytes(join(root, "other.safetensors"), save({"t0": torch.zeros(1)}))
    storage.write_bytes(join(root, "other.json"), b'{"format": "something-else", "state": {}}')
    assert state_tensor_names(storage, join(root, "other.safetensors")) == {}


def test_a_damaged_structure_file_is_an_error_and_the_keys_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    _save(folder, named=False)
    (folder / "optimizer.json").write_bytes(b"[" * 10_000)
    code, out, err = _inspect(capsys, str(folder))
    assert code == 1
    assert "optimizer.json" in err and "nested too deeply" in err
    assert any(line.startswith("t0 ") for line in out.splitlines())


def test_a_structure_file_that_is_a_named_pipe_is_reported_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    _save(folder, named=False)
    (folder / "optimizer.json").unlink()
    os.mkfifo(folder / "optimizer.json")  # opening it to read would wait for a writer forever
    code, out, err = _inspect(capsys, str(folder))
    assert code == 1
    assert "optimizer.json" in err and "not a regular file" in err
    assert any(line.startswith("t0 ") for line in out.splitlines())


def test_a_linked_structure_file_is_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    _save(folder, named=False)
    outside = tmp_path / "outside.json"
    document = json.loads((folder / "optimizer.json").read_text())
    document["state"]["state"] = {"__dict__": [[0, {"secret": {"__tensor__": "t0"}}]]}
    outside.write_text(json.dumps(document))
    (folder / "optimizer.json").unlink()
    (folder / "optimizer.json").symlink_to(outside)
    code, out, err = _inspect(capsys, str(folder))
    assert "secret" not in out
    assert code == 1, (out, err)
    assert "optimizer.json" in err
