"""DCP's ``.metadata`` (the index of a sharded checkpoint), read from untrusted bytes.

``torch.distributed.checkpoint`` stores its index as a pickle. A pickle names the callables
that rebuild it, so a crafted one can run anything its unpickler lets it import. Here:

- :class:`MetadataUnpickler` resolves only an exact allow-list of ``(module, name)`` pairs
  (:data:`ALLOWED`): DCP's metadata dataclasses and enum, ``torch.Size``, torch dtypes by
  name, ``torch.serialization._get_layout``, ``pathlib.PosixPath``/``PurePosixPath`` and
  ``collections.OrderedDict``. A name is looked up as one attribute of its module, which it
  imports itself; dotted names (which protocol 4 would resolve through a module's own imports,
  ``torch.distributed.checkpoint.metadata`` -> ``os.system``) and everything else are refused.
  None of the allowed callables does more than build a value from its arguments.
- :func:`parse_metadata` then checks the result field by field: types, non-negative sizes and
  offsets, and every ``_StorageInfo.relative_path`` a plain relative path (no ``..``, no
  absolute path) so DCP's reader cannot be sent outside the checkpoint.

Any failure is a :class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming the file
and the field.

Also here, because ``accelkit ckpt inspect`` needs them without importing the rest of
torch.distributed: :func:`has_sharded_state`, :func:`read_sharded_metadata` and
:func:`sharded_tensor_infos`.

Public API: :data:`ALLOWED`, :data:`SHARDED_DIRNAME`, :data:`DCP_METADATA_NAME`,
:class:`MetadataUnpickler`, :func:`parse_metadata`, :func:`read_sharded_metadata`,
:func:`has_sharded_state`, :func:`sharded_tensor_infos`.
"""

from __future__ import annotations

import importlib
import io
import pickle
import pickletools
from typing import Any

from typing_extensions import override

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.layout import check_relative_path
from accelkit.checkpointing.formats.safetensors_header import TensorInfo
from accelkit.checkpointing.storage import Storage, join

__all__ = [
    "ALLOWED",
    "DCP_METADATA_NAME",
    "SHARDED_DIRNAME",
    "MetadataUnpickler",
    "has_sharded_state",
    "parse_metadata",
    "read_sharded_metadata",
    "sharded_tensor_infos",
]

SHARDED_DIRNAME = "sharded"
DCP_METADATA_NAME = ".metadata"

_DCP_META = "torch.distributed.checkpoint.metadata"
_DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "double",
    "float",
    "half",
    "long",
    "int",
    "short",
    "cfloat",
    "cdouble",
]

ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_META, "Metadata"),
        (_DCP_META, "TensorStorageMetadata"),
        (_DCP_META, "BytesStorageMetadata"),
        (_DCP_META, "ChunkStorageMetadata"),
        (_DCP_META, "TensorProperties"),
        (_DCP_META, "MetadataIndex"),
        (_DCP_META, "StorageMeta"),
        (_DCP_META, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        *(("torch", name) for name in _DTYPE_NAMES),
    }
)
"""Every ``(module, name)`` a DCP ``.metadata`` pickle may refer to."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else; see the module docstring."""

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(
                f"global {module}.{name} is not allowed in a DCP .metadata file (only DCP's "
                "metadata classes are); refusing to load it: a checkpoint must not be able to "
                "run code"
            )
        value = getattr(importlib.import_module(module), name, None)
        if value is None:
            raise pickle.UnpicklingError(f"{module}.{name} does not exist in this torch")
        return value

    @override
    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in a DCP .metadata file")


def _check(ok: bool, url: str, field: str, value: Any) -> None:
    if not ok:
        raise CorruptCheckpointError(
            f"{url}: field {field} has the unexpected value {value!r:.100}; this is not DCP "
            "metadata accelkit can trust (damaged or crafted). Load another checkpoint."
        )


def _ints(value: Any, nonnegative: bool = True) -> bool:
    return isinstance(value, (tuple, list)) and all(
        type(v) is int and (v >= 0 or not nonnegative) for v in value
    )


