"""Accelerate pickles that pass the allow-list: data, not programs, and not amplifiers.

Nothing in these files runs code (``test_hostile_accelerate.py`` proves that); here every
global is an allowed one, and the attack is what the allowed callables build: NumPy's
``_reconstruct`` without its ``BUILD`` (never-initialised heap bytes), object, structured and
float arrays, tensors of stride 0 or overlapping strides (a few bytes claiming gigabytes),
tensors reaching past their storage, compressed records (a deflate bomb), duplicate record
names, bytes around the zip, the legacy non-zip format, and values whose shared parts (the
pickle's memo) multiply when converted. Each file is crafted here, in a real folder written
by Hugging Face accelerate's ``save_state``, and read by ``load_state(path)`` (and
``load_state()`` for one of each kind) and by ``accelkit ckpt import`` (its ``main``, in this
process; the real console script for one refusal and one good import): a
``CorruptCheckpointError`` (exit 1) naming the file and what is wrong, the model unchanged, no
destination written. Peak memory is measured in child processes; two imports
of one good folder are byte-identical.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.formats.state_io import read_state
from accelkit.checkpointing.interop.accelerate_pickle import load_pickle
from accelkit.checkpointing.storage import get_storage
from accelkit.cli.main import main
from tests.checkpointing.accelerate_helpers import (
    accelerate_checkpoint,
    copy_into_project,
)
from tests.helpers.preloaded import Preloaded
from tests.reliability.conftest import trials

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
ACCELKIT = Path(sys.executable).with_name("accelkit")  # the installed console script
MiB = 1 << 20

# ----------------------------------------------------------------- crafting torch.save files


class Storage:
    """A storage record of the archive being crafted (pickled as torch's persistent id)."""

    def __init__(self, key: str, kind: type, numel: int) -> None:
        self.key, self.kind, self.numel = key, kind, numel


class Tensor:
    """``torch._utils._rebuild_tensor_v2`` with chosen size, stride and offset."""

    def __init__(
        self, storage: Storage, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0
    ) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, self.args)


class Reduce:
    """Pickles as ``func(*args)``, completed by ``BUILD(state)`` when a state is given."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...], *state: Any) -> None:
        self.value = (func, args, *state)

    def __reduce__(self) -> Any:
        return self.value


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Storage):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def craft(
    path: Path,
    value: Any,
    records: dict[str, bytes] | None = None,
    *,
    compression: int = zipfile.ZIP_STORED,
) -> None:
    """Write ``value`` as torch.save would (protocol 2, stored records), with ``records`` as
    the storages' data."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(value)
    prefix = path.stem
    entries = [(f"{prefix}/data.pkl", buffer.getvalue()), (f"{prefix}/byteorder", b"little")]
    entries += [(f"{prefix}/data/{k}", v) for k, v in (records or {}).items()]
    entries.append((f"{prefix}/version", b"3\n"))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    path.write_bytes(out.getvalue())


def rewrite(path: Path, compression: int = zipfile.ZIP_STORED, duplicate: str = "") -> None:
    """Write the records of the real ``path`` again, compressed, or with the record named
    ``duplicate`` (below the archive folder) a second time, holding other bytes."""
    with zipfile.ZipFile(path) as archive:
        entries = [(n, archive.read(n)) for n in archive.namelist()]
    if duplicate:
        name, data = next((n, d) for n, d in entries if n.endswith("/" + duplicate))
        entries.append((name, bytes(len(data))))
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", compression) as archive:
        warnings.simplefilter("ignore")
        for name, data in entries:
            archive.writestr(name, data)
    path.write_bytes(out.getvalue())


def _reconstruct() -> Callable[..., Any]:
    return np._core.multiarray._reconstruct


def _numpy_key(folder: Path, key: Any) -> None:
    """Put ``key`` in place of the NumPy generator's key words in ``random_states_0.pkl``."""
    path = folder / "random_states_0.pkl"
    state = torch.load(path, weights_only=False)
    state["numpy_random_seed"] = (state["numpy_random_seed"][0], key, 624, 0, 0.0)
    torch.save(state, path)


