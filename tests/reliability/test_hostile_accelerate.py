"""Hostile Hugging Face accelerate checkpoints: no pickle runs code, nothing outside is read.

Accelerate's ``.bin``/``.pt``/``.pkl`` files are pickles. Each case starts from a real folder
written by accelerate's own ``save_state`` (in a subprocess) and replaces one of its files (or
plants one Accelerate would write: ``scaler.pt``, ``dl_state_dict.bin``,
``pytorch_model.bin``) by a payload that would run code or build something outside the
allow-list. Every case goes through ``load_state(path)``, ``load_state()`` (the folder is the
newest checkpoint of the project) and ``accelkit ckpt import``; each must refuse with an error
naming the file and the global it wanted, the payload's marker file must not exist, the live
model must be unchanged, and the import must write nothing.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import os
import pickle
import pickletools
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.cli.main import main as cli
from tests.checkpointing.accelerate_helpers import (
    accelerate_checkpoint,
    copy_into_project,
)


class _System:
    """Unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    """Unpickling it would evaluate Python."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


class _NumpyAbuse:
    """An allowed global (NumPy's ``_reconstruct``) asked to build a ``ctypes.CDLL`` (a native
    library loader)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (np._core.multiarray._reconstruct, (ctypes.CDLL, (0,), b"b"))


PAYLOADS = {"os.system": (_System, "posix.system"), "eval": (_Eval, "builtins.eval")}
PAYLOADS["numpy-_reconstruct"] = (_NumpyAbuse, "ctypes.CDLL")
FILES = [
    "optimizer.bin",
    "scheduler.bin",
    "custom_checkpoint_0.pkl",
    "random_states_0.pkl",
    "scaler.pt",
    "dl_state_dict.bin",
    "pytorch_model.bin",
]


@pytest.fixture(scope="module")
def accelerate_folder(
    tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template: Path
) -> Path:
    root = tmp_path_factory.mktemp("hostile-acc")
    return accelerate_checkpoint(root, accelerate_checkpoint_template)


def _plant(folder: Path, name: str, payload: Any) -> None:
    if name == "pytorch_model.bin":  # read only where there is no model.safetensors
        (folder / "model.safetensors").unlink()
    buffer = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "x": payload}, buffer)
    (folder / name).write_bytes(buffer.getvalue())


def _accelerator(project: Path) -> tuple[Accelerator, torch.nn.Module]:
    from tests.checkpointing.accelerate_run import Counter, build

    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, optimizer, scheduler = build()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    return accelerator, model


def _refused_everywhere(
    folder: Path, capsys: pytest.CaptureFixture[str], *expected: str, listed_corrupt: bool = False
) -> list[str]:
    """Run every reader on ``folder``; return what went wrong (empty when all refused).

    With ``listed_corrupt``, the catalog already calls the folder corrupt (a link inside), so
    ``load_state()`` does not consider it and says so."""
    problems = []
    project = folder.parent.parent
    for how in ("load_state(path)", "load_state()"):
        accelerator, model = _accelerator(project)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            accelerator.load_state(str(folder) if how == "load_state(path)" else None)
            problems.append(f"{how} loaded it")
        except CorruptCheckpointError as exc:
            missing = [e for e in expected if e not in str(exc)]
            if missing:
                problems.append(f"{how}: {missing} not in: {exc}")
        except CheckpointError as exc:
            if not (listed_corrupt and how == "load_state()" and "(corrupt)" in str(exc)):
                problems.append(f"{how}: not a CorruptCheckpointError: {exc!r}")
        if any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()):
            problems.append(f"{how} changed the model before refusing")
    capsys.readouterr()
    destination = folder.parent / "imported"
    code = cli(["ckpt", "import", str(folder), str(destination)])
    err = capsys.readouterr().err
    if code != 1:
        problems.append(f"ckpt import exit {code}: {err}")
    if any(e not in err for e in expected):
        problems.append(f"ckpt import: {expected} not all in: {err}")
    if destination.exists():
        problems.append("ckpt import wrote a destination")
    return problems


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_in_each_file_is_refused_naming_file_and_global(
    tmp_path: Path,
    accelerate_folder: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    payload: str,
) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    marker = tmp_path / "PWNED"
    cls, wanted = PAYLOADS[payload]
    _plant(folder, name, cls(marker))
    problems = _refused_everywhere(folder, capsys, name, repr(wanted))
    if marker.exists():
        problems.append("THE PAYLOAD RAN")
    assert not problems, "\n".join(problems)


