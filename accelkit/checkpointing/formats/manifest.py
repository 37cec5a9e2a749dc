"""The manifest ``accelkit.json``: a checkpoint's commit marker and table of contents.

A checkpoint exists if and only if its manifest exists: it is written last, by the main process,
after every process finished writing. It records the format version, iteration, step, world
size, creation time, accelkit/torch versions, user metadata and metrics, and for every file its
relative path, size and checksum. A per-process checkpoint (each process saved into a folder of
its own, see :mod:`~accelkit.checkpointing.commit.per_process`) also records ``process_index``, the
process that wrote it and committed it alone.

Public API:

- :class:`FileEntry` (``path``, ``size``, ``checksum``) and :class:`Manifest`
  (``to_json()``, ``Manifest.from_json(text, source)``, ``file_map()``, ``total_size``).
- :class:`ManifestError` -- a manifest that cannot be trusted (bad JSON, a missing or mistyped
  field, an unsafe path, an unknown format version); the message names the source and field.
- :func:`read_manifest(storage, folder) <read_manifest>` -- the parsed manifest, ``None`` if
  there is none (the folder is then *incomplete*), :class:`ManifestError` if it is corrupt.
- :func:`write_manifest(storage, folder, manifest) <write_manifest>` -- the atomic commit.
- :func:`verify_files(storage, folder, manifest, checksums=True) <verify_files>` -- the list
  of :class:`FileProblem` (missing file, size or checksum mismatch); empty when all is well.
- :func:`file_checksum(storage, url, algorithm) <file_checksum>` -- stream a file and hash it.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelkit._text import short
from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import MANIFEST_NAME, check_relative_path
from accelkit.checkpointing.formats.safetensors_header import read_header
from accelkit.checkpointing.storage import Storage, WrittenFile, join
from accelkit.checkpointing.storage.checksum import parse_checksum
from accelkit.checkpointing.storage.verified import file_checksum
from accelkit.runtime.saving import REASONS

__all__ = [
    "FORMAT_VERSION",
    "MEMORY_LAST_SAVE",
    "MEMORY_SNAPSHOT",
    "RESUME_TIERS",
    "FileEntry",
    "FileProblem",
    "Manifest",
    "ManifestError",
    "file_checksum",
    "lineage_of",
    "malformed",
    "read_manifest",
    "resumed_of",
    "verify_files",
    "write_manifest",
]

#: The ``reason`` of a memory snapshot (the memory tier of
#: :mod:`~accelkit.checkpointing.memory`): a per-process checkpoint in the job's shared memory,
#: never a checkpoint of the project.
MEMORY_SNAPSHOT = "memory"
#: The ``metadata`` entry of a memory snapshot: the step of the run's newest checkpoint of the
#: project when it was taken (``None``: none yet), so that a run restored from it makes its
#: next interval save where the uninterrupted run does.
MEMORY_LAST_SAVE = "accelkit.last_save_step"
# Every reason a manifest may record: the save policies' and the memory tier's.
_REASONS = (*REASONS, MEMORY_SNAPSHOT)
#: Where the state of a job came from, as ``experiment.resumed.tier`` records it: the job's
#: shared memory (``"memory"``, :mod:`~accelkit.checkpointing.memory`), the project's own
#: checkpoints (``"local"``), the remote tier of ``replicate_to`` (``"remote"``), or a folder the
#: script named in ``load_state(path)`` (``"path"``).
RESUME_TIERS = ("memory", "local", "remote", "path")

FORMAT_VERSION = 1


class ManifestError(CorruptCheckpointError):
    """A manifest (``accelkit.json``) that is unreadable, malformed or unsafe."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, as recorded in its manifest.

    Attributes:
        path: POSIX path relative to the checkpoint folder.
        size: size in bytes.
        checksum: ``"<algorithm>:<hex>"``.
    """

    path: str
    size: int
    checksum: str

    @classmethod
    def from_written(cls, written: WrittenFile, relative_path: str) -> FileEntry:
        """Build the entry of a file just written through :mod:`~accelkit.checkpointing.storage`."""
        return cls(relative_path, written.size, written.checksum)


@dataclass
class Manifest:
    """The contents of ``accelkit.json``.

    Attributes:
        iteration: the checkpoint's iteration (``None`` for a folder saved outside automatic
            naming without one).
        step: optimizer steps taken when it was saved.
        world_size: number of processes that saved it.
        files: every file of the checkpoint except the manifest itself.
        created: UNIX time of the commit.
        metadata: free-form JSON values given by the user.
        metrics: numbers given at save time (used by ``keep_best`` retention).
        experiment: the tracker runs the checkpoint belongs to: ``{"step": <the last logged
            step, -1 if none>, "saved_at_step": <the checkpoint's own step on the trackers'
            axis, where its events are logged>, "key": <the run key>, "runs": {<tracker
            name>: <its run reference>}}``; empty when the run had no trackers (see
            :mod:`accelkit._accelerator.experiment` and :mod:`accelkit.trackers.events`).
            Written once, with the commit: every run is named when the checkpoint is saved.
            A checkpoint written before run keys may have no ``"key"`` and list trackers
            whose run was still opening in ``"pending"`` (read, never written);
            ``saved_at_step`` is absent from older manifests. ``"lineage"`` (also without
            trackers) says where the run's state came from when it descends from a fork:
            ``{"id": <the forked line's key>, "parent": {"checkpoint": <the path or URL
            loaded>, "iteration", "step" (its last logged step), "key" (its run key), "id"
            (its own line's key), "runs"}}`` (see :func:`lineage_of`); a job resumed from a
            checkpoint carries its lineage on. ``"start": true`` marks a copy made by
            ``accelkit ckpt fork``, which belongs to no run yet: loading it forks the
            parent's runs. ``"resumed"`` (also without trackers) says what the job that saved
            it last loaded: ``{"tier": <one of RESUME_TIERS>, "checkpoint": <the loaded
            folder's name>, "step": <its step>}`` (see :func:`resumed_of`); absent when the
            job started fresh.
        accelkit_version / torch_version: versions that wrote it.
        format_version: the manifest format (:data:`FORMAT_VERSION`).
        process_index: the process that wrote this folder alone, for a per-process checkpoint
            (see :mod:`~accelkit.checkpointing.commit.per_process`); ``None`` for one shared by all.
        reason: why it was made: ``"user"`` (``save_state()`` called by the script),
            ``"interval"`` (``save_every_steps``/``save_every_seconds`` was due),
            ``"preemption"`` (a preemption signal) or ``"memory"`` (:data:`MEMORY_SNAPSHOT`);
            a manifest without the field reads as ``"user"``.
    """

    iteration: int | None
    step: int
    world_size: int
    files: list[FileEntry]
    created: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    experiment: dict[str, Any] = field(default_factory=dict)
    accelkit_version: str = ""
    torch_version: str = ""
    format_version: int = FORMAT_VERSION
    process_index: int | None = None
    reason: str = "user"

    @property
    def total_size(self) -> int:
        """Sum of the sizes of the checkpoint's files."""
        return sum(entry.size for entry in self.files)

    def file_map(self) -> dict[str, FileEntry]:
        """Relative path -> :class:`FileEntry`."""
        return {entry.path: entry for entry in self.files}

    def to_json(self) -> str:
        """Serialise (stable key order, one file per line for readable diffs)."""
        payload = {
            "format": "accelkit-checkpoint",
            "format_version": self.format_version,
            "iteration": self.iteration,
            "step": self.step,
            "world_size": self.world_size,
            **({} if self.process_index is None else {"process_index": self.process_index}),
            "created": self.created,
            "created_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "accelkit_version": self.accelkit_version,
            "torch_version": self.torch_version,
            "metadata": self.metadata,
            "metrics": self.metrics,
            "reason": self.reason,
            **({"experiment": self.experiment} if self.experiment else {}),
            "files": [{"path": e.path, "size": e.size, "checksum": e.checksum} for e in self.files],
        }
        return json.dumps(payload, indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest.

        Args:
            text: the manifest's contents.
            source: where it came from, for error messages.

        Raises:
            ManifestError: naming ``source`` and the offending field.
        """
        try:
            data = load_json(text, source)
        except CorruptCheckpointError as exc:
            raise ManifestError(f"{exc} Or remove it with `accelkit ckpt prune`.") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a JSON object, got {type(data).__name__}.")

        def get(name: str, kinds: type | tuple[type, ...], optional: bool = False) -> Any:
            if name not in data:
                if optional:
                    return None
                raise ManifestError(f"{source}: missing field {name!r}.")
            value = data[name]
            if value is None and optional:
                return None
            if isinstance(value, bool) and bool not in (
                kinds if isinstance(kinds, tuple) else (kinds,)
            ):
                raise ManifestError(f"{source}: field {name!r} must not be a boolean.")
            if not isinstance(value, kinds):
                raise ManifestError(
                    f"{source}: field {name!r} has type {type(value).__name__}, expected "
                    f"{getattr(kinds, '__name__', kinds)}."
                )
            return value

        version = get("format_version", int)
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{source}: format_version {version} is not supported by this accelkit (which "
                f"reads version {FORMAT_VERSION}); upgrade accelkit to load it."
            )
        iteration = get("iteration", int, optional=True)
        step = get("step", int)
        world_size = get("world_size", int)
        created = get("created", (int, float))
        for name, value, low in (("step", step, 0), ("world_size", world_size, 1)):
            if value < low:
                raise ManifestError(f"{source}: field {name!r} must be >= {low}, got {value}.")
        process_index = get("process_index", int, optional=True)
        if process_index is not None and not 0 <= process_index < world_size:
            raise ManifestError(
                f"{source}: field 'process_index' must be a process of the {world_size} that "
                f"saved it (0 to {world_size - 1}), got {process_index}."
            )
        if iteration is not None and iteration < 0:
            raise ManifestError(f"{source}: field 'iteration' must be >= 0, got {iteration}.")
        metadata = get("metadata", dict, optional=True) or {}
        metrics_raw = get("metrics", dict, optional=True) or {}
        metrics: dict[str, float] = {}
        for key, value in metrics_raw.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ManifestError(f"{source}: metric {key!r} must be a number, got {value!r}.")
            try:
                metrics[str(key)] = float(value)
            except OverflowError:
                raise ManifestError(f"{source}: metric {key!r} is too large.") from None
        raw_files = get("files", list)
        files: list[FileEntry] = []
        seen: set[str] = set()
        for i, item in enumerate(raw_files):
            where = f"{source}: files[{i}]"
            if not isinstance(item, dict):
                raise ManifestError(f"{where}: expected an object with path, size, checksum.")
            try:
                path = check_relative_path(item.get("path"), what=f"file path in {source}")
            except ValueError as exc:
                raise ManifestError(str(exc)) from None
            if path == MANIFEST_NAME:
                raise ManifestError(f"{where}: the manifest cannot list itself.")
            if path in seen:
                raise ManifestError(f"{where}: {path!r} is listed twice.")
            seen.add(path)
            size = item.get("size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ManifestError(f"{where} ({path}): size must be an integer >= 0.")
            checksum = item.get("checksum")
            if not isinstance(checksum, str):
                raise ManifestError(f"{where} ({path}): checksum must be a string.")
            try:
                parse_checksum(checksum)
            except ValueError as exc:
                raise ManifestError(f"{where} ({path}): {exc}") from None
            files.append(FileEntry(path, size, checksum))
        # A path that is a file and a folder at once ("a.bin" and "a.bin/x") exists only on an
        # object store, where keys are names; no save writes it, and it would give the
        # same name two meanings (the nearest thing to a link a bucket has).
        for i, entry in enumerate(files):
            parts = entry.path.split("/")
            for depth in range(1, len(parts)):
                if "/".join(parts[:depth]) in seen:
                    raise ManifestError(
                        f"{source}: files[{i}] ({entry.path}) lies inside "
                        f"{'/'.join(parts[:depth])!r}, which the manifest lists as a file."
                    )
        experiment = _experiment(get("experiment", dict, optional=True) or {}, source)
        accelkit_version = get("accelkit_version", str, optional=True) or ""
        reason = get("reason", str, optional=True) or "user"
        if reason not in _REASONS:
            raise ManifestError(
                f"{source}: field 'reason' must be one of {', '.join(_REASONS)}, got "
                f"{short(reason)}."
            )
        torch_version = get("torch_version", str, optional=True) or ""
        try:
            created = float(created)
        except OverflowError:
            created = math.inf
        if not math.isfinite(created) or not 0 <= created < 1e11:
            raise ManifestError(f"{source}: field 'created' must be a UNIX time, got {created}.")
        return cls(
            iteration=iteration,
            step=step,
            world_size=world_size,
            files=files,
            created=float(created),
            metadata=metadata,
            metrics=metrics,
            experiment=experiment,
            accelkit_version=accelkit_version,
            torch_version=torch_version,
            format_version=version,
            process_index=process_index,
            reason=reason,
        )


_MAX_STEP = 2**62
# A run key (``accelkit.trackers.delivery.runs.new_run_key``: 32 hexadecimal digits).
_RUN_KEY = re.compile(r"[A-Za-z0-9]{1,64}")


def _experiment(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Check the shape of the ``experiment`` field (the references' contents are checked by
    each tracker against its own configuration when it continues a run)."""
    if not data:
        return {}
    lineage = _lineage(data.get("lineage"), source)
    resumed = _resumed(data.get("resumed"), source)
    plain = {"lineage": lineage, "resumed": resumed}
    if not set(data) - set(plain):  # a run without trackers, forked or resumed
        return {name: value for name, value in plain.items() if value}
    step, runs = data.get("step", -1), data.get("runs", {})
    saved_at = data.get("saved_at_step", step)
    # A logging step every backend can store (TensorBoard and MLflow: int64).
    for label, value in (("step", step), ("saved_at_step", saved_at)):
        if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < _MAX_STEP:
            raise ManifestError(
                f"{source}: experiment.{label} must be an integer from -1 to {_MAX_STEP - 1}, got "
                f"{str(value)[:40]}. The manifest was damaged or edited: load another checkpoint."
            )
    if not isinstance(runs, dict) or not all(
        isinstance(name, str) and isinstance(reference, dict) for name, reference in runs.items()
    ):
        raise ManifestError(
            f"{source}: experiment.runs must map tracker names to objects, got "
            f"{str(runs)[:200]!r}. The manifest was damaged or edited: load another checkpoint."
        )
    key = data.get("key")
    if key is not None and not (isinstance(key, str) and _RUN_KEY.fullmatch(key)):
        raise ManifestError(
            f"{source}: experiment.key must be a run key (1 to 64 letters and digits), got "
            f"{str(key)[:80]!r}. The manifest was damaged or edited: load another checkpoint."
        )
    pending = data.get("pending", [])
    if not isinstance(pending, list) or not all(isinstance(name, str) for name in pending):
        raise ManifestError(
            f"{source}: experiment.pending must be a list of tracker names, got "
            f"{str(pending)[:200]!r}. The manifest was damaged or edited: load another checkpoint."
        )
    record: dict[str, Any] = {"step": step, "runs": runs}
    if "saved_at_step" in data:
        record["saved_at_step"] = saved_at
    if key is not None:
        record["key"] = key
    if pending:  # a checkpoint written before run keys
        record["pending"] = pending
    if lineage:
        record["lineage"] = lineage
    if resumed:
        record["resumed"] = resumed
    return record


def _resumed(data: Any, source: str) -> dict[str, Any]:
    """Check the shape of ``experiment.resumed`` (shown by ``accelkit ckpt ls``, never
    loaded from): ``{}`` when absent."""
    if data is None:
        return {}

    def bad(what: str, value: Any) -> ManifestError:
        return ManifestError(
            f"{source}: experiment.resumed{what}, got {str(value)[:200]!r}. The manifest was "
            "damaged or edited: load another checkpoint."
        )

    if not isinstance(data, dict):
        raise bad(" must be an object", data)
    tier, name, step = data.get("tier"), data.get("checkpoint"), data.get("step")
    if tier not in RESUME_TIERS:
        raise bad(f".tier must be one of {', '.join(RESUME_TIERS)}", tier)
    # A folder's name, shown in a table cell: no separator, no control character.
    if not isinstance(name, str) or not 0 < len(name) <= 255 or not name.isprintable():
        raise bad(".checkpoint must be a folder name of 1 to 255 printable characters", name)
    if "/" in name or name in (".", ".."):
        raise bad(".checkpoint must be a folder name, not a path", name)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < _MAX_STEP:
        raise bad(f".step must be an integer from 0 to {_MAX_STEP - 1}", step)
    return {"tier": tier, "checkpoint": name, "step": step}


_MAX_PATH = 4096


def _lineage(data: Any, source: str) -> dict[str, Any]:
    """Check the shape of ``experiment.lineage`` (its parent's ``runs`` are shown and handed
    to the trackers' ``fork_run``, each checking its reference as ``continue_run`` does)."""
    if data is None:
        return {}

    def bad(what: str, value: Any) -> ManifestError:
        return ManifestError(
            f"{source}: experiment.lineage{what}, got {str(value)[:200]!r}. The manifest was "
            "damaged or edited: load another checkpoint."
        )

    if not isinstance(data, dict) or not isinstance(data.get("parent"), dict):
        raise bad(" must be an object with a 'parent' object", data)
    parent = data["parent"]
    record: dict[str, Any] = {}
    keys = {".id": data.get("id"), ".parent.id": parent.get("id"), ".parent.key": parent.get("key")}
    for label, key in keys.items():
        if key is not None and not (isinstance(key, str) and _RUN_KEY.fullmatch(key)):
            raise bad(f"{label} must be a run key (1 to 64 letters and digits)", key)
    if data.get("id") is not None:
        record["id"] = data["id"]
    if data.get("start") is not None:
        if not isinstance(data["start"], bool):
            raise bad(".start must be true or false", data["start"])
        record["start"] = data["start"]
    checkpoint = parent.get("checkpoint")
    if not isinstance(checkpoint, str) or not 0 < len(checkpoint) <= _MAX_PATH:
        raise bad(
            f".parent.checkpoint must be a path or URL of 1 to {_MAX_PATH} characters", checkpoint
        )
    iteration, step = parent.get("iteration"), parent.get("step", -1)
    if iteration is not None and (
        isinstance(iteration, bool)
        or not isinstance(iteration, int)
        or not 0 <= iteration < _MAX_STEP
    ):
        raise bad(".parent.iteration must be null or an integer from 0", iteration)
    if isinstance(step, bool) or not isinstance(step, int) or not -1 <= step < _MAX_STEP:
        raise bad(f".parent.step must be an integer from -1 to {_MAX_STEP - 1}", step)
    runs = parent.get("runs", {})
    if not isinstance(runs, dict) or not all(
        isinstance(name, str) and isinstance(reference, dict) for name, reference in runs.items()
    ):
        raise bad(".parent.runs must map tracker names to objects", runs)
    record["parent"] = {
        "checkpoint": checkpoint,
        "iteration": iteration,
        "step": step,
        **{name: parent[name] for name in ("key", "id") if parent.get(name) is not None},
        "runs": runs,
    }
    return record


def lineage_of(manifest: Manifest) -> dict[str, Any]:
    """The manifest's ``experiment.lineage`` (checked when read): ``{}`` for a checkpoint
    whose run descends from no fork."""
    return dict(manifest.experiment.get("lineage") or {})


def resumed_of(manifest: Manifest) -> dict[str, Any]:
    """The manifest's ``experiment.resumed`` (checked when read): what the job that saved it
    last loaded (``tier``, ``checkpoint``, ``step``), ``{}`` for a job that started fresh."""
    return dict(manifest.experiment.get("resumed") or {})


def read_manifest(storage: Storage, folder: str) -> Manifest | None:
    """Read ``<folder>/accelkit.json``.

    Returns:
        The manifest, or ``None`` if the folder has none (an incomplete checkpoint).

    Raises:
        ManifestError: if it exists but cannot be trusted.
    """
    url = join(folder, MANIFEST_NAME)
    try:
        text = storage.read_bytes(url)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise ManifestError(str(exc)) from None
    return Manifest.from_json(text, source=url)


def write_manifest(storage: Storage, folder: str, manifest: Manifest) -> str:
    """Commit a checkpoint: write ``<folder>/accelkit.json`` atomically; returns its URL."""
    url = join(folder, MANIFEST_NAME)
    storage.write_bytes(url, manifest.to_json().encode("utf-8"), atomic=True)
    return url


@dataclass(frozen=True)
class FileProblem:
    """One way a checkpoint's file disagrees with its manifest."""

    path: str
    problem: str  # "missing", "size", "checksum", "symlink"
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


def verify_files(
    storage: Storage,
    folder: str,
    manifest: Manifest,
    checksums: bool = True,
    sizes: Mapping[str, int] | None = None,
) -> list[FileProblem]:
    """Check every file the manifest lists against the folder's contents.

    Args:
        storage: the storage of ``folder``.
        folder: the checkpoint folder.
        manifest: its manifest.
        checksums: also read every file and compare checksums (otherwise sizes only).
        sizes: a listing already made (relative path -> size) to save a round trip.

    Returns:
        The problems found, empty if the checkpoint is intact.
    """
    # Not copied: callers pass the listing once per entry (`accelkit ckpt verify`), and a copy
    # each time made a folder of many files cost the square of its size.
    listing = sizes if sizes is not None else storage.walk_files(folder)
    problems: list[FileProblem] = []
    for entry in manifest.files:
        url = join(folder, entry.path)
        if entry.path not in listing:
            problems.append(FileProblem(entry.path, "missing", "listed in the manifest, missing"))
            continue
        if storage.is_symlink(url):
            problems.append(FileProblem(entry.path, "symlink", "is a symbolic link"))
            continue
        if listing[entry.path] != entry.size:
            problems.append(
                FileProblem(
                    entry.path,
                    "size",
                    f"size {listing[entry.path]} bytes, manifest says {entry.size}",
                )
            )
            continue
        if checksums:
            algorithm, _ = parse_checksum(entry.checksum)
            _, actual = file_checksum(storage, url, algorithm)
            if actual != entry.checksum:
                problems.append(
                    FileProblem(
                        entry.path, "checksum", f"checksum {actual}, manifest says {entry.checksum}"
                    )
                )
    return problems


def malformed(storage: Storage, url: str, path: str) -> FileProblem | None:
    """Why the checkpoint file at ``url`` cannot be read as its kind, if so.

    A manifest re-signed over a damaged or crafted file matches every checksum, so
    ``accelkit ckpt verify`` (and ``ckpt prune``, which verifies what it keeps) also parses
    what the loader parses first: otherwise verify said OK and prune kept such a checkpoint
    as the newest intact one, deleting the older one that ``load_state()`` could still
    restore. Only safetensors headers and JSON documents are read (tensor data is covered by
    the checksum); how well the contents fit a model is for ``load_state()`` to say.

    Args:
        storage: the storage of ``url``.
        url: the file.
        path: its path relative to the checkpoint (``model.safetensors``), which names it.

    Returns:
        The problem (kind ``"format"``), or ``None`` if the file parses.
    """
    try:
        if path.endswith(".safetensors"):
            with storage.open_read(url) as stream:
                read_header(stream, url, storage.size(url))
        elif path.endswith(".json"):
            load_json(storage.read_bytes(url), url)
    except CorruptCheckpointError as exc:
        return FileProblem(path, "format", str(exc).removeprefix(f"{url}: "))
    return None
