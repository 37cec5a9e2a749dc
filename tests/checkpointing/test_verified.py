"""The verified-read primitive: every way a file can disagree with its manifest entry ends in a
CorruptCheckpointError naming the file; a matching file reads back whole."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.manifest import FileEntry
from accelkit.checkpointing.storage import join, verified
from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM, checksum_bytes
from accelkit.checkpointing.storage.local import LocalStorage
from accelkit.checkpointing.storage.verified import (
    file_checksum,
    open_verified,
    read_verified_bytes,
)
from tests.checkpointing.conftest import Root

DATA = b"0123456789" * 1000


def _entry(data: bytes) -> FileEntry:
    return FileEntry("f.bin", len(data), checksum_bytes(data))


def test_matching_file_reads_back_and_hashes_like_the_writer(root: Root) -> None:
    url = join(root.url, "f.bin")
    written = root.storage.write_bytes(url, DATA)
    assert read_verified_bytes(root.storage, url, _entry(DATA)) == DATA
    assert read_verified_bytes(root.storage, url, None) == DATA
    assert file_checksum(root.storage, url, DEFAULT_ALGORITHM) == (written.size, written.checksum)
    with open_verified(root.storage, url, _entry(DATA)) as reader:
        assert reader.read(10) == DATA[:10]  # the rest is read (and hashed) on leaving


@pytest.mark.parametrize(
    ("on_disk", "message"),
    [
        (DATA[:-1], "size 9999 bytes, but the manifest says 10000"),
        (DATA + b"x", "longer than the 10000 bytes the manifest says"),
        (b"X" + DATA[1:], "does not match the manifest"),
    ],
    ids=["truncated", "trailing", "flipped"],
)
def test_disagreeing_file_is_refused_naming_it(root: Root, on_disk: bytes, message: str) -> None:
    url = join(root.url, "f.bin")
    root.storage.write_bytes(url, on_disk)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        read_verified_bytes(root.storage, url, _entry(DATA))
    assert url in str(info.value)
    # Also after a partial read: leaving the block reads the rest and checks.
    with (
        pytest.raises(CorruptCheckpointError, match=message),
        open_verified(root.storage, url, _entry(DATA)) as reader,
    ):
        reader.read(3)


def test_missing_file_and_symlink_are_corrupt(root: Root) -> None:
    missing = join(root.url, "gone.bin")
    with pytest.raises(CorruptCheckpointError, match=r"gone\.bin is missing"):
        read_verified_bytes(root.storage, missing, _entry(DATA))
    if root.storage.local_path(root.url) is None:
        return  # object stores have no links
    target = join(root.url, "real.bin")
    root.storage.write_bytes(target, DATA)
    os.symlink(target, join(root.url, "link.bin"))
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        read_verified_bytes(root.storage, join(root.url, "link.bin"), _entry(DATA))


def test_leaving_a_block_asks_for_no_more_than_the_manifest_size_and_one_byte(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check at the end reads what is left plus one byte (to see trailing bytes), not a
    16 MiB buffer, so a file that ends where its entry says costs no large allocation at EOF."""
    url = join(root.url, "f.bin")
    root.storage.write_bytes(url, DATA)
    asked: list[int] = []

    class Recording:
        def __init__(self, raw: Any) -> None:
            self.raw = raw

        def read(self, n: int = -1) -> bytes:
            asked.append(n)
            return bytes(self.raw.read(n))

        def close(self) -> None:
            self.raw.close()

    with open_verified(root.storage, url, _entry(DATA)) as reader:
        reader.raw = Recording(reader.raw)  # type: ignore[assignment]
        reader.read(10)
    assert asked == [10, len(DATA) - 10 + 1, 1]

    # A file checked from its start is still read in bounded pieces, never in one allocation.
    asked.clear()
    monkeypatch.setattr(verified, "_CHUNK", 4096)
    with open_verified(root.storage, url, _entry(DATA)) as reader:
        reader.raw = Recording(reader.raw)  # type: ignore[assignment]
    assert asked == [4096, 4096, len(DATA) - 2 * 4096 + 1, 1]


def test_a_file_that_grew_huge_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A manifest-listed file replaced by a 2 GiB one (sparse here: an attacker's or a bad
    copy's) is refused after reading one byte past the entry's size, not read into memory."""
    storage = LocalStorage()
    url = str(tmp_path / "random_states_0.json")
    storage.write_bytes(url, DATA)
    os.truncate(url, 2 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="longer than the 10000 bytes"):
            read_verified_bytes(storage, url, _entry(DATA))
        with (
            pytest.raises(CorruptCheckpointError, match="longer than the 10000 bytes"),
            open_verified(storage, url, _entry(DATA)) as reader,
        ):
            reader.read(10)  # then leaving the block checks the rest
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
