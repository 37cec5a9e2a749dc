"""Names: of checkpoint folders, and of the files inside one checkpoint.

Pure string functions, no I/O. One table, :data:`KINDS` (an :class:`ObjectKind` per kind of
object: stem, suffixes, numbering), is the source of every file name and name pattern; its
twin :data:`ACCELERATE_KINDS` lists the files of Hugging Face accelerate's checkpoints.

Public API:

- :data:`CHECKPOINTS_DIRNAME` (``"checkpoints"``), :data:`MANIFEST_NAME` (``"accelkit.json"``).
- :func:`checkpoints_dir(project_dir) <checkpoints_dir>` -- ``<project_dir>/checkpoints``.
- :func:`checkpoint_name(iteration) <checkpoint_name>` -- ``"checkpoint_<iteration>"``;
  :func:`parse_checkpoint_name` is its inverse (``None`` for any other name, e.g. ``best``).
- :func:`model_file(index) <model_file>` -- ``model.safetensors``, ``model_1.safetensors``...;
  :func:`shard_names`, :func:`index_name` -- ``model-00001-of-00002.safetensors``,
  ``model.safetensors.index.json``.
- :func:`object_stem(kind, index) <object_stem>` -- ``optimizer``, ``optimizer_1``,
  ``scheduler``, ``scaler``; :func:`dataloader_stem`, :func:`custom_stem`,
  :func:`random_states_stem`, :func:`resume_fingerprint_stem` -- ``dataloader_<i>``,
  ``custom_checkpoint_<i>``, ``random_states_<rank>``, ``resume_fingerprint_<rank>``. A stem
  ``S`` is stored as ``S.json`` (structure) plus
  ``S.safetensors`` (tensors, if any) plus, as a last resort, ``S.pt``.
- :func:`is_state_file(name) <is_state_file>` -- whether a file name is one that
  ``save_state`` writes (used to remove files of an earlier save into the same folder).
- :func:`check_relative_path(path) <check_relative_path>` -- reject a path stored in a manifest
  or index that is absolute or leaves its folder.
- :data:`SAVE_MARKER_NAME` (``.accelkit-save.json``): written into a checkpoint folder when a
  save starts, so a folder without a manifest can be told apart: an accelkit save that did not
  finish (marker present: safe to delete) or a folder accelkit did not write (never deleted).
- :func:`looks_like_accelerate(names) <looks_like_accelerate>` -- whether a folder's file names
  are those of a checkpoint written by Hugging Face accelerate's ``save_state``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from accelkit.checkpointing.storage import join
from accelkit.errors import ConfigurationError

__all__ = [
    "ACCELERATE_KINDS",
    "ALWAYS",
    "CHECKPOINTS_DIRNAME",
    "CHECKPOINT_PREFIX",
    "FIRST_BARE",
    "KINDS",
    "MANIFEST_NAME",
    "MODEL_INDEX_NAME",
    "ObjectKind",
    "SAVE_MARKER_NAME",
    "SINGLE",
    "STRUCTURE_SUFFIX",
    "TENSORS_SUFFIX",
    "TORCH_SUFFIX",
    "check_relative_path",
    "checkpoint_name",
    "checkpoints_dir",
    "custom_stem",
    "dataloader_stem",
    "is_state_file",
    "looks_like_accelerate",
    "index_name",
    "model_file",
    "object_stem",
    "parse_checkpoint_name",
    "random_states_stem",
    "resume_fingerprint_stem",
    "shard_names",
    "weights_pattern",
]


CHECKPOINTS_DIRNAME = "checkpoints"
CHECKPOINT_PREFIX = "checkpoint_"
MANIFEST_NAME = "accelkit.json"
MODEL_INDEX_NAME = "model.safetensors.index.json"
SAVE_MARKER_NAME = ".accelkit-save.json"
STRUCTURE_SUFFIX = ".json"
TENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIX = ".pt"

_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")

FIRST_BARE = "first_bare"
"""Numbering of objects that are usually alone: ``optimizer``, ``optimizer_1``, ..."""
ALWAYS = "always"
"""Numbering of per-index or per-rank files: ``random_states_0``, ``random_states_1``, ..."""
SINGLE = "single"
"""At most one object of the kind: ``scaler``."""

_STATE_SUFFIXES = (STRUCTURE_SUFFIX, TENSORS_SUFFIX, TORCH_SUFFIX)
_SHARD = r"-\d{5}-of-\d{5}"


@dataclass(frozen=True)
class ObjectKind:
    """One kind of object in a checkpoint, and how the files of the ``i``-th one are named.

    Attributes:
        stem: the base of the file names (``optimizer``, ``random_states``).
        suffixes: the endings its files may have (``.json``, ``.safetensors``, ``.pt``).
        count: :data:`FIRST_BARE`, :data:`ALWAYS` or :data:`SINGLE` (see :meth:`name`).
        sharded: the files may be split in shards (``model-00001-of-00003.safetensors``).
    """

    stem: str
    suffixes: tuple[str, ...]
    count: str = FIRST_BARE
    sharded: bool = False

    def name(self, index: int = 0) -> str:
        """The stem of the ``index``-th object: ``optimizer``/``optimizer_1``,
        ``random_states_0``, ``scaler``."""
        if self.count == SINGLE:
            if index != 0:
                raise ConfigurationError(
                    f"There is only one {self.stem!r} per checkpoint, not {index}."
                )
            return self.stem
        if self.count == FIRST_BARE and index == 0:
            return self.stem
        return f"{self.stem}_{index}"

    def pattern(self, suffixes: tuple[str, ...] | None = None, shards: bool = True) -> str:
        """A regular expression (no anchors) matching the file names of this kind with one of
        ``suffixes`` (default: all of them); group 1 is the index, if any."""
        index = {FIRST_BARE: r"(?:_(\d+))?", ALWAYS: r"_(\d+)", SINGLE: ""}[self.count]
        endings = []
        for suffix in suffixes or self.suffixes:
            shard = self.sharded and shards and suffix == self.suffixes[0]
            endings.append((f"(?:{_SHARD})?" if shard else "") + re.escape(suffix))
        return f"{re.escape(self.stem)}{index}(?:{'|'.join(endings)})"

    def regex(
        self, suffixes: tuple[str, ...] | None = None, shards: bool = True
    ) -> re.Pattern[str]:
        """:meth:`pattern`, anchored and compiled."""
        return re.compile(f"^{self.pattern(suffixes, shards)}$")


KINDS: Mapping[str, ObjectKind] = MappingProxyType(
    {
        "model": ObjectKind("model", (TENSORS_SUFFIX, ".safetensors.index.json"), sharded=True),
        "optimizer": ObjectKind("optimizer", _STATE_SUFFIXES),
        "scheduler": ObjectKind("scheduler", _STATE_SUFFIXES),
        "scaler": ObjectKind("scaler", _STATE_SUFFIXES, SINGLE),
        "dataloader": ObjectKind("dataloader", _STATE_SUFFIXES, ALWAYS),
        "custom": ObjectKind("custom_checkpoint", _STATE_SUFFIXES, ALWAYS),
        "random_states": ObjectKind("random_states", _STATE_SUFFIXES, ALWAYS),
        "resume_fingerprint": ObjectKind("resume_fingerprint", _STATE_SUFFIXES, ALWAYS),
    }
)
"""Every kind of file ``save_state`` writes; every file-name pattern derives from it."""

ACCELERATE_KINDS: Mapping[str, ObjectKind] = MappingProxyType(
    {
        "model": ObjectKind("pytorch_model", (".bin",)),
        "optimizer": ObjectKind("optimizer", (".bin",)),
        "scheduler": ObjectKind("scheduler", (".bin",)),
        "sampler": ObjectKind("sampler", (".bin",)),
        "dataloader": ObjectKind("dl_state_dict", (".bin",)),
        "scaler": ObjectKind("scaler", (".pt",), SINGLE),
        "random_states": ObjectKind("random_states", (".pkl",), ALWAYS),
        "custom": ObjectKind("custom_checkpoint", (".pkl",), ALWAYS),
    }
)
"""The files only Hugging Face accelerate's ``save_state`` writes (accelkit never writes
pickles): how an accelerate checkpoint is recognised."""

_STATE_FILE_RE = re.compile(f"^(?:{'|'.join(k.pattern() for k in KINDS.values())})$")
_ACCELERATE_FILE_RE = re.compile(
    f"^(?:{'|'.join(k.pattern() for k in ACCELERATE_KINDS.values())})$"
)


def checkpoints_dir(project_dir: str) -> str:
    """``<project_dir>/checkpoints``, where automatically named checkpoints live."""
    return join(project_dir, CHECKPOINTS_DIRNAME)


def checkpoint_name(iteration: int) -> str:
    """The folder name of the checkpoint of ``iteration``: ``checkpoint_<iteration>``."""
    if iteration < 0:
        raise ConfigurationError(f"iteration must be >= 0, got {iteration}.")
    return f"{CHECKPOINT_PREFIX}{iteration}"


def parse_checkpoint_name(name: str) -> int | None:
    """The iteration in a ``checkpoint_<n>`` folder name, ``None`` for any other name."""
    match = _CHECKPOINT_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def model_file(index: int) -> str:
    """File of the ``index``-th prepared model: ``model.safetensors``, ``model_1.safetensors``..."""
    return KINDS["model"].name(index) + TENSORS_SUFFIX


def shard_names(stem: str, count: int, suffix: str = TENSORS_SUFFIX) -> list[str]:
    """File names of weights saved under ``stem`` in ``count`` shards: ``[stem + suffix]`` for
    one, else ``stem-00001-of-0000N`` + ``suffix``, ... (Hugging Face's naming)."""
    if count == 1:
        return [f"{stem}{suffix}"]
    return [f"{stem}-{i:05d}-of-{count:05d}{suffix}" for i in range(1, count + 1)]


def index_name(stem: str, suffix: str = TENSORS_SUFFIX) -> str:
    """The index of sharded weights: ``model.safetensors.index.json``."""
    return f"{stem}{suffix}.index.json"


def weights_pattern(stem: str, suffix: str = TENSORS_SUFFIX) -> str:
    """A regular expression (no anchors) matching the weight files :func:`shard_names` and
    :func:`index_name` give for ``stem`` and ``suffix``: the single file, its shards, its index."""
    name = re.escape(stem + suffix)
    return f"{re.escape(stem)}(?:{_SHARD})?{re.escape(suffix)}|{name}\\.index\\.json"


def object_stem(kind: str, index: int = 0) -> str:
    """Stem of the ``index``-th object of ``kind`` (a key of :data:`KINDS`): ``optimizer``,
    ``optimizer_1``, ``scheduler``, ``scaler``, ``dataloader_0``...

    Raises:
        ValueError: for a kind not in :data:`KINDS`.
    """
    found = KINDS.get(kind)
    if found is None:
        raise ConfigurationError(f"Unknown object kind {kind!r}; expected one of {sorted(KINDS)}.")
    return found.name(index)


def dataloader_stem(index: int) -> str:
    """Stem of the ``index``-th prepared dataloader's position: ``dataloader_<index>``."""
    return KINDS["dataloader"].name(index)


def custom_stem(index: int) -> str:
    """Stem of the ``index``-th object given to ``register_for_checkpointing``."""
    return KINDS["custom"].name(index)


def random_states_stem(rank: int) -> str:
    """Stem of process ``rank``'s random generator states: ``random_states_<rank>``."""
    return KINDS["random_states"].name(rank)


def resume_fingerprint_stem(rank: int) -> str:
    """Stem of process ``rank``'s resume fingerprint (what its next steps consume):
    ``resume_fingerprint_<rank>``."""
    return KINDS["resume_fingerprint"].name(rank)


def is_state_file(name: str) -> bool:
    """Whether ``name`` (a file name in a checkpoint folder) is one ``save_state`` writes."""
    return bool(_STATE_FILE_RE.match(name)) or name == MANIFEST_NAME


def check_relative_path(path: object, what: str = "path") -> str:
    """Return ``path`` if it is a safe relative POSIX path inside its folder.

    Args:
        path: the value read from a manifest or an index.
        what: how to name it in the error (e.g. ``"file entry in accelkit.json"``).

    Raises:
        ValueError: if it is not a non-empty string, is absolute (``/x``, ``C:\\x``, ``\\\\x``),
            contains a backslash or a NUL, or has an empty, ``.`` or ``..`` component.
    """
    if not isinstance(path, str) or not path:
        raise ConfigurationError(
            f"Invalid {what} {path!r}: expected a non-empty relative path string."
        )
    if "\\" in path or "\x00" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ConfigurationError(
            f"Invalid {what} {path!r}: it must be a relative path inside the checkpoint "
            "(no leading '/', drive letter, backslash or NUL)."
        )
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ConfigurationError(
            f"Invalid {what} {path!r}: '..', '.' and empty components are not allowed; the "
            "file must stay inside its folder."
        )
    return path


def looks_like_accelerate(names: Iterable[str]) -> bool:
    """Whether the file names ``names`` (relative paths in one folder) include files that
    Hugging Face accelerate's ``save_state`` writes and accelkit never does (``optimizer.bin``,
    ``random_states_0.pkl``, ``scaler.pt``...)."""
    return any(_ACCELERATE_FILE_RE.match(n) for n in names if "/" not in n)
