"""The check a hosted tracker runs on a checkpoint's run reference before continuing that run.

A reference comes from a checkpoint file, so it is untrusted: the run id must look like one,
and the run must belong to the project this tracker logs to now. W&B and Comet share this
check (MLflow also matches its tracking URI and experiment, see ``mlflow.py``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

from accelkit._text import short

__all__ = ["continuable_id"]


def continuable_id(
    tracker: str,
    reference: Mapping[str, Any],
    *,
    id_key: str,
    id_name: str,
    pattern: re.Pattern[str],
    expected: str,
    project: object,
    own_project: str,
    new: str,
) -> str | None:
    """The run id of ``reference`` if this tracker may continue that run, else ``None`` after
    a warning saying why and that a new run is logged instead.

    Args:
        tracker: the tracker's name, for the warning.
        reference: what the tracker's ``run_reference()`` recorded in the checkpoint.
        id_key: the key of the run id in ``reference`` (``"run_id"``, ``"experiment_key"``).
        id_name: what the id is, for the warning (``"a W&B run id"``).
        pattern: what a run id must match entirely.
        expected: what ``pattern`` accepts, in words, for the warning.
        project: the reference's project as this tracker resolves it.
        own_project: the project this tracker logs to now.
        new: what is logged to instead (``"run"``, ``"experiment"``).
    """
    run_id = reference.get(id_key)
    if not isinstance(run_id, str) or not pattern.fullmatch(run_id):
        _warn(
            tracker,
            f"the checkpoint's {id_key} {short(run_id)} is not {id_name} (expected {expected}); "
            f"logging to a new {new}",
        )
        return None
    if project != own_project:
        _warn(
            tracker,
            f"the checkpoint's {new} {run_id!r} belongs to project {short(project)}, not to "
            f"this run's project {own_project!r}; logging to a new {new} (pass the same "
            "project to init_trackers to continue it)",
        )
        return None
    return run_id


def _warn(tracker: str, what: str) -> None:
    warnings.warn(f"Tracker {tracker!r}: {what}.", UserWarning, stacklevel=4)
