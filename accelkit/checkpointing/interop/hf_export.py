"""A checkpoint's model weights, exported as Hugging Face's safetensors files.

:func:`export_hf` writes one model of a committed accelkit checkpoint as ``transformers``'
``save_pretrained`` lays out its weights: ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), each file with ``{"format": "pt"}`` metadata.

- **Streamed**: each file of the checkpoint is read once, in order, through the verified read
  (:class:`~accelkit.checkpointing.formats.safetensors_io.SafetensorsStream`: size and checksum
  against the manifest), one tensor at a time; each tensor is written (cast in 64 MB pieces)
  at its place in the output file, planned from the headers before any data is read. The
  memory an export needs is the largest tensor plus one piece, whatever the model's size.
- **Atomic**: the files are written into a hidden folder beside ``out``, synced, then renamed
  to ``out``; a failed export (a damaged file, a full disk, Ctrl-C) removes that folder, so
  ``out`` is either the whole export or absent. An existing non-empty ``out`` is refused
  unless ``force=True`` (then replaced only once the new export is complete).
- **Tied weights** (names that share one tensor, e.g. ``lm_head.weight`` and the input
  embedding): accelkit stores them once with an alias; the export writes every name as its
  own copy. ``from_pretrained`` accepts that (it re-ties the weights of a tied model), and a
  plain ``load_state_dict(strict=True)`` finds every key. ``save_pretrained`` instead drops
  the names its model class lists in ``_tied_weights_keys``, which needs the class.
- ``dtype`` casts floating-point tensors only (integer buffers such as ``position_ids`` keep
  theirs), as ``transformers``' ``torch_dtype`` does.

**FSDP2 checkpoints** (the model stored as sharded state in ``sharded/``, written by
``torch.distributed.checkpoint``) are exported the same way, with no running job and no
process group: DCP's ``.metadata`` is read with its allow-list
(:mod:`~accelkit.checkpointing.formats.dcp_metadata`), each tensor planned from it (its chunks,
the files and byte ranges holding them, checked to tile the tensor:
:mod:`~accelkit.checkpointing.formats.dcp_chunks`), then each ``.distcp`` file is read once,
in order, checked against its manifest checksum, and each chunk, loaded alone from exactly its
byte range (zip and pickle checked as data, then ``torch.load(weights_only=True)``), is cast
and written at its place in the output tensors. The memory this needs is one chunk twice (its
bytes and the tensor) plus a cast piece and the reads' buffers, never the model: 92 MiB
measured for a 192 MiB model of 32 MiB weights saved by 2 processes (16 MiB chunks).

Public API: :func:`export_hf` -> :class:`ExportResult`, :data:`EXPORT_DTYPES`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from accelkit.checkpointing.catalog.inspect import read_safetensors_header
from accelkit.checkpointing.catalog.listing import ACCELERATE, latest_checkpoint
from accelkit.checkpointing.errors import CheckpointPathError, CorruptCheckpointError
from accelkit.checkpointing.formats.dcp_chunks import (
    ChunkRead,
    TensorPlan,
    chunk_runs,
    load_chunk,
    plan_tensors,
)
from accelkit.checkpointing.formats.dcp_metadata import (
    DCP_METADATA_NAME,
    SHARDED_DIRNAME,
    has_sharded_state,
    parse_metadata,
)
from accelkit.checkpointing.formats.layout import (
    CHECKPOINTS_DIRNAME,
    KINDS,
    MANIFEST_NAME,
    TENSORS_SUFFIX,
    index_name,
    shard_names,
)
from accelkit.checkpointing.formats.manifest import FileEntry
from accelkit.checkpointing.formats.model_io import (
    ALIASES_KEY,
    check_weight_map,
    parse_aliases,
    plan_shards,
    read_index,
)
from accelkit.checkpointing.formats.safetensors_header import SafetensorsHeader
from accelkit.checkpointing.formats.safetensors_io import (
    SafetensorsStream,
    parse_size,
    safetensors_layout,
    tensor_dtype,
)
from accelkit.checkpointing.restore.loading import check_loadable
from accelkit.checkpointing.storage import Storage, get_storage, join, protocol_of
from accelkit.checkpointing.storage.base import StorageExistsError
from accelkit.checkpointing.storage.confined import confine
from accelkit.checkpointing.storage.verified import (
    VerifiedReader,
    open_verified,
    read_verified_bytes,
)
from accelkit.errors import ConfigurationError

__all__ = ["EXPORT_DTYPES", "ExportResult", "export_hf"]

EXPORT_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""The ``dtype`` names :func:`export_hf` accepts."""

