"""Hostile DCP metadata (``<ckpt>/sharded/.metadata``): nothing runs, nothing outside is read.

DCP's index is a pickle, read by :func:`accelkit.checkpointing.sharded.read_sharded_metadata`
with an allow-list unpickler. The contract: only exact ``(module, name)`` pairs resolve (DCP's
metadata dataclasses, ``torch.Size``, torch dtypes by name, ``torch.serialization._get_layout``,
``pathlib.PosixPath``); no dotted name and nothing reached through a module's own imports
(``torch.distributed.checkpoint.metadata`` imports ``os``); allowed callables with hostile
arguments, opcodes that allocate what the file does not hold, and storage entries whose
``relative_path`` leaves ``sharded/`` all end in a ``CorruptCheckpointError`` naming the
``.metadata`` file. Each payload that would run code creates a marker file if it does.

Surfaces: ``read_sharded_metadata`` itself, ``accelkit ckpt inspect`` (in-process through
``accelkit.cli.main.main``), ``ckpt verify`` / ``ckpt ls`` (must not crash; they check sizes and
checksums, so with a re-signed manifest verify may pass), and an FSDP2 ``load_state(path)`` /
``load_state()`` on 2 real gloo processes (one job for all of them, see
:func:`test_fsdp_load_state_refuses_hostile_metadata_and_linked_shards`).
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit.checkpointing.errors import CheckpointError, CorruptCheckpointError
from accelkit.checkpointing.storage import get_storage
from tests.helpers.distributed import run_distributed
from tests.reliability.test_hostile import _accelerator, _ckpt, _resign, _run_cli

MODULE = "torch.distributed.checkpoint.metadata"

# ------------------------------------------------------------------ pickle opcodes by hand


def _proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def _str(text: str) -> bytes:
    raw = text.encode()
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE (protocol 4)
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _ustr(text: str) -> bytes:
    """BINUNICODE: valid in every protocol >= 1."""
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


_MARK, _STOP, _REDUCE, _TUPLE1, _BUILD = b"(", b".", b"R", b"\x85", b"b"
_STACK_GLOBAL, _EMPTY_DICT, _SETITEM, _NEWTRUE = b"\x93", b"}", b"s", b"\x88"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def code_payloads(marker: Path) -> dict[str, bytes]:
    """Pickles that create ``marker`` if an unpickler resolves what they ask for."""
    cmd = _touch(marker)
    dotted = _str(MODULE) + _str("os.system") + _STACK_GLOBAL
    return {
        # The classic: a global the allow-list does not name.
        "p2-global-os-system": _proto(2)
        + _global("os", "system")
        + _ustr(cmd)
        + _TUPLE1
        + _REDUCE
        + _STOP,
        "p2-builtins-exec": _proto(2)
        + _global("builtins", "exec")
        + _ustr(f"open({str(marker)!r}, 'w').write('ran')")
        + _TUPLE1
        + _REDUCE
        + _STOP,
        # A dotted name inside an allowed module: protocol >= 4 resolves it attribute by
        # attribute, i.e. through the module's own ``import os``.
        "p4-stack-global-dotted": _proto(4) + dotted + _str(cmd) + _TUPLE1 + _REDUCE + _STOP,
        "p5-stack-global-dotted": _proto(5) + dotted + _str(cmd) + _TUPLE1 + _REDUCE + _STOP,
        "p4-global-dotted": _proto(4)
        + _global(MODULE, "os.system")
        + _str(cmd)
        + _TUPLE1
        + _REDUCE
        + _STOP,
        "p2-global-dotted": _proto(2)
        + _global(MODULE, "os.system")
        + _ustr(cmd)
        + _TUPLE1
        + _REDUCE
        + _STOP,
        # INST and OBJ call what they resolve, like REDUCE.
        "p4-inst-dotted": _proto(4)
        + _MARK
        + _str(cmd)
        + b"i"
        + MODULE.encode()
        + b"\n"
        + b"os.system\n"
        + _STOP,
        "p4-obj-dotted": _proto(4) + _MARK + dotted + _str(cmd) + b"o" + _STOP,
        # The module itself is reachable through the allowed module's namespace.
        "p4-module-through-import": _proto(4) + _str(MODULE) + _str("os") + _STACK_GLOBAL + _STOP,
    }


def value_payloads() -> dict[str, bytes]:
    """Pickles that use only allowed names, with hostile arguments or hostile contents."""
    return {
        # An allowed callable with arguments it does not accept.
        "size-of-a-string": _proto(4)
        + _str("torch")
        + _str("Size")
        + _STACK_GLOBAL
        + _str("not-an-int")
        + _TUPLE1
        + _TUPLE1
        + _REDUCE
        + _STOP,
        "get-layout-unknown-name": _proto(4)
        + _str("torch.serialization")
        + _str("_get_layout")
        + _STACK_GLOBAL
        + _str("torch.evil_layout")
        + _TUPLE1
        + _REDUCE
        + _STOP,
        # DCP's Metadata with garbage where its fields should be.
        "metadata-garbage-fields": _proto(4)
        + _str(MODULE)
        + _str("Metadata")
        + _STACK_GLOBAL
        + _str("garbage")
        + _TUPLE1
        + _REDUCE
        + _STOP,
        # Extension opcodes (the registry is empty; still a clean refusal).
        "ext1": _proto(4) + b"\x82\x7f" + _STOP,
        "ext2": _proto(4) + b"\x83" + struct.pack("<H", 0xBEEF) + _STOP,
        "ext4": _proto(4) + b"\x84" + struct.pack("<i", 0x7EADBEEF) + _STOP,
        # Counted opcodes claiming far more than the file holds: the unpickler allocates the
        # claimed size before reading (memory must stay bounded by the file's size).
        "binbytes8-1tib": _proto(4) + b"\x8e" + struct.pack("<Q", 2**40) + b"xx" + _STOP,
        "bytearray8-1tib": _proto(5) + b"\x96" + struct.pack("<Q", 2**40) + b"xx" + _STOP,
        "binbytes8-2to63": _proto(4) + b"\x8e" + struct.pack("<Q", 2**63 + 5) + b"xx" + _STOP,
    }


# Storage entries (``_StorageInfo.relative_path``) that leave the sharded folder.
ESCAPES = {"relative-path-dotdot": "../../outside/x.distcp", "relative-path-absolute": None}
VALUE_CASES = sorted([*value_payloads(), *ESCAPES])


def valid_metadata(root: Path) -> bytes:
    """The ``.metadata`` of a real DCP checkpoint written in this process (no process group;
    call it only where ``torch.distributed`` is not initialised: it is a collective there)."""
    import warnings

    from accelkit.checkpointing.sharded import write_sharded

    folder = root / "valid-dcp"
    if not (folder / "sharded" / ".metadata").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            write_sharded(get_storage(str(folder)), str(folder), {"model": {"w": torch.ones(4)}})
    return (folder / "sharded" / ".metadata").read_bytes()


def relocated(raw: bytes, relative_path: str) -> bytes:
    """Valid metadata ``raw`` with every ``_StorageInfo.relative_path`` = ``relative_path``."""
    metadata = pickle.loads(raw)  # our own file, written by the test
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    return pickle.dumps(metadata, protocol=4)


# ------------------------------------------------------------------ single-process surfaces


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed (unsharded) checkpoint from ``save_state``; copies of it get a ``sharded/``."""
    root = tmp_path_factory.mktemp("dcp-base") / "project"
    accelerator, _ = _accelerator(root)
    accelerator.save_state()
    return _ckpt(root, 0)