def _validate(metadata: Any, url: str) -> None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    _check(isinstance(metadata, Metadata), url, "(top level)", type(metadata).__name__)
    items: Any = getattr(metadata, "state_dict_metadata", None)
    _check(isinstance(items, dict), url, "state_dict_metadata", type(items).__name__)
    for key, item in items.items():
        where = f"state_dict_metadata[{key!r:.60}]"
        _check(isinstance(key, str), url, where, key)
        if isinstance(item, BytesStorageMetadata):
            continue
        _check(isinstance(item, TensorStorageMetadata), url, where, type(item).__name__)
        props = getattr(item, "properties", None)
        _check(isinstance(props, TensorProperties), url, f"{where}.properties", props)
        dtype = getattr(props, "dtype", None)
        _check(isinstance(dtype, torch.dtype), url, f"{where}.properties.dtype", dtype)
        size: Any = getattr(item, "size", None)
        _check(isinstance(size, torch.Size) and _ints(size), url, f"{where}.size", size)
        chunks: Any = getattr(item, "chunks", None)
        _check(isinstance(chunks, list), url, f"{where}.chunks", chunks)
        for i, chunk in enumerate(chunks):
            ok = (
                isinstance(chunk, ChunkStorageMetadata)
                and _ints(getattr(chunk, "offsets", None))
                and _ints(getattr(chunk, "sizes", None))
                and len(chunk.offsets) == len(chunk.sizes) == len(size)
            )
            _check(ok, url, f"{where}.chunks[{i}]", chunk)
    storage_data: Any = getattr(metadata, "storage_data", None)
    _check(isinstance(storage_data, dict), url, "storage_data", type(storage_data).__name__)
    for index, info in storage_data.items():
        where = f"storage_data[{getattr(index, 'fqn', index)!r:.60}]"
        _check(isinstance(index, MetadataIndex), url, where, index)
        _check(isinstance(index.fqn, str), url, f"{where}.fqn", index.fqn)
        _check(isinstance(info, _StorageInfo), url, where, info)
        path = getattr(info, "relative_path", None)
        try:
            check_relative_path(path, what=f"{where}.relative_path in {url}")
        except ValueError as exc:
            raise CorruptCheckpointError(
                f"{exc} Refusing to read outside the checkpoint."
            ) from None
        for name in ("offset", "length"):
            value = getattr(info, name, None)
            _check(type(value) is int and value >= 0, url, f"{where}.{name}", value)
        descriptors = getattr(info, "transform_descriptors", None)
        ok = descriptors is None or (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        )
        _check(ok, url, f"{where}.transform_descriptors", descriptors)


def parse_metadata(data: bytes, url: str) -> Any:
    """The DCP ``Metadata`` pickled in ``data`` (read from ``url``), checked.

    Raises:
        CorruptCheckpointError: for a refused global, a malformed pickle, or a field of the
            wrong type or range (naming ``url`` and the field).
    """
    try:
        # pickletools reads each counted argument (BINBYTES8 claiming a terabyte) with
        # BytesIO.read, which stops at the end of the data; the C unpickler would allocate
        # the claimed size first. So a length that overruns the file fails here, cheaply.
        for _ in pickletools.genops(data):
            pass
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any malformed pickle: the opcodes' errors are not one type
        raise CorruptCheckpointError(
            f"{url} is not a valid DCP metadata file: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    _validate(metadata, url)
    return metadata


def read_sharded_metadata(storage: Storage, sharded_dir: str) -> Any:
    """DCP's ``Metadata`` of ``<sharded_dir>/.metadata``, read with :func:`parse_metadata`.

    Raises:
        CorruptCheckpointError: if it is missing or not trustworthy DCP metadata.
    """
    url = join(sharded_dir, DCP_METADATA_NAME)
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{url} is missing: the sharded state in {sharded_dir} is incomplete (the main "
            "process writes it last). Load an earlier checkpoint."
        ) from None
    except PermissionError as exc:  # a local symbolic link: never followed
        raise CorruptCheckpointError(str(exc)) from None
    return parse_metadata(data, url)


def has_sharded_state(storage: Storage, folder: str) -> bool:
    """Whether checkpoint ``folder`` holds sharded (DCP) state."""
    return storage.isdir(join(folder, SHARDED_DIRNAME))


def sharded_tensor_infos(storage: Storage, folder: str) -> list[TensorInfo]:
    """The sharded state's tensors as ``accelkit ckpt inspect`` rows (file ``sharded/``).

    Dtypes use the safetensors codes (``F32``, ``BF16``...) like the rest of ``inspect``;
    ``data_offsets`` is ``(0, full tensor bytes)``: the tensor is spread over the shard files.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from accelkit.checkpointing.formats.safetensors_io import dtype_code

    metadata = read_sharded_metadata(storage, join(folder, SHARDED_DIRNAME))
    out = []
    for name, item in sorted(metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            shape = tuple(item.size)
            count = 1
            for d in shape:
                count *= d
            code = dtype_code(dtype)
            out.append(
                TensorInfo(name, code, shape, f"{SHARDED_DIRNAME}/", (0, count * dtype.itemsize))
            )
    return out