_PIECE = 64 * 1024 * 1024  # bytes of source data cast and written at a time
_HF_METADATA = {"format": "pt"}  # from_pretrained refuses a file without it


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote.

    Attributes:
        source: the checkpoint folder read (the newest committed one when a project or a
            checkpoints folder was given).
        out: the folder written.
        model: which model of the checkpoint (0 for the first prepared).
        files: the files written, in ``out``.
        tensors: how many tensors (names) were written.
        total_size: bytes of tensor data (``metadata.total_size`` of the index).
        read_bytes: bytes of the checkpoint read (and verified).
        tied: alias -> stored name, for the names written as copies of another.
    """

    source: str
    out: str
    model: int
    files: list[str]
    tensors: int
    total_size: int
    read_bytes: int
    tied: dict[str, str] = field(default_factory=dict)


@dataclass
class _Target:
    """One output file: its header and where each of its tensors starts."""

    path: str
    prefix: bytes
    starts: dict[str, int]
    size: int
    fd: int = -1
    left: int = 0  # tensors not yet written; closed at 0


def _local_out(out: str) -> str:
    if protocol_of(out) not in ("file", "local"):
        raise ConfigurationError(
            f"OUT {out!r} is not a local folder: an export is written to a local disk and "
            "renamed into place. Export to a local folder, then upload it."
        )
    path = out.split("://", 1)[1] if "://" in out else out
    return os.path.abspath(path)


def _check_out(out: str, force: bool) -> None:
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise StorageExistsError(
            f"OUT {out!r} exists and is not a folder. Choose another OUT, or remove it."
        )
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise StorageExistsError(
            f"OUT {out!r} exists and is not empty. Choose another folder, or pass --force "
            "(force=True) to replace it once the export is complete."
        )


def _check_apart(source: str | None, out: str) -> None:
    """Refuse an ``out`` that is, holds or sits inside the checkpoint being exported: replacing
    it (``force``) would delete the checkpoint, or its project, with it."""
    if source is None:
        return
    src, dst = os.path.realpath(source), os.path.realpath(out)
    if src == dst or src.startswith(dst + os.sep) or dst.startswith(src + os.sep):
        raise StorageExistsError(
            f"OUT {out!r} overlaps the checkpoint being exported ({source}): writing or "
            "replacing it there could delete the checkpoint. Choose a folder outside it."
        )


def _resolve(storage: Storage, path: str) -> str:
    """``path``, or the newest committed checkpoint of a project / checkpoints folder."""
    path = path.rstrip("/") or path
    if storage.isdir(path) and not storage.exists(join(path, MANIFEST_NAME)):
        root = join(path, CHECKPOINTS_DIRNAME)
        newest = latest_checkpoint(storage, root if storage.isdir(root) else path)
        if newest is not None:
            return newest.path
    return path


def _model_indexes(names: list[str]) -> list[int]:
    regex = KINDS["model"].regex()
    found = set()
    for name in names:
        match = regex.match(name)
        if match:
            found.add(int(match.group(1) or 0))
    return sorted(found)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in EXPORT_DTYPES.values():
            raise ConfigurationError(f"dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}.")
        return dtype
    if dtype not in EXPORT_DTYPES:
        raise ConfigurationError(
            f"dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}; pass one of them, or "
            "none to keep the stored dtypes."
        )
    return EXPORT_DTYPES[dtype]


def _out_dtype(stored: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and stored.is_floating_point else stored


def export_hf(
    checkpoint: str,
    out: str,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    model: int = 0,
    force: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write model ``model`` of ``checkpoint`` into ``out`` as Hugging Face safetensors files.

    See the module docstring for the layout, the memory bound, atomicity and tied weights.
    ``out`` gets the weights only: copy the model's ``config.json`` (and tokenizer files) in
    for ``from_pretrained``.

    Args:
        checkpoint: a committed checkpoint folder (local path or fsspec URL); a project or
            checkpoints folder stands for its newest committed checkpoint.
        out: the local folder to create (absent or empty, unless ``force``).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` to cast floating-point tensors
            to; ``None`` keeps the stored dtypes (a bit-for-bit copy of the values).
        max_shard_size: the largest output file, as bytes or ``"5GB"``, ``"500MB"``, ``"2GiB"``
            (a larger tensor gets a file of its own).
        model: which model of the checkpoint, in the order they were prepared.
        force: replace a non-empty ``out`` (only once the new export is complete).
        storage_options: fsspec options for a ``checkpoint`` URL.

    Returns:
        An :class:`ExportResult`.

    Raises:
        CheckpointError: ``checkpoint`` is not a committed checkpoint (missing, incomplete,
            written by Hugging Face accelerate), with the fix; :class:`CorruptCheckpointError`
            for a damaged file, or sharded state whose index, byte ranges or chunks do not
            hold together (nothing is left in ``out``).
        FileExistsError: ``out`` exists and is not empty (and ``force`` is not set) or is a
            file.
        ValueError: a bad ``dtype``, ``max_shard_size`` or ``model``, or a remote ``out``.
    """
    target_dtype = _dtype(dtype)
    limit = parse_size(max_shard_size)
    out_path = _local_out(out)
    _check_out(out_path, force)
    storage = get_storage(checkpoint, storage_options)
    source = _resolve(storage, checkpoint)
    info = check_loadable(storage, source)
    if info.state == ACCELERATE:
        raise CheckpointPathError(
            f"{source} was written by Hugging Face accelerate's save_state, not accelkit: its "
            "weights are already Hugging Face files (model.safetensors or pytorch_model.bin). "
            "Copy them, or run `accelkit ckpt import` first and export the imported checkpoint."
        )
    assert info.manifest is not None, "a committed checkpoint has a manifest"
    _check_apart(storage.local_path(source), out_path)
    storage = confine(storage, source)  # no link inside the checkpoint is followed
    entries = info.manifest.file_map()
    indexes = _model_indexes(list(entries))
    stem = KINDS["model"].name(model)
    metas: dict[str, torch.Tensor] = {}
    sharded: list[TensorPlan] | None = None
    if model in indexes:
        names, aliases, headers = _read_plan(storage, source, stem, entries)
        stored = {t.name: (t, h.url) for h in headers for t in h.tensors}
        for name in names:
            t, url = stored[name]
            metas[name] = torch.empty(
                t.shape, dtype=_out_dtype(tensor_dtype(url, t), target_dtype), device="meta"
            )
    else:
        found, more = (
            _sharded_plan(storage, source, stem, entries)
            if has_sharded_state(storage, source)
            else (None, [])
        )
        if found is None:
            have = ", ".join(str(i) for i in sorted({*indexes, *more})) or "none"
            raise ConfigurationError(
                f"model {model} is not in {source}: it holds model(s) {have}. Pass --model with "
                "one of them."
            )
        sharded, names, aliases, headers = found, [], {}, []
        for plan in sharded:
            name = plan.name[len(stem) + 1 :]
            names.append(name)
            metas[name] = torch.empty(
                plan.shape, dtype=_out_dtype(plan.dtype, target_dtype), device="meta"
            )
    for alias, name in aliases.items():
        metas[alias] = metas[name]
    shards = plan_shards(metas, limit)
    files = shard_names("model", len(shards))
    parent, base = os.path.split(out_path)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{base}.export-", dir=parent)
    targets: list[_Target] = []
    try:
        where: dict[str, list[tuple[_Target, str]]] = {}
        copies: dict[str, list[str]] = {name: [name] for name in names}
        for alias, name in aliases.items():
            copies[name].append(alias)
        for file_name, members in zip(files, shards):
            prefix, starts = safetensors_layout({n: metas[n] for n in members}, _HF_METADATA)
            size = max(
                (s + metas[n].numel() * metas[n].element_size() for n, s in starts.items()),
                default=len(prefix),
            )
            targets.append(_Target(os.path.join(work, file_name), prefix, starts, size))
        owner = {n: tgt for tgt in targets for n in tgt.starts}
        for name, outs in copies.items():
            where[name] = [(owner[o], o) for o in outs]
        for tgt in targets:
            tgt.fd = os.open(tgt.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            tgt.left = len(tgt.starts)
            _pwrite(tgt.fd, tgt.prefix, 0)
            os.ftruncate(tgt.fd, tgt.size)
            if not tgt.left:
                _close(tgt)
        if sharded is None:
            read_bytes = _stream(storage, headers, entries, where, metas)
        else:
            read_bytes = _stream_sharded(storage, source, sharded, entries, where, metas)
        if len(targets) > 1:
            total = sum(m.numel() * m.element_size() for m in metas.values())
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: f for f, members in zip(files, shards) for n in members},
            }
            data = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            _write_file(os.path.join(work, index_name("model")), data)
            files = [*files, index_name("model")]
        _fsync_dir(work)
        _publish(work, out_path)
    except BaseException:
        for tgt in targets:
            if tgt.fd >= 0:
                os.close(tgt.fd)
        shutil.rmtree(work, ignore_errors=True)
        raise
    return ExportResult(
        source=source,
        out=out_path,
        model=model,
        files=files,
        tensors=len(metas),
        total_size=sum(m.numel() * m.element_size() for m in metas.values()),
        read_bytes=read_bytes,
        tied=dict(aliases),
    )


