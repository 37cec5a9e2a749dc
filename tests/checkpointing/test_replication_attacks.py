"""A crafted REMOTE checkpoint (issue #26): the remote tier is untrusted input too.

Each case writes a checkpoint on the real S3 server (SeaweedFS) whose manifest is consistent
everywhere except where it hurts, then runs what meets it: ``load_state()``'s pick of the newest
checkpoint on either tier, and ``accelkit ckpt sync``. Each must refuse it (a clear message),
never write outside the local project and never delete or change local data.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit.cli.main import main as cli
from tests.checkpointing.test_replication import _flags, _options, _run
from tests.fixtures.s3 import S3Server

pytest.importorskip("s3fs", reason="the remote tier is S3: pip install 'accelkit[s3]'")


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (the local project and its parent) with its hash."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(".accelkit-run")
    }


def _fs(server: S3Server) -> Any:
    import s3fs

    opts = server.storage_options
    return s3fs.S3FileSystem(
        key=opts["key"], secret=opts["secret"], client_kwargs=opts.get("client_kwargs", {}),
        endpoint_url=opts.get("endpoint_url"), skip_instance_cache=True,
    )  # fmt: skip


def _key(url: str) -> str:
    return url.removeprefix("s3://")


def _manifest(fs: Any, folder: str) -> dict[str, Any]:
    return json.loads(fs.cat(f"{_key(folder)}/accelkit.json"))


def _plant(fs: Any, remote: str, source: str, name: str, edit: Callable[[dict, Any, str], None]):
    """Copy remote checkpoint ``source`` to ``name`` (replacing it), then let ``edit`` tamper
    with it (its manifest as a dict, the filesystem, the folder's key); the manifest is written
    last."""
    src, dst = f"{_key(remote)}/checkpoints/{source}", f"{_key(remote)}/checkpoints/{name}"
    files = {path[len(src) :]: fs.cat(path) for path in fs.find(src)}
    if fs.exists(dst):
        fs.rm(dst, recursive=True)
    for rel, data in files.items():
        fs.pipe(dst + rel, data)
    manifest = json.loads(files["/accelkit.json"])
    edit(manifest, fs, dst)
    fs.pipe(f"{dst}/accelkit.json", json.dumps(manifest).encode())
    fs.invalidate_cache()


def _escape_path(m: dict, fs: Any, dst: str) -> None:
    m["files"][0]["path"] = "../../escaped.bin"  # (SeaweedFS refuses such a key itself)


def _absolute_path(m: dict, fs: Any, dst: str) -> None:
    m["files"][0]["path"] = "/etc/passwd"


def _size_lies(m: dict, fs: Any, dst: str) -> None:
    m["files"][0]["size"] += 1


def _file_cut(m: dict, fs: Any, dst: str) -> None:
    # the manifest untouched, a file one byte short (an upload cut by someone else)
    path = f"{dst}/{m['files'][0]['path']}"
    fs.pipe(path, fs.cat(path)[:-1])


def _checksum_lies(m: dict, fs: Any, dst: str) -> None:
    # a file changed in place, the manifest consistent with its size: only the hash tells
    for entry in m["files"]:
        if entry["path"].endswith(".safetensors"):
            data = bytearray(fs.cat(f"{dst}/{entry['path']}"))
            data[-1] ^= 0xFF
            fs.pipe(f"{dst}/{entry['path']}", bytes(data))
            return
    raise AssertionError("no safetensors file")


def _higher_step(m: dict, fs: Any, dst: str) -> None:
    m["iteration"] = 10**9
    m["step"] = 10**9


def _file_and_folder(m: dict, fs: Any, dst: str) -> None:
    # a key that is a file and a "folder" at once (an object store's nearest thing to a link)
    entry = m["files"][0]
    fs.pipe(f"{dst}/{entry['path']}/shadow", b"not the file")
    m["files"].append(
        {"path": f"{entry['path']}/shadow", "size": 12, "checksum": entry["checksum"]}
    )


ATTACKS = {
    "path_outside": _escape_path,
    "absolute_path": _absolute_path,
    "size_lies": _size_lies,
    "file_cut": _file_cut,
    "checksum_lies": _checksum_lies,
    "file_and_folder_key": _file_and_folder,
}


def _project(server: S3Server, tmp_path: Path) -> tuple[str, str, dict[str, Any], torch.Tensor]:
    remote = server.new_prefix()
    local = str(tmp_path / "run")
    options = _options(server)
    accelerator, _, blob = _run(local, remote, options)
    accelerator.save_state()
    blob.data += 1
    accelerator.save_state()
    assert accelerator._checkpoints.wait_replicated(30)
    accelerator.end_training()
    return local, remote, options, blob.data.clone()


@pytest.mark.slow
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_crafted_newer_remote_checkpoint_is_refused_by_load_state(
    s3_server: S3Server, tmp_path: Path, attack: str, caplog: pytest.LogCaptureFixture
) -> None:
    local, remote, options, saved = _project(s3_server, tmp_path)
    fs = _fs(s3_server)
    _plant(fs, remote, "checkpoint_1", "checkpoint_7", ATTACKS[attack])
    before = _tree(tmp_path)
    fresh, _, blob = _run(local, remote, options, seed=9)
    with caplog.at_level(logging.WARNING, logger="accelkit"):
        loaded = fresh.load_state()
    # the newest checkpoint that verifies: the intact local one, never the crafted remote one
    assert loaded == str(Path(local) / "checkpoints" / "checkpoint_1")
    assert torch.equal(blob.data, saved)
    fresh.end_training()
    assert _tree(tmp_path) == before  # nothing written or deleted locally
    assert not fs.exists(f"{_key(remote)}/escaped.bin") or attack == "path_outside"


@pytest.mark.slow
def test_crafted_manifest_claiming_a_higher_step_does_not_win(
    s3_server: S3Server, tmp_path: Path
) -> None:
    local, remote, options, saved = _project(s3_server, tmp_path)
    fs = _fs(s3_server)
    # an older folder whose manifest claims iteration and step 10**9
    _plant(fs, remote, "checkpoint_1", "checkpoint_0", _higher_step)
    fresh, _, blob = _run(local, remote, options, seed=9)
    assert fresh.load_state() == str(Path(local) / "checkpoints" / "checkpoint_1")
    assert torch.equal(blob.data, saved)
    assert fresh.save_state() == str(Path(local) / "checkpoints" / "checkpoint_2")
    fresh.end_training()


@pytest.mark.slow
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_ckpt_sync_refuses_a_crafted_remote_checkpoint(
    s3_server: S3Server, tmp_path: Path, attack: str, capsys: pytest.CaptureFixture[str]
) -> None:
    local, remote, options, _ = _project(s3_server, tmp_path)
    fs = _fs(s3_server)
    # the remote copy of checkpoint_1 is replaced by a crafted one
    _plant(fs, remote, "checkpoint_1", "checkpoint_1", ATTACKS[attack])
    before = _tree(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    code = cli(["ckpt", "sync", local, remote, "--retry-seconds", "5", *_flags(options)])
    out = capsys.readouterr()
    assert _tree(tmp_path / "run" / "checkpoints") == before  # local data untouched
    assert not (tmp_path / "escaped.bin").exists()
    target = f"{remote}/checkpoints/checkpoint_1"
    capsys.readouterr()
    verified = cli(["ckpt", "verify", target, *_flags(options)])
    if attack == "file_cut":
        # our own manifest over a file that disagrees with it: un-committed and copied again
        assert code == 0 and verified == 0
    elif attack == "checksum_lies":
        # bytes changed in place with every size right: sync does not read the remote bytes
        # back (it never re-hashes what it wrote), so it finds nothing to do; the damage is
        # for `ckpt verify` and load_state() to refuse (see the load test above)
        assert code == 0 and "nothing to copy" in out.out
        assert verified == 1
    else:  # a manifest that is not ours: refused, named, the remote left as it was
        assert code == 1
        assert "checkpoint_1" in out.err + out.out
        assert verified == 1
