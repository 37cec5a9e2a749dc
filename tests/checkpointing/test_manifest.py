"""The manifest: strict parsing, verification, and the catalog built on it."""

from __future__ import annotations

import json

import pytest

from accelkit.checkpointing.catalog.listing import (
    COMMITTED,
    CORRUPT,
    INCOMPLETE,
    latest_checkpoint,
    list_checkpoints,
    next_iteration,
    resolve_checkpoints_root,
)
from accelkit.checkpointing.formats.layout import (
    SAVE_MARKER_NAME,
    check_relative_path,
    checkpoint_name,
    is_state_file,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    read_manifest,
    verify_files,
    write_manifest,
)
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.checksum import checksum_bytes, parse_checksum
from tests.checkpointing.conftest import Root


def _good() -> dict[str, object]:
    m = Manifest(
        iteration=3,
        step=12,
        world_size=2,
        files=[FileEntry("model.safetensors", 4, checksum_bytes(b"abcd"))],
        metadata={"note": "x"},
        metrics={"loss": 0.5},
        accelkit_version="0.1.0",
        torch_version="2.4",
    )
    data: dict[str, object] = json.loads(m.to_json())
    return data


def test_roundtrip() -> None:
    m = Manifest.from_json(json.dumps(_good()))
    assert (m.iteration, m.step, m.world_size) == (3, 12, 2)
    assert m.metrics == {"loss": 0.5} and m.metadata == {"note": "x"}
    assert m.file_map()["model.safetensors"].size == 4
    assert m.total_size == 4
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d.update(step="1"), "'step' has type str"),
        (lambda d: d.update(world_size=True), "must not be a boolean"),
        (lambda d: d.update(world_size=0), "world_size"),
        (lambda d: d.update(format_version=99), "upgrade accelkit"),
        (lambda d: d["files"][0].update(path="/etc/passwd"), "relative path"),
        (lambda d: d["files"][0].update(path="../x"), r"'\.\.'"),
        (lambda d: d["files"][0].update(path="a/../../x"), r"'\.\.'"),
        (lambda d: d["files"][0].update(path="C:\\x"), "relative path"),
        (lambda d: d["files"][0].update(size=-1), "size"),
        (lambda d: d["files"][0].update(checksum="md5:00"), "checksum"),
        (lambda d: d["files"].append(dict(d["files"][0])), "listed twice"),
        (lambda d: d["files"][0].update(path="accelkit.json"), "list itself"),
        (lambda d: d.update(metrics={"loss": "low"}), "metric 'loss'"),
    ],
)
def test_strict_parsing(change: object, match: str) -> None:
    data = _good()
    change(data)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(data), source="ck/accelkit.json")


def test_not_json_names_source() -> None:
    with pytest.raises(ManifestError, match=r"ck/accelkit.json: not valid JSON"):
        Manifest.from_json(b"{trunc", source="ck/accelkit.json")
    with pytest.raises(ManifestError, match="JSON object"):
        Manifest.from_json("[]")


def test_layout_names() -> None:
    assert checkpoint_name(7) == "checkpoint_7"
    assert parse_checkpoint_name("s3://b/checkpoints/checkpoint_12") == 12
    assert parse_checkpoint_name("best") is None
    assert parse_checkpoint_name("checkpoint_x") is None
    assert is_state_file("model_1.safetensors") and is_state_file("random_states_3.json")
    assert is_state_file("model-00001-of-00002.safetensors")
    assert not is_state_file("config.yaml")
    assert check_relative_path("a/b.bin") == "a/b.bin"
    with pytest.raises(ValueError):
        check_relative_path("s3://bucket/x")
    with pytest.raises(ValueError):
        parse_checksum("xxh3_128:not-hex")


def _commit(storage: Storage, folder: str, iteration: int, payload: bytes = b"weights") -> None:
    written = storage.write_bytes(join(folder, "model.safetensors"), payload)
    m = Manifest(
        iteration,
        iteration * 10,
        1,
        [FileEntry("model.safetensors", written.size, written.checksum)],
    )
    m.metrics["loss"] = 1.0 / (iteration + 1)
    write_manifest(storage, folder, m)


def test_verify_detects_missing_size_and_checksum(root: Root) -> None:
    s = root.storage
    folder = join(root.url, "ck")
    _commit(s, folder, 1)
    manifest = read_manifest(s, folder)
    assert manifest is not None
    assert verify_files(s, folder, manifest) == []
    s.write_bytes(join(folder, "model.safetensors"), b"weighTs")  # same size, other bytes
    (problem,) = verify_files(s, folder, manifest)
    assert (problem.path, problem.problem) == ("model.safetensors", "checksum")
    assert verify_files(s, folder, manifest, checksums=False) == []
    s.write_bytes(join(folder, "model.safetensors"), b"wei")
    assert verify_files(s, folder, manifest)[0].problem == "size"
    s.remove(join(folder, "model.safetensors"))
    assert verify_files(s, folder, manifest)[0].problem == "missing"
    assert read_manifest(s, join(root.url, "nowhere")) is None


def test_catalog_states_latest_and_stray_folders(root: Root) -> None:
    s = root.storage
    ckdir = join(root.url, "checkpoints")
    for i in (1, 2, 10):
        _commit(s, join(ckdir, checkpoint_name(i)), i)
    s.write_bytes(join(ckdir, "checkpoint_11", SAVE_MARKER_NAME), b"{}")  # a save began...
    s.write_bytes(join(ckdir, "checkpoint_11", "model.safetensors"), b"half")  # ...no manifest
    s.write_bytes(join(ckdir, "checkpoint_3", "accelkit.json"), b"{broken")
    s.write_bytes(join(ckdir, "best", "notes.txt"), b"user folder")
    s.write_bytes(join(ckdir, "loose-file"), b"x")
    _commit(s, join(ckdir, checkpoint_name(2)), 2, b"changed!")  # rewrite: still committed
    s.write_bytes(join(ckdir, "checkpoint_2", "model.safetensors"), b"short")  # now corrupt

    infos = list_checkpoints(s, ckdir)
    states = {i.name: i.state for i in infos}
    assert states == {
        "checkpoint_1": COMMITTED,
        "checkpoint_2": CORRUPT,
        "checkpoint_3": CORRUPT,
        "checkpoint_10": COMMITTED,
        "checkpoint_11": INCOMPLETE,
    }
    assert [i.name for i in infos][-2:] == ["checkpoint_10", "checkpoint_11"]  # oldest first
    by_name = {i.name: i for i in infos}
    assert by_name["checkpoint_10"].step == 100 and by_name["checkpoint_10"].files == 2
    assert "size" in (by_name["checkpoint_2"].error or "")
    latest = latest_checkpoint(s, ckdir)
    assert latest is not None and latest.name == "checkpoint_10"
    assert next_iteration(infos) == 12
    assert resolve_checkpoints_root(s, root.url) == ckdir
    assert list_checkpoints(s, join(root.url, "absent")) == []