def _read_plan(
    storage: Storage, folder: str, stem: str, entries: Mapping[str, FileEntry]
) -> tuple[list[str], dict[str, str], list[SafetensorsHeader]]:
    """``(stored names in read order, aliases, the headers of the files in read order)``,
    read from the headers alone (the data is read, and checked, by :func:`_stream`)."""
    index = index_name(stem)
    if index in entries:
        parsed = read_index(storage, folder, index, entries)
        files, aliases = parsed.files, parsed.aliases
    else:
        files, parsed, aliases = [stem + TENSORS_SUFFIX], None, {}
    headers = []
    names: list[str] = []
    for file_name in files:
        url = join(folder, file_name)
        if file_name not in entries:
            raise CorruptCheckpointError(
                f"{url} is named by the model's index but not listed in the manifest. The "
                "checkpoint is damaged or crafted: `accelkit ckpt verify` checks it."
            )
        try:
            header = read_safetensors_header(storage, url, file=file_name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{url} is missing. Restore it.") from None
        headers.append(header)
        for t in sorted(header.tensors, key=lambda t: t.data_offsets[0]):
            if t.name in names:
                raise CorruptCheckpointError(f"{url}: tensor {t.name!r} is stored twice.")
            names.append(t.name)
        if parsed is None:
            aliases = parse_aliases(header.metadata.get(ALIASES_KEY, "{}"), url)
    if parsed is not None:
        check_weight_map(parsed, names)
    for alias, name in aliases.items():
        if name not in names:
            raise CorruptCheckpointError(
                f"{folder}: alias {alias!r} points to {name!r}, which is not stored."
            )
        if alias in names:
            raise CorruptCheckpointError(f"{folder}: {alias!r} is both stored and an alias.")
    return names, aliases, headers


def _stream(
    storage: Storage,
    headers: list[SafetensorsHeader],
    entries: Mapping[str, FileEntry],
    where: Mapping[str, list[tuple[_Target, str]]],
    metas: Mapping[str, torch.Tensor],
) -> int:
    """Read each file once, verified, and write each tensor where it goes; the bytes read."""
    read = 0
    for header in headers:
        with SafetensorsStream(storage, header.url, entries[header.file]) as stream:
            if _described(stream.header) != _described(header):
                raise CorruptCheckpointError(
                    f"{header.url} changed while it was exported (its header differs from the "
                    "one first read). Export again once nothing writes to the checkpoint."
                )
            for info, tensor in stream.tensors():
                for tgt, name in where[info.name]:
                    _write_tensor(tgt, tgt.starts[name], tensor, metas[name].dtype)
                    tgt.left -= 1
                    if not tgt.left:
                        _close(tgt)
            read += header.file_size
    return read


def _sharded_plan(
    storage: Storage, source: str, stem: str, entries: Mapping[str, FileEntry]
) -> tuple[list[TensorPlan] | None, list[int]]:
    """``(the plan of model ``stem``'s tensors or None if it is not there, the indexes of the
    models the sharded state holds)``, from ``.metadata`` (checked against its manifest
    entry, then read with the allow-list) and the files' sizes alone."""
    url = join(source, SHARDED_DIRNAME)
    meta_url = join(url, DCP_METADATA_NAME)
    expected = entries.get(f"{SHARDED_DIRNAME}/{DCP_METADATA_NAME}")
    metadata = parse_metadata(read_verified_bytes(storage, meta_url, expected), meta_url)
    regex = KINDS["model"].regex(("",), shards=False)
    more = sorted(
        {
            int(m.group(1) or 0)
            for key in metadata.state_dict_metadata
            if (m := regex.match(key.split(".", 1)[0]))
        }
    )
    if not any(key.startswith(stem + ".") for key in metadata.state_dict_metadata):
        return None, more
    sizes = storage.walk_files(url)
    return plan_tensors(metadata, url, stem + ".", sizes), more


def _stream_sharded(
    storage: Storage,
    source: str,
    plans: list[TensorPlan],
    entries: Mapping[str, FileEntry],
    where: Mapping[str, list[tuple[_Target, str]]],
    metas: Mapping[str, torch.Tensor],
) -> int:
    """Read each ``.distcp`` file once, in order, verified against its manifest entry; load
    each chunk of a planned tensor from its byte range and write it where it goes in every
    output name of its tensor; the bytes read."""
    url = join(source, SHARDED_DIRNAME)
    by_file: dict[str, list[tuple[ChunkRead, TensorPlan, str]]] = {}
    left: dict[str, int] = {}
    for plan in plans:
        name = plan.name.split(".", 1)[1]
        left[name] = len(plan.chunks)
        for chunk in plan.chunks:
            by_file.setdefault(chunk.file, []).append((chunk, plan, name))
    for name, count in left.items():
        if not count:  # an empty tensor with no chunk: its place is already written
            _done(where[name])
    read = 0
    for file in sorted(by_file):
        file_url = join(url, file)
        with open_verified(storage, file_url, entries.get(f"{SHARDED_DIRNAME}/{file}")) as f:
            position = 0
            for chunk, plan, name in sorted(by_file[file], key=lambda item: item[0].start):
                _skip(f, chunk.start - position, file_url, plan.name)
                data = _read_range(f, chunk.length, file_url, plan.name)
                tensor = load_chunk(data, file_url, plan.name, chunk, plan.dtype)
                del data
                flat = tensor.reshape(-1)
                runs = list(chunk_runs(plan.shape, chunk.offsets, chunk.sizes))
                for tgt, out_name in where[name]:
                    meta = metas[out_name]
                    base = tgt.starts[out_name]
                    for out_first, first, count in runs:
                        piece = flat[first : first + count]
                        _write_tensor(
                            tgt, base + out_first * meta.element_size(), piece, meta.dtype
                        )
                del tensor, flat
                position = chunk.start + chunk.length
                left[name] -= 1
                if not left[name]:
                    _done(where[name])
        read += f.size
    return read


def _done(outs: list[tuple[_Target, str]]) -> None:
    for tgt, _ in outs:
        tgt.left -= 1
        if not tgt.left:
            _close(tgt)


def _skip(f: VerifiedReader, count: int, url: str, name: str) -> None:
    while count > 0:
        got = len(f.read(min(count, _PIECE)))
        if not got:
            raise _truncated(url, name)
        count -= got


def _read_range(f: VerifiedReader, count: int, url: str, name: str) -> bytes:
    """Exactly ``count`` bytes (hashed by ``f``). A ``bytes`` object, not a ``bytearray``:
    ``io.BytesIO`` shares it instead of copying it, so a chunk is in memory once as bytes."""
    data = f.read(count)
    if len(data) == count:
        return data
    parts = [data]
    got = len(data)
    while got < count:  # a short read (a remote file's pieces): joined once at the end
        part = f.read(count - got)
        if not part:
            raise _truncated(url, name)
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _truncated(url: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: tensor {name!r}: the file ends before the tensor's bytes: it is truncated. "
        "Nothing was exported; export an earlier checkpoint (`accelkit ckpt verify` checks them)."
    )


def _described(header: SafetensorsHeader) -> list[tuple[Any, ...]]:
    return [(t.name, t.dtype, t.shape, t.data_offsets) for t in header.tensors]


def _write_tensor(tgt: _Target, start: int, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    flat = tensor.reshape(-1)
    if not flat.numel():
        return
    step = max(1, _PIECE // flat.element_size())
    out_size = torch.empty((), dtype=dtype).element_size()
    for first in range(0, flat.numel(), step):
        piece = flat[first : first + step]
        if piece.dtype != dtype:
            piece = piece.to(dtype)
        _pwrite(tgt.fd, piece.contiguous().view(torch.uint8).numpy().data, start + first * out_size)


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count


def _close(tgt: _Target) -> None:
    os.fsync(tgt.fd)
    os.close(tgt.fd)
    tgt.fd = -1


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(work: str, out: str) -> None:
    """Rename the finished ``work`` folder to ``out``; a non-empty ``out`` (``force``) is
    moved aside first and removed only once the new one is in place."""
    parent = os.path.dirname(out)
    old = None
    if os.path.isdir(out) and os.listdir(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.replaced-", dir=parent)
        os.rename(out, os.path.join(old, "out"))
    elif os.path.isdir(out):
        os.rmdir(out)
    os.chmod(work, 0o755)  # mkdtemp makes it 0o700; a published folder is like any other
    os.rename(work, out)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
