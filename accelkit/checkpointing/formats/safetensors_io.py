"""The safetensors format, written as a stream and read with checks.

The format is an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``,
``shape``, ``data_offsets`` relative to the end of the header; optional ``__metadata__`` of
strings), then the raw little-endian bytes. Writing it ourselves lets a save stream each tensor
straight to storage while hashing it, so the extra memory of a save is one chunk, not the whole
file (``safetensors.torch.save_file`` builds the whole buffer first).

Public API:

- :func:`write_safetensors(storage, url, tensors, metadata) <write_safetensors>` -- stream a
  ``name -> tensor`` mapping to one file; returns the :class:`~accelkit.checkpointing.storage.
  WrittenFile` (size and checksum).
- :func:`read_safetensors(storage, url, expected=None) <read_safetensors>` -- every tensor,
  streamed once; with ``expected`` (a manifest :class:`~accelkit.checkpointing.formats.manifest.
  FileEntry`) the size and checksum are verified in the same pass. Hostile headers (huge
  lengths, offsets past the end, overlapping tensors) are refused before any allocation.
- :class:`SafetensorsStream` -- the same read, one tensor at a time (an export never holds
  the whole file), or in pieces of a bounded size read into the caller's buffers (a diff);
  :func:`safetensors_layout` -- the header and offsets of a file to write.
- :func:`check_expected`, :func:`read_verified_bytes` -- re-exported from
  :mod:`~accelkit.checkpointing.storage.verified`, the one verified-read primitive.
- :func:`supports_dtype`, :func:`parse_size` (``"10GB"``/``"500MB"``/int -> bytes).

To list tensors without reading them, see :mod:`accelkit.checkpointing.catalog.inspect`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from accelkit._units import parse_bytes
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.safetensors_header import (
    SafetensorsHeader,
    TensorInfo,
    header_length,
    parse_header,
)
from accelkit.checkpointing.storage import Storage, WrittenFile
from accelkit.checkpointing.storage.checksum import format_checksum, new_hasher, parse_checksum
from accelkit.checkpointing.storage.verified import (
    VerifiedReader,
    check_expected,
    open_verified,
    read_verified_bytes,
)
from accelkit.errors import WrongTypeError

__all__ = [
    "SafetensorsStream",
    "check_expected",
    "dtype_code",
    "parse_size",
    "read_safetensors",
    "read_verified_bytes",
    "safetensors_layout",
    "supports_dtype",
    "tensor_dtype",
    "write_safetensors",
]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``"F32"``, ``"BF16"``, ...), or torch's own name for a
    dtype safetensors cannot store."""
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