def _plant(base: Path, where: Path, metadata: bytes) -> Path:
    """A copy of ``base`` holding ``sharded/.metadata`` = ``metadata``, manifest re-signed."""
    shutil.copytree(base, where)
    (where / "sharded").mkdir()
    (where / "sharded" / ".metadata").write_bytes(metadata)
    _resign(where, {"sharded/.metadata": where / "sharded" / ".metadata"})
    return where


def _all_surfaces_refuse(
    folder: Path, capsys: pytest.CaptureFixture[str], name: str
) -> CorruptCheckpointError:
    from accelkit.checkpointing.sharded import read_sharded_metadata

    sharded_dir = str(folder / "sharded")
    with pytest.raises(CorruptCheckpointError) as info:
        read_sharded_metadata(get_storage(sharded_dir), sharded_dir)
    assert ".metadata" in str(info.value) and sharded_dir in str(info.value), (name, info.value)
    code, out = _run_cli(capsys, "ckpt", "inspect", str(folder))
    assert code == 1 and ".metadata" in out, (name, out)
    # verify and ls read sizes and checksums only (the manifest is re-signed): they must not
    # crash, whatever they conclude.
    code, out = _run_cli(capsys, "ckpt", "verify", str(folder))
    assert code in (0, 1), (name, out)
    code, out = _run_cli(capsys, "ckpt", "ls", str(folder.parent), "--json")
    assert code in (0, 1), (name, out)
    return info.value