def test_object_array_is_refused(
    tmp_path: Path, accelerate_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NumPy's allowed globals cannot build an object array (whose items could be anything):
    only the uint32 dtype of the generator's key is allowed."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    state = torch.load(folder / "random_states_0.pkl", weights_only=False)
    key = state["numpy_random_seed"]
    state["numpy_random_seed"] = (key[0], np.array([1, 2], dtype=object), *key[2:])
    torch.save(state, folder / "random_states_0.pkl")
    assert not _refused_everywhere(folder, capsys, "random_states_0.pkl")


def test_plain_pickle_is_refused(
    tmp_path: Path, accelerate_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A raw pickle (not a torch.save archive) never reaches an unpickler."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    marker = tmp_path / "PWNED"
    (folder / "optimizer.bin").write_bytes(pickle.dumps(_System(marker)))
    assert not _refused_everywhere(folder, capsys, "optimizer.bin", "not a torch.save archive")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("numpy_random_seed", ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0), "numpy"),
        ("random_state", (3, (1.5, 2), None), "random_state"),
        ("torch_manual_seed", torch.zeros(3, dtype=torch.float32), "torch_manual_seed"),
        ("step", -4, "step"),
    ],
)
def test_malformed_random_states_name_the_key(
    tmp_path: Path,
    accelerate_folder: Path,
    capsys: pytest.CaptureFixture[str],
    key: str,
    value: Any,
    field: str,
) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    state = torch.load(folder / "random_states_0.pkl", weights_only=False)
    state[key] = value
    torch.save(state, folder / "random_states_0.pkl")
    assert not _refused_everywhere(folder, capsys, "random_states_0.pkl", field)


def test_a_link_inside_is_never_followed(
    tmp_path: Path, accelerate_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    outside = tmp_path / "outside.bin"
    shutil.copy(folder / "scheduler.bin", outside)
    (folder / "scheduler.bin").unlink()
    (folder / "scheduler.bin").symlink_to(outside)
    problems = _refused_everywhere(
        folder, capsys, "scheduler.bin", "symbolic link", listed_corrupt=True
    )
    assert not problems


def _claim_huge_storage(path: Path) -> None:
    """Rewrite the archive so that the first tensor's storage claims 2**40 bytes (the data
    record keeps its real size)."""
    archive = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    names = archive.namelist()
    pkl_name = next(n for n in names if n.endswith("/data.pkl"))
    pkl = archive.read(pkl_name)
    ops = list(pickletools.genops(pkl))
    # The persistent id ('storage', <class>, key, 'cpu', numel): numel follows 'cpu' (and a
    # memo opcode).
    at = next(i for i, (op, arg, _) in enumerate(ops) if arg == "cpu")
    op, numel, pos = next(
        (o, a, p) for o, a, p in ops[at + 1 :] if o.name in ("BININT1", "BININT2", "BININT")
    )
    width = {"BININT1": 1, "BININT2": 2, "BININT": 4}[op.name]
    assert pos is not None and numel > 0
    huge = b"\x8a\x06" + (2**40).to_bytes(6, "little")  # LONG1
    pkl = pkl[:pos] + huge + pkl[pos + 1 + width :]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for name in names:
            rewritten.writestr(name, pkl if name == pkl_name else archive.read(name))
    path.write_bytes(out.getvalue())


def test_storage_claiming_a_terabyte_is_refused(
    tmp_path: Path, accelerate_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor whose storage claims 1 TiB in a file of a few KiB: refused naming the file,
    never a MemoryError or an attempt to allocate it."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    _claim_huge_storage(folder / "random_states_0.pkl")
    assert not _refused_everywhere(folder, capsys, "random_states_0.pkl")