# ----------------------------------------------------------------- running every reader


@pytest.fixture(scope="module")
def accelerate_folder(
    tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template: Path
) -> Path:
    root = tmp_path_factory.mktemp("hostile-pickles")
    return accelerate_checkpoint(root, accelerate_checkpoint_template)


def console(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the installed ``accelkit`` console script on this checkout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [str(ACCELKIT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``accelkit`` in this process (what ``console`` runs, without its 2-3 s of imports),
    its output captured: the same exit code and messages, and an unexpected exception is still
    the traceback and exit 1 that ``main`` makes of it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _accelerator(project: Path) -> tuple[Accelerator, torch.nn.Module]:
    from tests.checkpointing.accelerate_run import Counter, build

    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model, optimizer, scheduler = build()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    return accelerator, model


def refused_everywhere(
    folder: Path, *expected: str, automatic: bool = False, script: bool = False
) -> list[str]:
    """``load_state(folder)`` (and with ``automatic`` ``load_state()``) and ``accelkit ckpt
    import`` (in this process, or with ``script`` the installed console script) must refuse
    naming ``expected``; return what went wrong (empty when all did)."""
    problems = []
    project = folder.parent.parent
    for how in ("load_state(path)", "load_state()") if automatic else ("load_state(path)",):
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
            problems.append(f"{how}: not a CorruptCheckpointError: {exc!r}")
        if any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()):
            problems.append(f"{how} changed the model before refusing")
    destination = folder.parent / "imported"
    run = console if script else cli
    proc = run("ckpt", "import", str(folder), str(destination))
    if proc.returncode != 1:
        problems.append(f"ckpt import exit {proc.returncode}: {proc.stderr[-2000:]}")
    missing = [e for e in expected if e not in proc.stderr]
    if missing:
        problems.append(f"ckpt import: {missing} not in: {proc.stderr[-2000:]}")
    if "Traceback" in proc.stderr:
        problems.append(f"ckpt import crashed: {proc.stderr[-2000:]}")
    if destination.exists():
        problems.append("ckpt import wrote a destination")
    return problems


# ----------------------------------------------------------------- NumPy: every byte from the file

NUMPY_KEYS: dict[str, tuple[Callable[[], Any], str]] = {
    # The array is allocated at its full size and never filled: heap bytes as the key.
    "no-BUILD-624": (
        lambda: Reduce(_reconstruct(), (np.ndarray, (624,), np.dtype("u4"))),
        "_reconstruct",
    ),
    # The form NumPy writes, but its BUILD left out.
    "no-BUILD": (lambda: Reduce(_reconstruct(), (np.ndarray, (0,), b"b")), "BUILD"),
    # A BUILD whose data is shorter than the shape: NumPy would read past it.
    "BUILD-short-data": (
        lambda: Reduce(
            _reconstruct(),
            (np.ndarray, (0,), b"b"),
            (1, (624,), np.dtype("u4"), False, b"\0" * 8),
        ),
        "exactly 2496 bytes",
    ),
    "float64-key": (lambda: np.zeros(624, dtype=np.float64), "only dtype('u4'"),
    "structured-key": (lambda: np.zeros(624, dtype=[("a", "<u4")]), "only dtype('u4'"),
}


@pytest.mark.parametrize("case", sorted(NUMPY_KEYS))
def test_numpy_key_not_from_the_file_is_refused(
    tmp_path: Path, accelerate_folder: Path, case: str
) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    make, why = NUMPY_KEYS[case]
    _numpy_key(folder, make())
    # One case through the installed console script too: its own exit code and stderr.
    problems = refused_everywhere(
        folder,
        "random_states_0.pkl",
        why,
        automatic=case == "no-BUILD-624",
        script=case == "no-BUILD-624",
    )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [object, [("a", "<u4"), ("b", "O")]])
def test_object_arrays_are_refused_in_a_registered_object(
    tmp_path: Path, accelerate_folder: Path, dtype: Any
) -> None:
    """An object array's items could be anything, and ``import`` said 'verified' for one it
    could not load back: refused wherever it is, as the dtype it is."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    torch.save({"seen": 3, "table": np.zeros(2, dtype=dtype)}, folder / "custom_checkpoint_0.pkl")
    assert not refused_everywhere(folder, "custom_checkpoint_0.pkl", "only dtype('u4'")


# ----------------------------------------------------------------- tensors inside their storage

# Four bytes of storage, 2**24 float32 elements claimed (64 MiB on import); the 2 GiB claim
# is measured in a child process below.
_ONE = Storage("0", torch.FloatStorage, 1)
_SMALL = Storage("0", torch.FloatStorage, 16)
TENSORS: dict[str, tuple[Storage, Tensor, str]] = {
    "stride-0": (_ONE, Tensor(_ONE, (2**24,), (0,)), "share memory"),
    "overlapping-strides": (_SMALL, Tensor(_SMALL, (4096, 4096), (1, 1)), "share memory"),
    "storage-smaller-than-tensor": (_SMALL, Tensor(_SMALL, (1024,), (1,)), "of a storage of 16"),
    "offset-past-storage": (_SMALL, Tensor(_SMALL, (4,), (1,), offset=15), "of a storage of 16"),
}
PLACES = {
    "optimizer.bin": lambda t: {"state": {0: {"exp_avg": t}}, "param_groups": []},
    "custom_checkpoint_0.pkl": lambda t: {"seen": 3, "t": t},
    "pytorch_model.bin": lambda t: {"0.weight": t},
    "random_states_0.pkl": lambda t: {"step": 0, "torch_manual_seed": t},
}


@pytest.mark.parametrize(
    ("case", "name"),
    [("stride-0", n) for n in sorted(PLACES)]
    + [(c, "optimizer.bin") for c in sorted(TENSORS) if c != "stride-0"],
)
def test_tensor_claiming_more_than_its_storage_is_refused(
    tmp_path: Path, accelerate_folder: Path, case: str, name: str
) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    storage, tensor, why = TENSORS[case]
    if name == "pytorch_model.bin":  # read only where there is no model.safetensors
        (folder / "model.safetensors").unlink()
    craft(folder / name, PLACES[name](tensor), {"0": bytes(4 * storage.numel)})
    problems = refused_everywhere(folder, name, why, automatic=name == "optimizer.bin")
    assert not problems, "\n".join(problems)


def test_storage_record_of_another_size_is_refused(tmp_path: Path, accelerate_folder: Path) -> None:
    """A storage claiming 16 elements over a record of 8 bytes (or of 1 KiB)."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    for record in (bytes(8), bytes(1024)):
        value = PLACES["optimizer.bin"](Tensor(_SMALL, (16,), (1,)))
        craft(folder / "optimizer.bin", value, {"0": record})
        problems = refused_everywhere(folder, "optimizer.bin", f"record holds {len(record)} bytes")
        assert not problems, "\n".join(problems)


# ----------------------------------------------------------------- the zip around the pickle


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_compressed_records_are_refused(tmp_path: Path, accelerate_folder: Path, name: str) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    rewrite(folder / name, zipfile.ZIP_DEFLATED)
    problems = refused_everywhere(folder, name, "is compressed", automatic=name == "scheduler.bin")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("name", "record"),
    [("optimizer.bin", "data.pkl"), ("optimizer.bin", "data/1"), ("random_states_0.pkl", "data/0")],
)
def test_duplicate_record_names_are_refused(
    tmp_path: Path, accelerate_folder: Path, name: str, record: str
) -> None:
    """Two records of one name: which one a reader takes is the reader's choice."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    rewrite(folder / name, duplicate=record)
    assert not refused_everywhere(folder, name, "appears twice")


@pytest.mark.parametrize("where", ["before", "after", "comment"])
def test_bytes_around_the_archive_are_refused(
    tmp_path: Path, accelerate_folder: Path, where: str
) -> None:
    """Bytes before the first record (another reader starts there), after the end record, or
    in the archive comment: only what torch.save writes is read."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    path = folder / "scheduler.bin"
    data = path.read_bytes()
    if where == "before":
        path.write_bytes(b"\0" * 64 + data)
    elif where == "after":
        path.write_bytes(data + b"\0" * 64)
    else:
        with zipfile.ZipFile(path, "a") as archive:
            archive.comment = b"hello"
    assert not refused_everywhere(folder, "scheduler.bin")


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl"])
def test_legacy_format_is_refused(tmp_path: Path, accelerate_folder: Path, name: str) -> None:
    """torch's pre-1.6 format (no zip: storages after the pickle, unbounded by any directory):
    Accelerate's save_state never wrote it on a torch it supports."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    value = torch.load(folder / name, weights_only=False)
    torch.save(value, folder / name, _use_new_zipfile_serialization=False)
    assert not refused_everywhere(folder, name, "legacy (pre-1.6")


def test_legacy_pickle_with_a_zip_appended_is_refused(
    tmp_path: Path, accelerate_folder: Path
) -> None:
    """A polyglot: torch would read the legacy pickle at the front, a zip reader the archive
    at the back."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    path = folder / "scheduler.bin"
    legacy = io.BytesIO()
    torch.save({"last_epoch": 999}, legacy, _use_new_zipfile_serialization=False)
    path.write_bytes(legacy.getvalue() + path.read_bytes())
    assert not refused_everywhere(folder, "scheduler.bin", "legacy (pre-1.6")