_CHUNK = 64 * 1024 * 1024


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether safetensors can hold tensors of ``dtype``."""
    return dtype in _DTYPES


def parse_size(size: int | str) -> int:
    """``"10GB"`` -> 10_000_000_000 (``KB/MB/GB/TB`` are powers of 10, ``KiB``... of 2).

    Raises:
        ValueError: for anything else than a positive int or such a string.
    """
    return parse_bytes(size, "max_shard_size")


# ---------------------------------------------------------------------------------- writing


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_tensor(writer: Any, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    if t.numel() == 0:
        return
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        writer.write(flat.numpy().data)
        return
    # Device tensors travel through host memory one chunk at a time.
    for start in range(0, flat.numel(), _CHUNK):
        writer.write(flat[start : start + _CHUNK].cpu().numpy().data)


def _dtype_code(name: str, tensor: torch.Tensor) -> str:
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        raise WrongTypeError(
            f"Tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold."
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise WrongTypeError(f"Tensor {name!r} is not a dense tensor ({tensor.layout}).")
    return code


def safetensors_layout(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data of a safetensors file holding ``tensors``, and where each
    tensor's data starts in the file.

    Tensors are laid out largest element size first (then by name), so every tensor is
    aligned. Only names, dtypes and shapes are used: ``tensors`` may be on the ``meta``
    device (an export plans its files before reading a byte).

    Returns:
        ``(prefix, starts)``: the 8-byte length and the padded JSON header, and each name's
        absolute offset in the file, in data order.

    Raises:
        TypeError: for a dtype safetensors cannot hold, naming the tensor.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    starts: dict[str, int] = {}
    for name in order:
        t = tensors[name]
        end = offset + _nbytes(t)
        header[name] = {
            "dtype": _dtype_code(name, t),
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        starts[name] = offset
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, {name: len(prefix) + start for name, start in starts.items()}


def write_safetensors(
    storage: Storage,
    url: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> WrittenFile:
    """Stream ``tensors`` to a safetensors file at ``url``.

    Laid out by :func:`safetensors_layout`. Each tensor is written from its own memory (a
    non-contiguous one is copied first; a device tensor goes through host memory in 64 MB
    chunks).

    Raises:
        TypeError: for a dtype safetensors cannot hold, naming the tensor.
    """
    prefix, starts = safetensors_layout(tensors, metadata)
    with storage.open_write(url) as writer:
        writer.write(prefix)
        for name in starts:
            _write_tensor(writer, tensors[name])
    assert writer.result is not None
    return writer.result


# ---------------------------------------------------------------------------------- reading


def _corrupt(url: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: {why}. The file is truncated or damaged: load another checkpoint, or save it "
        "again."
    )


def tensor_dtype(url: str, info: TensorInfo) -> torch.dtype:
    """The torch dtype of a tensor of file ``url`` as its header describes it.

    Raises:
        CorruptCheckpointError: a dtype this torch does not have, naming the file and tensor.
    """
    dtype = _CODES.get(info.dtype)
    if dtype is None:
        raise CorruptCheckpointError(
            f"{url}: tensor {info.name!r} has dtype {info.dtype}, which this version of torch "
            "cannot load. Load it with a torch that has that dtype, or save it in another one."
        )
    return dtype


def _open_size(f: Any, storage: Storage, url: str) -> int:
    """Size of the open file ``f`` of ``url`` (no extra request where the file knows it)."""
    if storage.local_path(url) is not None:
        return os.fstat(f.fileno()).st_size
    size = getattr(f, "size", None)
    return size if isinstance(size, int) else storage.size(url)


def _read_exact(
    f: VerifiedReader, n: int, url: str, into: torch.Tensor | None = None
) -> torch.Tensor:
    """Read exactly ``n`` bytes into a fresh uint8 tensor (uninitialised memory: no zeroing
    pass), or into ``into`` (a contiguous uint8 tensor of ``n`` bytes); ``f`` hashes them."""
    buf = torch.empty(n, dtype=torch.uint8) if into is None else into
    view = buf.numpy().data.cast("B") if n else memoryview(b"")
    got = 0
    while got < n:
        count = f.readinto(view[got:])
        if not count:
            raise _corrupt(url, f"unexpected end of file ({got} of {n} bytes)")
        got += count
    return buf


class SafetensorsStream:
    """One safetensors file read in one sequential pass, a tensor at a time.

    Opening it reads and checks the header (:attr:`header`); :meth:`tensors` then yields each
    tensor in data order, in fresh memory, and once the last one is read checks the whole file
    (trailing bytes included) against ``expected``: size and checksum. A consumer holds one
    tensor at a time if it wants; it must exhaust :meth:`tensors` to get the check.

    Args:
        storage: its storage.
        url: the file.
        expected: a manifest entry (``size``, ``checksum``) to verify against, or ``None``.

    Raises:
        CorruptCheckpointError: naming the file, for a bad header, truncation, or a size or
            checksum that disagrees with ``expected``.
    """

    def __init__(self, storage: Storage, url: str, expected: Any = None) -> None:
        self.url = url
        self._file = open_verified(storage, url, expected)
        try:
            # The file's real size bounds what a header may claim, so a hostile header (or a
            # manifest lying about the size) never makes us allocate more than the file holds.
            file_size = _open_size(self._file.raw, storage, url)
            if expected is not None and file_size != expected.size:
                check_expected(url, expected, file_size, "")
            head = _read_exact(self._file, 8, url)
            length = header_length(url, head.numpy().tobytes(), file_size)
            raw = _read_exact(self._file, length, url).numpy().tobytes()
            self.header: SafetensorsHeader = parse_header(url, raw, file_size)
        except BaseException:
            self._file.close()
            raise

    def tensors(self) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """Each tensor with its header entry, in data order (CPU tensors); then the check."""
        f, url = self._file, self.url
        position = 0
        for info in sorted(self.header.tensors, key=lambda i: i.data_offsets[0]):
            start, end = info.data_offsets
            dtype = tensor_dtype(url, info)
            if start > position:
                _read_exact(f, start - position, url)
            if end == start:
                yield info, torch.empty(info.shape, dtype=dtype)
            else:
                yield info, _read_exact(f, end - start, url).view(dtype).reshape(info.shape)
            position = end
        f.verify()

    def pieces(
        self, size: int, buffer: Callable[[int], torch.Tensor]
    ) -> Iterator[tuple[TensorInfo, torch.dtype, int, torch.Tensor]]:
        """Each tensor's bytes in data order, in pieces of at most ``size`` bytes; then the
        check, as :meth:`tensors`.

        Yields ``(info, dtype, offset, piece)``: ``piece`` is the uint8 tensor
        ``buffer(nbytes)`` returned (contiguous, of ``nbytes``), holding the tensor's bytes
        from ``offset``. A caller reusing the memory (once done with a piece) reads the file
        without faulting in fresh pages for every tensor. An empty tensor is one empty piece.
        ``size`` a multiple of 8 keeps every piece a whole number of elements.
        """
        f, url = self._file, self.url
        position = 0
        for info in sorted(self.header.tensors, key=lambda i: i.data_offsets[0]):
            start, end = info.data_offsets
            dtype = tensor_dtype(url, info)
            if start > position:
                _read_exact(f, start - position, url)
            if end == start:
                yield info, dtype, 0, torch.empty(0, dtype=torch.uint8)
            for offset in range(0, end - start, size):
                n = min(size, end - start - offset)
                yield info, dtype, offset, _read_exact(f, n, url, buffer(n))
            position = end
        f.verify()

    def close(self) -> None:
        """Close the file (nothing is checked)."""
        self._file.close()

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_safetensors(
    storage: Storage,
    url: str,
    expected: Any = None,
    zero_copy: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read every tensor of ``url`` in one sequential pass (a :class:`SafetensorsStream`).

    Args:
        storage: its storage.
        url: the file.
        expected: a manifest entry (``size``, ``checksum``) to verify against, or ``None``.
        zero_copy: on a local disk, return tensors that view a private memory map of the file
            instead of fresh memory (one copy less). Only for tensors that are copied right
            away (e.g. into a model's parameters): they must not outlive a rewrite of the file.

    Returns:
        ``(tensors, metadata)``; tensors are on the CPU.

    Raises:
        CorruptCheckpointError: naming the file, for a bad header, truncation, or a size or
            checksum that disagrees with ``expected``.
    """
    if zero_copy and storage.local_path(url) is not None:
        f = open_verified(storage, url, expected)
        with f.raw:  # verified on the map, not by a second read
            return _read_mapped(f.raw.fileno(), url, expected)
    with SafetensorsStream(storage, url, expected) as stream:
        tensors = {info.name: tensor for info, tensor in stream.tensors()}
    return tensors, stream.header.metadata


