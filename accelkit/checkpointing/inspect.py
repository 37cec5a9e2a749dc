"""Look inside safetensors files without loading a tensor: names, dtypes, shapes, offsets.

A safetensors file starts with an 8-byte little-endian header length ``N``, then ``N`` bytes of
JSON (``{"<tensor>": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the tensor data. Only those first ``8 + N`` bytes are read here, through
:mod:`~accelkit.checkpointing.storage`, so this works the same on a local disk, S3 or memory.

Public API:

- :class:`TensorInfo` -- ``name``, ``dtype``, ``shape``, ``file``, ``data_offsets``,
  ``numel``, ``nbytes``.
- :class:`SafetensorsHeader` -- one file's tensors and ``__metadata__``.
- :func:`read_safetensors_header(storage, url) <read_safetensors_header>` -- parse and check
  one file's header (refuses a header larger than :data:`MAX_HEADER_BYTES` or than the file).
- :func:`safetensors_files(storage, path) <safetensors_files>` -- the safetensors files of a
  checkpoint (from its manifest), a ``save_model`` folder, an index JSON or a single file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.layout import MANIFEST_NAME, check_relative_path
from accelkit.checkpointing.manifest import read_manifest
from accelkit.checkpointing.storage import Storage, join

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
    "safetensors_files",
]

# The safetensors library itself refuses headers above 100 MB; a bigger length prefix means a
# damaged or hostile file, and reading it would allocate that much memory.
MAX_HEADER_BYTES = 100_000_000
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"

# Bits per element of the dtypes the safetensors format defines.
_DTYPE_BITS = {
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


def _corrupt(url: str, detail: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: {detail}. The file is not a valid safetensors file (truncated or damaged); "
        "save it again, or check the checkpoint with `accelkit ckpt verify`."
    )


def _parse_entry(url: str, file: str, name: str, raw: Any, data_size: int) -> TensorInfo:
    if not isinstance(raw, dict):
        raise _corrupt(url, f"header entry {name!r} is not an object")
    dtype = raw.get("dtype")
    shape = raw.get("shape")
    offsets = raw.get("data_offsets")
    if not isinstance(dtype, str):
        raise _corrupt(url, f"tensor {name!r} has no string 'dtype'")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _corrupt(url, f"tensor {name!r} has shape {shape!r}, expected a list of ints >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise _corrupt(
            url,
            f"tensor {name!r} has data_offsets {offsets!r}, expected [begin, end] within the "
            f"{data_size} data bytes",
        )
    info = TensorInfo(name, dtype, tuple(shape), file, (offsets[0], offsets[1]))
    bits = _DTYPE_BITS.get(dtype)
    if bits is not None and info.nbytes != (info.numel * bits + 7) // 8:
        raise _corrupt(
            url,
            f"tensor {name!r} ({dtype}, shape {list(shape)}) needs "
            f"{(info.numel * bits + 7) // 8} bytes but its offsets span {info.nbytes}",
        )
    return info


def read_safetensors_header(
    storage: Storage, url: str, file: str | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Read and check the header of the safetensors file at ``url``; no tensor is loaded.

    Args:
        storage: the storage of ``url``.
        url: the file.
        file: how to name it in the result (defaults to its base name).
        max_header_bytes: refuse a header longer than this.

    Returns:
        The parsed header.

    Raises:
        CorruptCheckpointError: a truncated file, an absurd header length, bad JSON or an
            entry that does not describe a tensor; the message names the file.
        FileNotFoundError: if there is no file at ``url``.
        PermissionError: if it is a local symbolic link (never followed).
    """
    file = file or url.rstrip("/").rsplit("/", 1)[-1]
    with storage.open_read(url) as f:  # first, so a local symlink is refused before a stat
        file_size = storage.size(url)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(url, f"only {len(prefix)} bytes long, shorter than the 8-byte prefix")
        (length,) = struct.unpack("<Q", prefix)
        if length > max_header_bytes or length > file_size - 8:
            raise _corrupt(
                url,
                f"header length prefix says {length} bytes, but the file has {file_size - 8} "
                f"bytes after the prefix (limit {max_header_bytes})",
            )
        raw = f.read(length)
    if len(raw) != length:
        raise _corrupt(url, f"header cut short: {len(raw)} of {length} bytes")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _corrupt(url, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(url, "header is not a JSON object")
    metadata_raw = header.pop("__metadata__", None) or {}
    if not isinstance(metadata_raw, dict):
        raise _corrupt(url, "'__metadata__' is not an object")
    data_size = file_size - 8 - length
    tensors = [_parse_entry(url, file, name, raw, data_size) for name, raw in header.items()]
    tensors.sort(key=lambda t: (t.data_offsets, t.name))
    end = 0
    for tensor in tensors:
        if tensor.data_offsets[0] < end:
            raise _corrupt(url, f"tensor {tensor.name!r} overlaps another tensor")
        end = max(end, tensor.data_offsets[1])
    metadata = {str(k): str(v) for k, v in metadata_raw.items()}
    return SafetensorsHeader(file, url, file_size, length, tensors, metadata)


def _index_files(storage: Storage, index_url: str) -> list[str]:
    try:
        index = json.loads(storage.read_bytes(index_url))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{index_url}: not valid JSON ({exc}). Save the model again to rewrite the index."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(
            f"{index_url}: no 'weight_map' object; expected a Hugging Face safetensors index. "
            "Save the model again to rewrite it."
        )
    names = set()
    for value in weight_map.values():
        try:
            names.add(check_relative_path(value, what=f"file name in {index_url}"))
        except ValueError as exc:
            raise CorruptCheckpointError(str(exc)) from None
    return sorted(names)


def safetensors_files(storage: Storage, path: str) -> list[tuple[str, str]]:
    """The safetensors files to inspect at ``path``, as ``(name, url)`` pairs.

    - a ``.safetensors`` file: that file (named by its base name);
    - a ``*.safetensors.index.json``: the shards its ``weight_map`` names, beside it;
    - a checkpoint folder with a manifest: the ``.safetensors`` files the manifest lists;
    - any other folder (a ``save_model`` output): every ``.safetensors`` file under it.

    Names are relative to the folder; only files inside it are ever returned.

    Raises:
        FileNotFoundError: if nothing exists at ``path``.
        CorruptCheckpointError: for an unreadable manifest or index.
    """
    path = path.rstrip("/") or path
    if storage.isfile(path):
        name = path.rsplit("/", 1)[-1]
        if not path.endswith(INDEX_SUFFIX):
            return [(name, path)]
        folder = path[: len(path) - len(name)]
        return [(n, folder + n) for n in _index_files(storage, path)]
    if not storage.isdir(path):
        raise FileNotFoundError(path)
    names: list[str] | None = None
    if storage.exists(join(path, MANIFEST_NAME)):
        try:
            manifest = read_manifest(storage, path)
        except ValueError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        if manifest is not None:
            names = [e.path for e in manifest.files]
    if names is None:
        names = list(storage.walk_files(path))
    return [(n, join(path, n)) for n in sorted(names) if n.endswith(SAFETENSORS_SUFFIX)]