# ----------------------------------------------------------------- shared objects that multiply


def test_memo_shared_list_that_multiplies_is_refused(
    tmp_path: Path, accelerate_folder: Path
) -> None:
    """One list of 1,000 numbers placed 100,000 times (a 200 KB pickle): 10**8 numbers once
    written out as JSON by the import."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    row = list(range(1000))
    torch.save({"seen": 3, "rows": [row] * 100_000}, folder / "custom_checkpoint_0.pkl")
    assert (folder / "custom_checkpoint_0.pkl").stat().st_size < 400_000
    assert not refused_everywhere(folder, "custom_checkpoint_0.pkl", "expands to")


def test_memo_shared_tensor_that_multiplies_is_refused(
    tmp_path: Path, accelerate_folder: Path
) -> None:
    """One 1 MiB tensor placed 2,000 times: 2 GiB of safetensors from a 1 MiB file."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    tensor = torch.zeros(MiB // 4)
    torch.save({"seen": 3, "t": [tensor] * 2000}, folder / "custom_checkpoint_0.pkl")
    assert not refused_everywhere(folder, "custom_checkpoint_0.pkl", "expands to")


def test_list_holding_itself_is_refused(tmp_path: Path, accelerate_folder: Path) -> None:
    folder = copy_into_project(tmp_path, accelerate_folder)
    loop: list[Any] = [1]
    loop.append(loop)
    torch.save({"seen": 3, "loop": loop}, folder / "custom_checkpoint_0.pkl")
    assert not refused_everywhere(folder, "custom_checkpoint_0.pkl", "placed inside")


