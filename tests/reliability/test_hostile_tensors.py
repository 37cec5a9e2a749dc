"""Malformed tensors and state files, and manifests that list what is not there.

Each case starts from a real committed checkpoint written by ``save_state`` and changes one thing;
the manifest is re-signed (sizes and checksums recomputed) unless the lie *is* the manifest.

- Every file the manifest lists is checked (present, recorded size) before anything is restored,
  even files this load would not read; ``load_state()`` without a path then resumes from the
  newest checkpoint that passes and warns about the damaged one (never deleting it).
- A safetensors header that relabels a tensor's dtype (same byte length) is refused naming both
  dtypes, never cast silently into the model.
- Shapes whose element count overflows (``[2**63, 0]``: zero bytes, but no tensor can have it)
  are refused with ``CorruptCheckpointError`` naming the file and "shape" by every reader.
- JSON nested ~900 and 100,000 deep, and numbers JSON cannot hold (``1e999999``, a 100,000-digit
  integer), in state files, the manifest and the index: ``CorruptCheckpointError``, never a
  ``RecursionError`` nor a silent ``inf``.
- Memory stays bounded by a hostile file's size (measured with ``ru_maxrss`` in a subprocess).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing import load_checkpoint_in_model
from accelkit.checkpointing.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from tests.reliability.test_hostile import _ckpt, _Counter, _model, _resign, _run_cli

REPO = Path(__file__).resolve().parents[2]


def _setup(project: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, _Counter]:
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, counter


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Two committed checkpoints; the optimizer has state (one step) and the counter is 1, 2."""
    root = tmp_path / "project"
    accelerator, model, optimizer, counter = _setup(root)
    for n in (1, 2):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        counter.n = n
        accelerator.save_state()
    return root


class _Live:
    """The live objects of a fresh run, with their state before a load, to prove a refused
    load changed nothing."""

    def __init__(self, project: Path) -> None:
        self.accelerator, self.model, self.optimizer, self.counter = _setup(project)
        self.counter.n = 42
        self.weights = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.optim = repr(self.optimizer.state_dict())

    def unchanged(self) -> bool:
        now = self.model.state_dict()
        return (
            all(torch.equal(self.weights[k], now[k]) for k in self.weights)
            and repr(self.optimizer.state_dict()) == self.optim
            and self.counter.n == 42
        )


def _refused(project: Path, folder: Path, *fragments: str) -> CheckpointError:
    live = _Live(project)
    with pytest.raises(CheckpointError) as info:
        live.accelerator.load_state(str(folder))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, info.value)
    assert live.unchanged(), "a refused load changed the model, optimizer or registered object"
    return info.value


def _copy(project: Path, name: str, source: int = 1) -> Path:
    folder = project / "checkpoints" / name
    shutil.copytree(_ckpt(project, source), folder)
    return folder


# ------------------------------------------------------------------ every listed file, first


def _list_extra(folder: Path, name: str, content: bytes) -> None:
    """List ``name`` in the manifest (re-signed for ``content``) without keeping it as is."""
    staged = folder.parent / f".staged-{name}"
    staged.write_bytes(content)
    _resign(folder, {name: staged})
    staged.unlink()


@pytest.mark.parametrize("case", ["unread-missing", "unread-truncated", "extra-deleted"])
def test_every_listed_file_is_checked_before_anything_is_restored(case: str, project: Path) -> None:
    folder = _copy(project, "damaged")
    if case == "unread-missing":  # another process's random states, listed but absent
        _list_extra(folder, "random_states_1.json", (folder / "random_states_0.json").read_bytes())
        bad = "random_states_1.json"
    elif case == "unread-truncated":  # present, but shorter than the manifest says
        content = (folder / "random_states_0.json").read_bytes()
        _list_extra(folder, "random_states_1.json", content)
        (folder / "random_states_1.json").write_bytes(content[:-10])
        bad = "random_states_1.json"
    else:  # a file no loader reads, listed and then deleted
        _list_extra(folder, "notes.txt", b"release notes\n")
        bad = "notes.txt"
    error = _refused(project, folder, bad)
    assert isinstance(error, CorruptCheckpointError), error


