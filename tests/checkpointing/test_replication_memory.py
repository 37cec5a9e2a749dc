"""The replicator's memory (issue #26), in real uploads to SeaweedFS: it holds at most
``UPLOAD_PARTS_IN_FLIGHT + 1`` part buffers, reads the local file straight into them, and
hands them to the HTTP client as they are, which sends them without copying them.

The structure is what is asserted (buffers counted where they are made, Python allocations
counted by tracemalloc), never a resident-set size: ``benchmarks/bench_replication.py``
measures that, in a fresh process.
"""

from __future__ import annotations

import io
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import pytest

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.replication import copy as replication_copy
from accelkit.checkpointing.replication import replicate_checkpoint
from accelkit.checkpointing.replication.replicator import FOREVER, remote_options
from accelkit.checkpointing.storage import _s3io, get_storage, join
from tests.checkpointing.test_replication import Blob
from tests.fixtures.s3 import S3Server

pytest.importorskip("s3fs", reason="the remote tier is S3: pip install 'accelkit[s3]'")

MIB = 1024 * 1024
PART = 5 * MIB  # S3's smallest part: a 24 MB file is five parts


def _committed(tmp_path: Path) -> str:
    config = ProjectConfiguration(
        project_dir=str(tmp_path / "run"), automatic_checkpoint_naming=True
    )
    accelerator = Accelerator(project_config=config, cpu=True)
    accelerator.register_for_checkpointing(Blob(6_000_000, seed=0))  # 24 MB of float32
    return accelerator.save_state()


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, 2])
def test_replicator_holds_at_most_parts_in_flight_plus_one_part_buffers(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: int
) -> None:
    monkeypatch.setattr(_s3io, "PART_SIZE", PART)
    monkeypatch.setattr(replication_copy, "UPLOAD_PARTS_IN_FLIGHT", in_flight)
    source = _committed(tmp_path)

    alive: weakref.WeakSet[io.BytesIO] = weakref.WeakSet()  # part buffers not yet freed
    most = 0
    new_part = _s3io._new_part

    def counted(size: int) -> io.BytesIO:
        nonlocal most
        part = new_part(size)
        if size == PART:
            alive.add(part)
            most = max(most, len(alive))
        return part

    sent: list[bool] = []
    upload_part = _s3io.MultipartSink._upload_part

    def checked(self: Any, number: int, body: Any) -> Any:
        sent.append(body in alive)  # the buffer the part was read into, not a copy of it
        return upload_part(self, number, body)

    def no_read_buffer(*args: Any) -> None:
        raise AssertionError("an S3 upload went through the read buffer instead of its parts")

    monkeypatch.setattr(_s3io, "_new_part", counted)
    monkeypatch.setattr(_s3io.MultipartSink, "_upload_part", checked)
    monkeypatch.setattr(replication_copy, "copy_stream", no_read_buffer)

    url = s3_server.new_prefix()
    remote = get_storage(url, remote_options(url, s3_server.storage_options))
    remote.exists(url)  # the client and its event loop exist before allocations are counted
    target = join(url, "checkpoint_0")
    tracemalloc.start()
    try:
        done = replicate_checkpoint(get_storage(source), source, remote, target, FOREVER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert done.bytes > 4 * PART and len(sent) >= 5  # a multipart upload did happen
    assert all(sent), "a part was sent as a copy instead of the buffer it was read into"
    assert most <= in_flight + 1, f"{most} part buffers alive at once"
    # Every Python allocation of the copy at its peak: the part buffers and a few small
    # pieces (the client's 256 KiB writes, botocore's 1 MiB checksum reads). One copy of a
    # part anywhere (the HTTP client joining headers and body, a transport buffer, a
    # bytes() of the body, a read buffer) would add 5 MiB.
    assert peak <= (in_flight + 2) * PART + 2 * MIB, f"{peak / MIB:.1f} MiB traced at the peak"
    local = get_storage(source)
    for name in ("custom_checkpoint_0.safetensors", "accelkit.json"):
        assert remote.read_bytes(join(target, name)) == local.read_bytes(join(source, name))


@pytest.mark.parametrize("damage", ["grown", "flipped"])
def test_parts_read_in_place_still_verify_the_local_file(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Reading straight into the parts (no read buffer, no read past the end) still refuses a
    local file that differs from its manifest: one that grew after the save (its size) and
    one with a byte changed in place (its checksum, known only once the last part is read).
    Nothing is committed remotely."""
    from accelkit.checkpointing.errors import CorruptCheckpointError
    from accelkit.checkpointing.formats.manifest import read_manifest

    monkeypatch.setattr(_s3io, "PART_SIZE", PART)
    source = _committed(tmp_path)
    path = Path(source) / "custom_checkpoint_0.safetensors"
    original = path.read_bytes()
    if damage == "grown":
        path.write_bytes(original + b"tail written later")
    else:
        changed = bytearray(original)
        changed[len(changed) // 2] ^= 0xFF
        path.write_bytes(bytes(changed))
    url = s3_server.new_prefix()
    remote = get_storage(url, remote_options(url, s3_server.storage_options))
    target = join(url, "checkpoint_0")
    with pytest.raises(CorruptCheckpointError, match=path.name):
        replicate_checkpoint(get_storage(source), source, remote, target, FOREVER)
    assert read_manifest(remote, target) is None
    assert not remote.exists(join(target, path.name))