# ----------------------------------------------------------------- memory and determinism

_CHILD = r"""
import json, sys
from tests.helpers.memory import peak_kib
from accelkit.checkpointing.interop.accelerate_pickle import load_pickle
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.storage import get_storage
import torch
path = sys.argv[1]
before = peak_kib()
try:
    value = load_pickle(get_storage(path), path)
    error = None
except CorruptCheckpointError as exc:
    error = str(exc)
after = peak_kib()
print(json.dumps({"grew": (after - before) * 1024, "error": error}))
"""


def _peak(python: Preloaded, path: Path) -> dict[str, Any]:
    """Load ``path`` with ``load_pickle`` in a fresh process (forked: its high-water mark
    starts at what it has at the fork); its RSS high-water mark growth."""
    proc = python.run("-c", _CHILD, str(path), timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return result


def _deflate_bomb(path: Path, size: int) -> None:
    """A uint8 tensor of ``size`` zeros whose record is deflated (about size / 1000 bytes)."""
    value = {"seen": 3, "t": Tensor(Storage("0", torch.ByteStorage, size), (size,), (1,))}
    craft(path, value)
    chunk = bytes(MiB)
    with zipfile.ZipFile(path, "a") as archive:
        info = zipfile.ZipInfo(f"{path.stem}/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w", force_zip64=True) as record:
            for _ in range(size // MiB):
                record.write(chunk)


def test_peak_memory_stays_a_small_multiple_of_the_file(tmp_path: Path) -> None:
    """RSS high-water mark of a child that loads each file: a 300 MB deflate bomb and a
    2 GiB stride-0 tensor are refused without growing; a real 64 MiB tensor loads within
    three times its size; a 100,000x shared list is refused within 64 MiB."""
    bomb = tmp_path / "custom_checkpoint_0.pkl"
    _deflate_bomb(bomb, 300 * 1000 * 1000)
    assert bomb.stat().st_size < 1_000_000
    stride0 = tmp_path / "optimizer.bin"
    craft(stride0, {"state": {0: {"exp_avg": Tensor(_ONE, (2**29,), (0,))}}}, {"0": bytes(4)})
    assert stride0.stat().st_size < 2000
    shared = tmp_path / "scheduler.bin"
    torch.save({"rows": [list(range(1000))] * 100_000}, shared)
    good = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(16 * MiB)}, good)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    modules = ["torch", "accelkit.checkpointing.interop.accelerate_pickle", "tests.helpers.memory"]
    with Preloaded(modules, env=env, cwd=ROOT) as python:
        results = {p.name: _peak(python, p) for p in (bomb, stride0, shared, good)}
    for name, why in (
        ("custom_checkpoint_0.pkl", "is compressed"),
        ("optimizer.bin", "share memory"),
        ("scheduler.bin", "expands to"),
    ):
        assert results[name]["error"] and why in results[name]["error"], results[name]
        assert name in results[name]["error"]
    assert results["custom_checkpoint_0.pkl"]["grew"] < 32 * MiB, results
    assert results["optimizer.bin"]["grew"] < 32 * MiB, results
    assert results["scheduler.bin"]["grew"] < 64 * MiB, results
    assert results["pytorch_model.bin"]["error"] is None, results
    assert results["pytorch_model.bin"]["grew"] < 3 * good.stat().st_size, results