def test_automatic_resume_skips_a_damaged_newest_checkpoint_with_a_warning(
    project: Path, caplog: pytest.LogCaptureFixture
) -> None:
    newest = _ckpt(project, 1)
    _list_extra(newest, "notes.txt", b"release notes\n")  # listed, absent
    live = _Live(project)
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        loaded = live.accelerator.load_state()
    assert loaded.endswith("checkpoint_0"), loaded
    assert live.counter.n == 1  # checkpoint_0's state
    warned = [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and r.name.startswith("accelkit")
        and "checkpoint_1" in r.getMessage()
    ]
    assert warned, [(r.name, r.getMessage()) for r in caplog.records]
    assert newest.exists() and (newest / "accelkit.json").exists()  # never deleted
    _refused(project, newest, "notes.txt")


def test_a_bad_random_state_is_refused_before_anything_is_restored(project: Path) -> None:
    """random_states_0.json (re-signed) with a Python generator state of version 99: random
    states are accelkit's own format, so they are checked with everything else before the
    first object changes, not found bad after the model and optimizer were overwritten."""
    import random

    folder = _copy(project, "bad-rng")
    path = folder / "random_states_0.json"
    doc = json.loads(path.read_text())
    doc["state"]["python"]["__tuple__"][0] = 99
    path.write_text(json.dumps(doc))
    _resign(folder)
    rng_before = random.getstate()
    error = _refused(project, folder, "random_states_0.json")
    assert isinstance(error, CorruptCheckpointError), error
    assert random.getstate() == rng_before


# ------------------------------------------------------------------ lying safetensors headers


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def test_a_relabelled_dtype_is_refused_naming_both(project: Path, tmp_path: Path) -> None:
    folder = _copy(project, "relabelled")
    header, data = _split(folder / "model.safetensors")
    assert header["0.weight"]["dtype"] == "F32"
    header["0.weight"]["dtype"] = "I32"  # same bytes, read as integers
    (folder / "model.safetensors").write_bytes(_join(header, data))
    _resign(folder)

    error = _refused(project, folder, "0.weight")
    assert isinstance(error, (CheckpointMismatchError, CorruptCheckpointError)), error
    text = str(error)
    assert ("I32" in text or "int32" in text) and ("F32" in text or "float32" in text), text

    single = tmp_path / "relabelled.safetensors"
    shutil.copy(folder / "model.safetensors", single)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((CheckpointMismatchError, CorruptCheckpointError)) as info:
        load_checkpoint_in_model(model, str(single))
    text = str(info.value)
    assert "0.weight" in text and ("I32" in text or "int32" in text), text
    assert "F32" in text or "float32" in text, text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_relabelled_optimizer_moment_is_refused_naming_both(project: Path) -> None:
    folder = _copy(project, "relabelled-moment")
    header, data = _split(folder / "optimizer.safetensors")
    moments = [n for n, e in header.items() if n != "__metadata__" and len(e["shape"]) == 2]
    assert moments, header  # AdamW's exp_avg/exp_avg_sq of the weight matrices
    header[moments[0]]["dtype"] = "I32"  # same bytes, read as integers
    (folder / "optimizer.safetensors").write_bytes(_join(header, data))
    _resign(folder)
    error = _refused(project, folder, "optimizer.json", "int32", "float32")
    assert isinstance(error, CheckpointMismatchError), error


_SHAPES = {"2e63-by-0": [2**63, 0], "2e62-4-0": [2**62, 4, 0], "minus-one": [-1], "2e64": [2**64]}


