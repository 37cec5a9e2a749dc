"""Names: of checkpoint folders, and of the files inside one checkpoint.

Pure string functions, no I/O.

Public API:

- :data:`CHECKPOINTS_DIRNAME` (``"checkpoints"``), :data:`MANIFEST_NAME` (``"accelkit.json"``).
- :func:`checkpoints_dir(project_dir) <checkpoints_dir>` -- ``<project_dir>/checkpoints``.
- :func:`checkpoint_name(iteration) <checkpoint_name>` -- ``"checkpoint_<iteration>"``;
  :func:`parse_checkpoint_name` is its inverse (``None`` for any other name, e.g. ``best``).
- :func:`model_file(index) <model_file>` -- ``model.safetensors``, ``model_1.safetensors``...
- :func:`object_stem(kind, index) <object_stem>` -- ``optimizer``, ``optimizer_1``,
  ``scheduler``, ``scaler``; :func:`dataloader_stem`, :func:`custom_stem`,
  :func:`random_states_stem` -- ``dataloader_<i>``, ``custom_checkpoint_<i>``,
  ``random_states_<rank>``. A stem ``S`` is stored as ``S.json`` (structure) plus
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
from collections.abc import Iterable

from accelkit.checkpointing.storage import join

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "CHECKPOINT_PREFIX",
    "MANIFEST_NAME",
    "MODEL_INDEX_NAME",
    "SAVE_MARKER_NAME",
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
    "model_file",
    "object_stem",
    "parse_checkpoint_name",
    "random_states_stem",
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
_STATE_FILE_RE = re.compile(
    r"^(?:"
    r"model(?:_\d+)?\.safetensors"
    r"|model(?:_\d+)?-\d{5}-of-\d{5}\.safetensors"
    r"|model(?:_\d+)?\.safetensors\.index\.json"
    r"|(?:optimizer|scheduler)(?:_\d+)?\.(?:json|safetensors|pt)"
    r"|scaler\.(?:json|safetensors|pt)"
    r"|(?:dataloader|custom_checkpoint|random_states)_\d+\.(?:json|safetensors|pt)"
    r")$"
)

# Files only Hugging Face accelerate's save_state writes (accelkit never writes pickles).
_ACCELERATE_FILE_RE = re.compile(
    r"^(?:(?:optimizer|scheduler|sampler|dl_state_dict)(?:_\d+)?\.bin"
    r"|pytorch_model(?:_\d+)?\.bin|scaler\.pt"
    r"|(?:random_states|custom_checkpoint)_\d+\.pkl)$"
)


def checkpoints_dir(project_dir: str) -> str:
    """``<project_dir>/checkpoints``, where automatically named checkpoints live."""
    return join(project_dir, CHECKPOINTS_DIRNAME)


def checkpoint_name(iteration: int) -> str:
    """The folder name of the checkpoint of ``iteration``: ``checkpoint_<iteration>``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}.")
    return f"{CHECKPOINT_PREFIX}{iteration}"


def parse_checkpoint_name(name: str) -> int | None:
    """The iteration in a ``checkpoint_<n>`` folder name, ``None`` for any other name."""
    match = _CHECKPOINT_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def model_file(index: int) -> str:
    """File of the ``index``-th prepared model: ``model.safetensors``, ``model_1.safetensors``..."""
    return "model.safetensors" if index == 0 else f"model_{index}.safetensors"


def object_stem(kind: str, index: int = 0) -> str:
    """Stem of a shared object's files: ``optimizer``, ``optimizer_1``, ``scheduler``, ..."""
    return kind if index == 0 else f"{kind}_{index}"


def dataloader_stem(index: int) -> str:
    """Stem of the ``index``-th prepared dataloader's position: ``dataloader_<index>``."""
    return f"dataloader_{index}"


def custom_stem(index: int) -> str:
    """Stem of the ``index``-th object given to ``register_for_checkpointing``."""
    return f"custom_checkpoint_{index}"


def random_states_stem(rank: int) -> str:
    """Stem of process ``rank``'s random generator states: ``random_states_<rank>``."""
    return f"random_states_{rank}"


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
        raise ValueError(f"Invalid {what} {path!r}: expected a non-empty relative path string.")
    if "\\" in path or "\x00" in path or path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ValueError(
            f"Invalid {what} {path!r}: it must be a relative path inside the checkpoint "
            "(no leading '/', drive letter, backslash or NUL)."
        )
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(
            f"Invalid {what} {path!r}: '..', '.' and empty components are not allowed; the "
            "file must stay inside its folder."
        )
    return path


def looks_like_accelerate(names: Iterable[str]) -> bool:
    """Whether the file names ``names`` (relative paths in one folder) include files that
    Hugging Face accelerate's ``save_state`` writes and accelkit never does (``optimizer.bin``,
    ``random_states_0.pkl``, ``scaler.pt``...)."""
    return any(_ACCELERATE_FILE_RE.match(n) for n in names if "/" not in n)