def test_two_imports_of_a_good_folder_are_identical(
    tmp_path: Path, accelerate_folder: Path
) -> None:
    """Every byte an import writes comes from the source: two imports agree on every data
    file (the save marker and manifest differ only by time and process), and the NumPy key is
    the source's."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    outputs = []
    for i, run in enumerate((console, cli)):  # the console script, then in this process
        destination = tmp_path / f"imported_{i}"
        proc = run("ckpt", "import", str(folder), str(destination))
        assert proc.returncode == 0, proc.stderr
        outputs.append(destination)
    first, second = ({p.name: p.read_bytes() for p in d.iterdir()} for d in outputs)
    assert sorted(first) == sorted(second)
    for name in sorted(set(first) - {"accelkit.json", ".accelkit-save.json"}):
        assert first[name] == second[name], name
    manifests = [json.loads((d / "accelkit.json").read_text())["files"] for d in outputs]
    strip = [
        [{k: v for k, v in f.items() if f["path"] != ".accelkit-save.json"} for f in m]
        for m in manifests
    ]
    assert strip[0] == strip[1]
    source = torch.load(folder / "random_states_0.pkl", weights_only=False)["numpy_random_seed"]
    imported = read_state(get_storage(str(outputs[0])), str(outputs[0]), "random_states_0")
    assert np.array_equal(imported["numpy"][1], source[1])


def test_plain_data_of_every_kind_still_loads(tmp_path: Path, accelerate_folder: Path) -> None:
    """What the rules must keep accepting: tied and transposed tensors over one storage,
    bfloat16, sets, dtypes, sizes, devices, bytes, NaN, and an archive assembled by this test's
    own writer (so the refusals above are the attacks', not the writer's)."""
    folder = copy_into_project(tmp_path, accelerate_folder)
    weight = torch.arange(6.0).view(2, 3)
    state = {
        "seen": 3,
        "tied": [weight, weight],
        "transposed": weight.t(),
        "row": weight[1],
        "half": torch.ones(3, dtype=torch.bfloat16),
        "set": {1, 2},
        "dtype": torch.float16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "bytes": b"\x00\xff",
        "nan": float("nan"),
    }
    torch.save(state, folder / "custom_checkpoint_0.pkl")
    crafted = tmp_path / "crafted.bin"
    storage = Storage("0", torch.FloatStorage, 6)
    craft(
        crafted, {"t": Tensor(storage, (3, 2), (1, 3), offset=0)}, {"0": weight.numpy().tobytes()}
    )
    value = load_pickle(get_storage(str(crafted)), str(crafted))
    assert torch.equal(value["t"], weight.t())
    accelerator, _ = _accelerator(folder.parent.parent)
    accelerator.load_state(str(folder))
    proc = cli("ckpt", "import", str(folder), str(tmp_path / "imported"))
    assert proc.returncode == 0, proc.stderr
    loaded = load_pickle(get_storage(str(folder)), str(folder / "custom_checkpoint_0.pkl"))
    assert torch.equal(loaded["transposed"], weight.t()) and loaded["set"] == {1, 2}


# ----------------------------------------------------------------- fuzz

_FUZZ_EXAMPLES = trials(150, 1500)


class _Files(dict[str, bytes]):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"<{', '.join(self)}>"


@pytest.fixture(scope="module")
def real_pickles(accelerate_folder: Path) -> dict[str, bytes]:
    return _Files(
        (name, (accelerate_folder / name).read_bytes())
        for name in ("optimizer.bin", "random_states_0.pkl")
    )


@settings(
    max_examples=_FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(["optimizer.bin", "random_states_0.pkl"]),
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.binary(min_size=0, max_size=8)),
        min_size=1,
        max_size=4,
    ),
    cut=st.booleans(),
    inside=st.booleans(),
)
def test_mutated_pickles_give_a_value_or_a_corrupt_checkpoint_error(
    tmp_path_factory: pytest.TempPathFactory,
    real_pickles: dict[str, bytes],
    name: str,
    edits: list[tuple[float, bytes]],
    cut: bool,
    inside: bool,
) -> None:
    """Bytes of a real file, or (``inside``) of its ``data.pkl`` zipped again as torch.save
    would, overwritten or cut: ``load_pickle`` returns a value or raises
    ``CorruptCheckpointError`` naming the file, never another exception."""
    path = tmp_path_factory.mktemp("fuzz") / name
    path.write_bytes(real_pickles[name])
    with zipfile.ZipFile(path) as archive:
        records = {n: archive.read(n) for n in archive.namelist()}
    pkl = next(n for n in records if n.endswith("/data.pkl"))
    data = bytearray(records[pkl] if inside else real_pickles[name])
    for where, patch in edits:
        at = int(where * len(data))
        data[at : at + len(patch)] = patch
    if cut:
        data = data[: len(data) // 2]
    if inside:
        records[pkl] = bytes(data)
        with zipfile.ZipFile(path, "w") as archive:
            for record, content in records.items():
                archive.writestr(record, content)
    else:
        path.write_bytes(bytes(data))
    try:
        load_pickle(get_storage(str(path)), str(path))
    except CorruptCheckpointError as exc:
        assert str(path) in str(exc)
