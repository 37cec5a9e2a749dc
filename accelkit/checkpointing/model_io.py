"""Moved to :mod:`accelkit.checkpointing.formats.model_io`; kept so old imports work."""

from __future__ import annotations

from accelkit.checkpointing.formats.model_io import (
    ALIASES_KEY,
    check_model_keys,
    load_checkpoint_in_model,
    model_file_names,
    read_model_files,
    save_model,
    write_model_files,
)

__all__ = [
    "ALIASES_KEY",
    "check_model_keys",
    "load_checkpoint_in_model",
    "model_file_names",
    "read_model_files",
    "save_model",
    "write_model_files",
]