def _check_mapped(view: memoryview, size: int, url: str, expected: Any) -> SafetensorsHeader:
    length = header_length(url, bytes(view[:8]), size)
    header = parse_header(url, bytes(view[8 : 8 + length]), size)
    if expected is not None:
        algorithm, _ = parse_checksum(expected.checksum)
        hasher = new_hasher(algorithm)
        for start in range(0, size, _CHUNK):
            hasher.update(view[start : start + _CHUNK])
        check_expected(url, expected, size, format_checksum(algorithm, hasher.hexdigest()))
    return header


def _read_mapped(
    fd: int, url: str, expected: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    size = os.fstat(fd).st_size
    if size < 8:
        raise _corrupt(url, "shorter than a safetensors header")
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mapped)
    try:
        header = _check_mapped(view, size, url, expected)
        dtypes = {info.name: tensor_dtype(url, info) for info in header.tensors}
    except BaseException:
        view.release()
        mapped.close()
        raise
    view.release()
    base = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map alive; no copy
    tensors: dict[str, torch.Tensor] = {}
    for info in header.tensors:
        dtype = dtypes[info.name]
        start, end = (header.data_start + o for o in info.data_offsets)
        raw = base[start:end]
        if start % dtype.itemsize:
            raw = raw.clone()  # misaligned (another writer's layout): copy this one
        tensors[info.name] = raw.view(dtype).reshape(info.shape)
    return tensors, header.metadata