@pytest.mark.parametrize("case", sorted(_SHAPES))
def test_shapes_that_overflow_are_refused_by_every_reader(
    case: str, project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy(project, "overflow")
    header, data = _split(folder / "model.safetensors")
    # An extra tensor with no bytes at all: [2**63, 0] has 0 elements, yet no torch tensor
    # can have that shape (each dimension must fit in int64).
    header["extra"] = {"dtype": "F32", "shape": _SHAPES[case], "data_offsets": [0, 0]}
    (folder / "model.safetensors").write_bytes(_join(header, data))
    _resign(folder)
    problems: list[str] = []
    live = _Live(project)
    try:
        live.accelerator.load_state(str(folder))
        problems.append("load_state accepted it")
    except CorruptCheckpointError as exc:
        if "model.safetensors" not in str(exc) or "shape" not in str(exc):
            problems.append(f"load_state: {exc}")
    except Exception as exc:  # the defect under test: anything else escapes today
        problems.append(f"load_state raised {type(exc).__name__}: {str(exc)[:200]}")
    if not live.unchanged():
        problems.append("load_state changed the live objects")

    single = tmp_path / "overflow.safetensors"
    shutil.copy(folder / "model.safetensors", single)
    try:
        load_checkpoint_in_model(_model(), str(single))
        problems.append("load_checkpoint_in_model accepted it")
    except CorruptCheckpointError as exc:
        if "overflow.safetensors" not in str(exc) or "shape" not in str(exc):
            problems.append(f"load_checkpoint_in_model: {exc}")
    except Exception as exc:
        problems.append(f"load_checkpoint_in_model raised {type(exc).__name__}: {str(exc)[:200]}")
    for target in (single, folder):
        code, out = _run_cli(capsys, "ckpt", "inspect", str(target))
        if code != 1 or "shape" not in out:
            problems.append(f"inspect {target.name}: exit {code}: {out[-300:]}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ deep JSON and huge numbers


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _state_doc(folder: Path, stem: str, deep: str) -> None:
    """Put ``deep`` (raw JSON text) inside ``<stem>.json``'s state, keeping it well-formed."""
    path = folder / f"{stem}.json"
    text = path.read_text()
    assert text.endswith("}}")
    path.write_text(text[:-2] + ',"extra":' + deep + "}}")


@pytest.mark.parametrize("depth", [900, 100_000])
@pytest.mark.parametrize("where", ["optimizer", "custom", "manifest", "index"])
def test_deeply_nested_json_is_refused_cleanly(where: str, depth: int, project: Path) -> None:
    folder = _copy(project, f"deep-{where}")
    deep = _nested(depth)
    if where == "optimizer":
        _state_doc(folder, "optimizer", deep)
        bad = "optimizer.json"
    elif where == "custom":
        _state_doc(folder, "custom_checkpoint_0", deep)
        bad = "custom_checkpoint_0.json"
    elif where == "index":
        # The single model file becomes one shard of an index whose metadata is deep.
        shard = "model-00001-of-00001.safetensors"
        os.rename(folder / "model.safetensors", folder / shard)
        header, _ = _split(folder / shard)
        weight_map = {k: shard for k in header if k != "__metadata__"}
        index = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        index = index.replace('"total_size": 0', '"total_size": 0, "deep": ' + deep)
        (folder / "model.safetensors.index.json").write_text(index)
        bad = "model.safetensors.index.json"
    if where != "manifest":
        _resign(folder, {n: folder / n for n in os.listdir(folder) if n != "accelkit.json"})
    else:
        manifest = (folder / "accelkit.json").read_text()
        manifest = manifest.replace('"metadata": {}', '"metadata": {"deep": ' + deep + "}")
        (folder / "accelkit.json").write_text(manifest)
        bad = "accelkit.json"
    live = _Live(project)
    try:
        live.accelerator.load_state(str(folder))
        raise AssertionError(f"load_state accepted {bad} nested {depth} deep")
    except CorruptCheckpointError as exc:
        assert bad in str(exc), exc
    except RecursionError as exc:
        raise AssertionError(f"{bad} nested {depth} deep: RecursionError escaped") from exc
    assert live.unchanged()


_HUGE = {"float-1e999999": "1e999999", "int-100000-digits": "9" * 100_000}


@pytest.mark.parametrize("number", sorted(_HUGE))
@pytest.mark.parametrize("where", ["optimizer", "manifest"])
def test_numbers_json_cannot_hold_are_refused(where: str, number: str, project: Path) -> None:
    folder = _copy(project, f"huge-{where}")
    if where == "optimizer":
        _state_doc(folder, "optimizer", _HUGE[number])
        _resign(folder)
        bad = "optimizer.json"
    else:
        manifest = (folder / "accelkit.json").read_text()
        manifest = manifest.replace('"metadata": {}', '"metadata": {"x": ' + _HUGE[number] + "}")
        (folder / "accelkit.json").write_text(manifest)
        bad = "accelkit.json"
    error = _refused(project, folder, bad)
    assert isinstance(error, CorruptCheckpointError), error


# ------------------------------------------------------------------ memory bounded by file size


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import io, json, struct, sys, torch
    from tests.helpers.memory import peak_kib
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
    from accelkit.checkpointing.catalog.inspect import read_safetensors_header
    from accelkit.checkpointing.formats.manifest import FileEntry
    from accelkit.checkpointing.formats.safetensors_io import read_safetensors
    from accelkit.checkpointing.sharded import read_sharded_metadata
    from accelkit.checkpointing.storage import get_storage

    project, folder, tera, pickled = sys.argv[1:5]
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer)

    class Counter:
        n = 0
        def state_dict(self): return {"n": self.n}
        def load_state_dict(self, s): self.n = s["n"]

    accelerator.register_for_checkpointing(Counter())
    storage = get_storage(tera)
    lying = FileEntry("x", 2**41, "sha256:" + "0" * 64)
    cases = {
        "read_safetensors_header": lambda: read_safetensors_header(storage, tera),
        "read_safetensors": lambda: read_safetensors(storage, tera),
        "read_safetensors(manifest says 2 TiB)": lambda: read_safetensors(storage, tera, lying),
        "load_state(manifest says 2 TiB)": lambda: accelerator.load_state(folder),
        "read_sharded_metadata": lambda: read_sharded_metadata(storage, pickled),
    }
    for name, call in cases.items():
        before = peak_kib()
        try:
            call()
            outcome = "accepted"
        except CorruptCheckpointError:
            outcome = "CorruptCheckpointError"
        except BaseException as exc:
            outcome = type(exc).__name__
        grown = peak_kib() - before
        print(json.dumps({"case": name, "outcome": outcome, "grown_kib": grown}), flush=True)
    """
)


def test_memory_stays_bounded_by_the_file_size(project: Path, tmp_path: Path) -> None:
    # A 1 TiB tensor claimed by a small file.
    tera = tmp_path / "tera.safetensors"
    tera.write_bytes(
        _join({"t": {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}}, b"\0" * 64)
    )
    # A checkpoint whose manifest claims random_states_0.safetensors is 2 TiB, with a header
    # to match (a manifest can lie about sizes as well as an attacker can re-sign them).
    folder = _copy(project, "lying-size")
    (folder / "random_states_0.safetensors").write_bytes(tera.read_bytes())
    _resign(folder)
    manifest = json.loads((folder / "accelkit.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "random_states_0.safetensors":
            entry["size"] = 2**41
    (folder / "accelkit.json").write_text(json.dumps(manifest))
    # A DCP .metadata whose BINBYTES8 opcode claims 1 TiB.
    pickled = tmp_path / "sharded"
    pickled.mkdir()
    (pickled / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"xx.")

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(project), str(folder), str(tera), str(pickled)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 5, run.stdout + run.stderr
    problems = [
        f"{r['case']}: {r['outcome']}, peak memory grew {r['grown_kib'] // 1024} MiB"
        for r in rows
        if r["outcome"] != "CorruptCheckpointError" or r["grown_kib"] > 50 * 1024
    ]
    assert not problems, "\n".join(problems)
