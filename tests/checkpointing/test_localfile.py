"""LocalFile: O_DIRECT writes through reused aligned stages, and the buffered fallback."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from accelkit.checkpointing.storage import _localfile
from accelkit.checkpointing.storage._localfile import (
    ALIGN,
    STAGE_BYTES,
    LocalFile,
    direct_io_enabled,
)

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, STAGE_BYTES - 1, STAGE_BYTES, 3 * STAGE_BYTES + 123]


def _payload(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def _write(path: Path, data: bytes, piece: int) -> LocalFile:
    file = LocalFile(str(path))
    for start in range(0, len(data), piece):
        # The piece's length, without copying the rest of the data each time (that copy made
        # the 12 MiB case quadratic: 7 s of a 9 s module).
        assert file.write(memoryview(data)[start : start + piece]) == min(piece, len(data) - start)
    file.flush()
    os.fsync(file.fileno())
    file.close()
    return file


@pytest.mark.slow
@pytest.mark.skipif(not direct_io_enabled(), reason="O_DIRECT needs Linux")
@pytest.mark.parametrize("size", SIZES)
def test_direct_writes_every_size_exactly(tmp_path: Path, size: int) -> None:
    data = _payload(size)
    # Pieces that straddle stage and block boundaries, and one write of everything.
    for piece in (1000, max(size, 1)):
        path = tmp_path / f"f{piece}"
        file = _write(path, data, piece)
        assert path.read_bytes() == data
        assert file.direct == (size % ALIGN == 0)  # the last partial block is written buffered


def test_buffered_when_direct_io_is_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_DIRECT_IO", "0")
    data = _payload(2 * STAGE_BYTES + 5)
    file = _write(tmp_path / "f", data, 3 * 2**20)
    assert not file.direct
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.skipif(not direct_io_enabled(), reason="O_DIRECT needs Linux")
def test_falls_back_to_buffered_when_a_direct_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some file systems accept O_DIRECT at open and refuse the write (EINVAL)."""
    real = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(_localfile.os, "pwrite", pwrite)
    data = _payload(2 * STAGE_BYTES + ALIGN)
    file = _write(tmp_path / "f", data, 2**20)
    assert refused and not file.direct
    assert (tmp_path / "f").read_bytes() == data


def test_refuses_an_existing_file_and_abort_closes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        LocalFile(str(path))
    assert path.read_bytes() == b"old"
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    file = LocalFile(str(tmp_path / "g"))
    file.write(_payload(STAGE_BYTES + 10))
    file.abort()
    with pytest.raises(ValueError, match="after it was closed"):
        file.write(b"x")
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # the descriptor is gone


def test_stages_are_reused_across_files(tmp_path: Path) -> None:
    for i in range(3):
        _write(tmp_path / f"f{i}", _payload(2 * STAGE_BYTES + 1), 2**20)
    if not direct_io_enabled():
        pytest.skip("stages are used with O_DIRECT only (needs Linux)")
    pool = list(_localfile._free)
    assert pool and len(pool) <= _localfile._POOL_KEEP  # buffers kept for reuse, bounded
    _write(tmp_path / "again", _payload(STAGE_BYTES), STAGE_BYTES)
    assert {id(s) for s in _localfile._free} <= {id(s) for s in pool}  # no new buffer
