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

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.jsonio import load_json
from accelkit.checkpointing.layout import MANIFEST_NAME, check_relative_path
from accelkit.checkpointing.manifest import read_manifest
from accelkit.checkpointing.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorInfo,
    read_header,
)
from accelkit.checkpointing.storage import Storage, join

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorInfo",
    "read_safetensors_header",
    "safetensors_files",
]

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


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
        The parsed header (see :func:`~accelkit.checkpointing.safetensors_header.parse_header`
        for what is checked).

    Raises:
        CorruptCheckpointError: a truncated file, an absurd header length, bad JSON or an
            entry that does not describe a tensor; the message names the file and the field.
        FileNotFoundError: if there is no file at ``url``.
        PermissionError: if it is a local symbolic link (never followed).
    """
    with storage.open_read(url) as f:  # first, so a local symlink is refused before a stat
        return read_header(f, url, storage.size(url), file, max_header_bytes)


def _index_files(storage: Storage, index_url: str) -> list[str]:
    index = load_json(storage.read_bytes(index_url), index_url)
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
