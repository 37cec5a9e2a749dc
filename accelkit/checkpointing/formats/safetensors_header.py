"""The one parser of safetensors headers (no torch import, so the CLI stays quick).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"<tensor>": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor data. Every reader of the format in accelkit (loading a model or a state,
``accelkit ckpt inspect``) goes through :func:`parse_header`, so a hostile header is judged the
same way everywhere: refused with a :class:`~accelkit.checkpointing.errors.
CorruptCheckpointError` naming the file and the field, before anything is allocated for it.

Checks: the length prefix fits the file and :data:`MAX_HEADER_BYTES`; the JSON is an object
nested no deeper than a tensor entry needs; each entry has a known ``dtype``, a ``shape`` of
integers whose product fits a signed 64-bit count (zero-sized dimensions included: torch refuses
``[2**63, 0]``), and ``data_offsets`` inside the data section spanning exactly the bytes its
dtype and shape need; no two tensors overlap; ``__metadata__`` maps strings to strings.

Public API: :data:`MAX_HEADER_BYTES`, :data:`DTYPE_BITS`, :class:`TensorInfo`,
:class:`SafetensorsHeader`, :func:`header_length` (the one reading and bound of the length
prefix), :func:`parse_header`, :func:`read_header`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from accelkit.checkpointing.errors import CorruptCheckpointError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "header_length",
    "parse_header",
    "read_header",
]

# The safetensors library itself refuses headers above 100 MB; a bigger length prefix means a
# damaged or hostile file, and reading it would allocate that much memory.
MAX_HEADER_BYTES = 100_000_000
_MAX_COUNT = 2**63 - 1

# Bits per element of the dtypes the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header.

    Attributes:
        name: the tensor's key.
        dtype: the safetensors dtype (``F32``, ``BF16``, ``I64``...).
        shape: its shape.
        file: the file it is stored in (relative to the inspected folder, or the file's name).
        data_offsets: ``(begin, end)`` byte offsets in the file's data section.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    data_offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor's data takes in the file."""
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header of one safetensors file.

    Attributes:
        file: the file's name (relative to the inspected folder).
        url: its full path or URL.
        file_size: its size in bytes.
        header_size: length of the JSON header in bytes.
        tensors: its tensors, in data order.
        metadata: the ``__metadata__`` string map (empty if absent).
    """

    file: str
    url: str
    file_size: int
    header_size: int
    tensors: list[TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        """Offset in the file of the data section (where ``data_offsets`` count from)."""
        return 8 + self.header_size


def _corrupt(url: str, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: {detail}. The file is not a valid safetensors file (truncated, damaged or "
        "crafted): load another checkpoint, or check it with `accelkit ckpt verify`."
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_fits(shape: list[int]) -> bool:
    count = 1
    for d in shape:
        count *= max(d, 1)
        if count > _MAX_COUNT:
            return False
    return True


def _entry(url: str, file: str, name: str, raw: Any, data_size: int) -> TensorInfo:
    if not isinstance(raw, dict):
        raise _corrupt(url, f"header entry {name!r} is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _corrupt(url, f"tensor {name!r}: field 'dtype' is {dtype!r}, not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_COUNT for d in shape):
        raise _corrupt(
            url,
            f"tensor {name!r}: field 'shape' is {shape!r:.80}, expected a list of ints from 0 "
            "to 2**63 - 1",
        )
    if not _count_fits(shape):
        raise _corrupt(
            url,
            f"tensor {name!r}: field 'shape' {shape!r:.80} has more than 2**63 - 1 elements "
            "(counting zero-sized dimensions as 1)",
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _corrupt(
            url, f"tensor {name!r}: field 'data_offsets' is {offsets!r:.80}, expected [begin, end]"
        )
    if offsets[1] > data_size:
        raise _corrupt(
            url,
            f"tensor {name!r} ends past the end of the file (field 'data_offsets' is "
            f"{offsets!r:.80}, but the file has {data_size} data bytes)",
        )
    info = TensorInfo(name, dtype, tuple(shape), file, (offsets[0], offsets[1]))
    needed = (info.numel * DTYPE_BITS[dtype] + 7) // 8
    if info.nbytes != needed:
        raise _corrupt(
            url,
            f"tensor {name!r} ({dtype}, shape {list(shape)}) needs {needed} bytes but its "
            f"'data_offsets' span {info.nbytes}",
        )
    return info


def parse_header(
    url: str, raw: bytes, file_size: int, file: str | None = None
) -> SafetensorsHeader:
    """Parse and check the JSON header ``raw`` of a safetensors file of ``file_size`` bytes.

    Args:
        url: the file, for messages.
        raw: the header's bytes (after the 8-byte length prefix).
        file_size: the whole file's size; tensors must lie inside it.
        file: how to name the file in :class:`TensorInfo` (defaults to its base name).

    Raises:
        CorruptCheckpointError: naming ``url`` and the bad field.
    """
    file = file or url.rstrip("/").rsplit("/", 1)[-1]
    data_size = file_size - 8 - len(raw)
    if data_size < 0:
        raise _corrupt(url, f"the header ({len(raw)} bytes) is longer than the file")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _corrupt(url, f"the header is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise _corrupt(url, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(url, "field '__metadata__' is not a map of strings to strings")
    tensors = [_entry(url, file, str(name), item, data_size) for name, item in header.items()]
    tensors.sort(key=lambda t: (t.data_offsets, t.name))
    end = 0
    for tensor in tensors:
        if tensor.data_offsets[0] < end:
            raise _corrupt(url, f"tensor {tensor.name!r} overlaps another tensor")
        end = max(end, tensor.data_offsets[1])
    return SafetensorsHeader(file, url, file_size, len(raw), tensors, dict(metadata))


def header_length(
    url: str, prefix: bytes, file_size: int, max_header_bytes: int = MAX_HEADER_BYTES
) -> int:
    """The header length ``N`` that a file's first 8 bytes announce, once it is known to fit.

    The one reading of the little-endian length prefix in accelkit: every reader (a stream, a
    memory map, ``accelkit ckpt inspect``) calls it before it reads or allocates the header, so
    a hostile prefix is refused the same way everywhere.

    Args:
        url: the file, for the message.
        prefix: the file's first bytes (at least 8; only the first 8 are read).
        file_size: the file's real size, which bounds what the prefix may claim.
        max_header_bytes: the largest header accepted (:data:`MAX_HEADER_BYTES`).

    Returns:
        ``N``, at most ``max_header_bytes`` and at most ``file_size - 8``.

    Raises:
        CorruptCheckpointError: a file shorter than the prefix, or a length past either bound,
            naming ``url``.
    """
    if len(prefix) < 8:
        raise _corrupt(url, f"only {len(prefix)} bytes long, shorter than the 8-byte prefix")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > max_header_bytes or length > file_size - 8:
        raise _corrupt(
            url,
            f"the header length prefix says {length} bytes, but the file has {file_size - 8} "
            f"bytes after the prefix (limit {max_header_bytes})",
        )
    return int(length)


def read_header(
    stream: BinaryIO,
    url: str,
    file_size: int,
    file: str | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> SafetensorsHeader:
    """Read the length prefix and header from ``stream`` (at offset 0) and parse them.

    Reads exactly ``8 + N`` bytes; ``N`` is refused before reading if it exceeds the file or
    ``max_header_bytes``.

    Raises:
        CorruptCheckpointError: naming ``url`` and what is wrong.
    """
    length = header_length(url, stream.read(8), file_size, max_header_bytes)
    raw = stream.read(length)
    if len(raw) != length:
        raise _corrupt(url, f"the header is cut short: {len(raw)} of {length} bytes")
    return parse_header(url, raw, file_size, file)