@pytest.mark.parametrize("name", sorted(code_payloads(Path("m"))))
def test_code_executing_metadata_runs_nothing(
    name: str, base_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "PWNED"
    folder = _plant(base_checkpoint, tmp_path / "checkpoint_3", code_payloads(marker)[name])
    _all_surfaces_refuse(folder, capsys, name)
    assert not marker.exists(), f"{name}: the pickle's code ran"


@pytest.mark.parametrize("name", VALUE_CASES)
def test_hostile_metadata_values_are_refused(
    name: str, base_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    if name in ESCAPES:
        target = ESCAPES[name] or str(outside / "x.distcp")
        payload = relocated(valid_metadata(tmp_path), target)
    else:
        payload = value_payloads()[name]
    folder = _plant(base_checkpoint, tmp_path / "checkpoint_3", payload)
    _all_surfaces_refuse(folder, capsys, name)


def test_metadata_cannot_rewrite_a_module(
    base_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BUILD on a module object reached through the allowed module's ``import os`` would set
    attributes of ``os`` in the loading process (monkey-patching, no callable needed)."""
    attr = f"ACCELKIT_PWNED_{uuid.uuid4().hex[:8]}"
    payload = (
        _proto(2)
        + _global(MODULE, "os")
        + _EMPTY_DICT
        + _ustr(attr)
        + _NEWTRUE
        + _SETITEM
        + _BUILD
        + _STOP
    )
    folder = _plant(base_checkpoint, tmp_path / "checkpoint_3", payload)
    try:
        _all_surfaces_refuse(folder, capsys, "module-build")
        assert not hasattr(os, attr), "the metadata file set an attribute of the os module"
    finally:
        if hasattr(os, attr):
            delattr(os, attr)


# ------------------------------------------------------------------ FSDP2 on 2 processes


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _fsdp_accelerator(project: str, seed: int) -> tuple[Any, nn.Module]:
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin

    config = ProjectConfiguration(project, automatic_checkpoint_naming=True)
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["_Layer"])
    accelerator = Accelerator(fsdp_plugin=plugin, project_config=config)
    torch.manual_seed(seed)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def _local_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _attempt(accelerator: Any, model: nn.Module, path: str | None) -> dict[str, Any]:
    before = _local_weights(model)
    try:
        loaded = accelerator.load_state(path)
        outcome: dict[str, Any] = {"error": None, "message": "", "loaded": loaded}
    except Exception as exc:  # recorded and judged by the test, on the parent's side
        outcome = {"error": type(exc).__name__, "message": str(exc), "loaded": None}
        outcome["is_corrupt"] = isinstance(exc, CorruptCheckpointError)
        outcome["is_checkpoint_error"] = isinstance(exc, CheckpointError)
    outcome["unchanged"] = _same(before, _local_weights(model))
    return outcome


def _job_fsdp_hostile(root: str, marker_dir: str) -> dict[str, Any]:
    """Save a victim project (checkpoints 0, 1) and a decoy project with other weights; plant
    hostile variants of checkpoint_1 (rank 0, manifests re-signed); try to load each."""
    import torch.distributed as dist

    victim, decoy = f"{root}/victim", f"{root}/decoy"
    decoy_acc, decoy_model = _fsdp_accelerator(decoy, seed=1)
    decoy_acc.save_state()
    decoy_weights = _local_weights(decoy_model)
    accelerator, model = _fsdp_accelerator(victim, seed=0)
    accelerator.save_state()
    accelerator.save_state()
    own_weights = _local_weights(model)
    ckpts = Path(victim) / "checkpoints"
    cases = ["p4-stack-global-dotted", "p4-inst-dotted", "get-layout-unknown-name"]
    if dist.get_rank() == 0:
        source = ckpts / "checkpoint_1"
        for name in cases:
            marker = Path(marker_dir) / f"load-{name}"
            payloads = {**code_payloads(marker), **value_payloads()}
            hostile = ckpts / f"hostile_{name}"
            shutil.copytree(source, hostile)
            (hostile / "sharded" / ".metadata").write_bytes(payloads[name])
            _resign(hostile)
        # relative_path leaving sharded/ (to the decoy's own shard file).
        escape = ckpts / "hostile_escape"
        shutil.copytree(source, escape)
        metadata = pickle.loads((escape / "sharded" / ".metadata").read_bytes())  # ours
        for info in metadata.storage_data.values():
            outside = "../../../../decoy/checkpoints/checkpoint_0/sharded"
            info.relative_path = f"{outside}/{info.relative_path}"
        (escape / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
        _resign(escape)
        # sharded/ replaced by a link to the decoy's (valid) sharded folder.
        linked = ckpts / "linked_sharded"
        shutil.copytree(source, linked)
        shutil.rmtree(linked / "sharded")
        (linked / "sharded").symlink_to(Path(decoy) / "checkpoints" / "checkpoint_0" / "sharded")
        _resign(linked)
        # The newest automatic checkpoint holds a code-executing .metadata.
        newest = ckpts / "checkpoint_2"
        shutil.copytree(source, newest)
        marker = Path(marker_dir) / "load-latest"
        (newest / "sharded" / ".metadata").write_bytes(
            code_payloads(marker)["p4-stack-global-dotted"]
        )
        _resign(newest)
    dist.barrier()
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for name in [*cases, "escape"]:
        out[name] = _attempt(accelerator, model, str(ckpts / f"hostile_{name}"))
    out["linked"] = _attempt(accelerator, model, str(ckpts / "linked_sharded"))
    out["linked"]["got_decoy"] = _same(_local_weights(model), decoy_weights)
    out["latest"] = _attempt(accelerator, model, None)
    out["still_own"] = _same(_local_weights(model), own_weights)
    return out


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_fsdp_load_state_refuses_hostile_metadata_and_linked_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    results = run_distributed(_job_fsdp_hostile, str(tmp_path), str(markers), timeout=240)
    problems: list[str] = []  # every broken promise at once, not only the first

    def check(ok: Any, what: str, got: Any) -> None:
        if not ok:
            problems.append(f"{what}: {got}")

    for r in results:
        rank = r["rank"]
        for name in (
            "p4-stack-global-dotted",
            "p4-inst-dotted",
            "get-layout-unknown-name",
            "escape",
        ):
            got = r[name]
            check(got.get("is_corrupt"), f"rank {rank} {name}: not a CorruptCheckpointError", got)
            check(".metadata" in got["message"], f"rank {rank} {name}: .metadata not named", got)
            check(got["unchanged"], f"rank {rank} {name}: weights changed", got)
        linked = r["linked"]
        check(linked.get("is_corrupt"), f"rank {rank} linked sharded/: not refused", linked)
        check(
            "symbolic link" in linked["message"], f"rank {rank} linked: no 'symbolic link'", linked
        )
        check(
            linked["unchanged"] and not linked["got_decoy"], f"rank {rank} linked: weights", linked
        )
        # load_state(): the newest checkpoint_2 is hostile. Either refused naming its
        # .metadata, or skipped for an earlier one that verifies; never its code.
        latest = r["latest"]
        if latest["error"] is not None:
            check(
                latest.get("is_corrupt") and ".metadata" in latest["message"],
                f"rank {rank} load_state(): unclear refusal",
                latest,
            )
        else:
            check(not latest["loaded"].endswith("checkpoint_2"), f"rank {rank} latest", latest)
        check(r["still_own"], f"rank {rank}: the model lost its own weights", "")
    ran = sorted(p.name for p in markers.iterdir())
    check(not ran, "a .metadata payload ran (markers created)", ran)

    # The CLI on the linked checkpoint (single process): no tensor of the decoy is listed,
    # verify fails, ls says corrupt, prune never touches the decoy.
    ckpts = tmp_path / "victim" / "checkpoints"
    decoy = tmp_path / "decoy" / "checkpoints" / "checkpoint_0"
    decoy_before = _tree(decoy)
    linked = ckpts / "linked_sharded"
    code, out = _run_cli(capsys, "ckpt", "inspect", str(linked))
    check(code == 1 and "layers.0.linear.weight" not in out, "inspect of linked sharded/", out)
    code, out = _run_cli(capsys, "ckpt", "verify", str(linked))
    check(code == 1, "verify of linked sharded/", out)
    code, out = _run_cli(capsys, "ckpt", "ls", str(tmp_path / "victim"), "--json")
    states = {row["name"]: row["state"] for row in json.loads(out[: out.rindex("]") + 1])}
    check(states.get("linked_sharded") == "corrupt", "ls of linked sharded/", states)
    code, out = _run_cli(capsys, "ckpt", "prune", str(tmp_path / "victim"), "--keep", "1", "--yes")
    check(code == 0, "prune", out)
    check(_tree(decoy) == decoy_before, "the decoy changed", sorted(_tree(decoy)))
    assert not problems, "\n".join(problems)


def test_a_linked_metadata_file_is_refused(
    base_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sharded/.metadata`` as a link to a valid metadata file outside (manifest re-signed):
    refused as a corrupt checkpoint naming the link, like every other linked file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".metadata").write_bytes(valid_metadata(tmp_path))
    folder = _plant(base_checkpoint, tmp_path / "checkpoint_3", b"placeholder")
    (folder / "sharded" / ".metadata").unlink()
    (folder / "sharded" / ".metadata").symlink_to(outside / ".metadata")
    _resign(folder)
    error = _all_surfaces_refuse(folder, capsys, "linked-metadata")
    assert "symbolic link" in str(error), error
