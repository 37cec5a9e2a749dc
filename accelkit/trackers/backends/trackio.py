"""Trackio tracker: a local-first run whose database lives under ``<logging_dir>/trackio``."""

from __future__ import annotations

import os
import re
import sqlite3
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from accelkit._text import short
from accelkit.errors import UsageError
from accelkit.trackers.backends._images import as_numpy, hwc_uint8
from accelkit.trackers.backends._reference import continuable_id
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["TrackioTracker", "use_trackio_folder"]

# What accelkit accepts as a trackio run name from a checkpoint: the names it gives
# (``accelkit-<key>``), trackio's own (``swift-river-12``) and the usual user-chosen ones.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# init_kwargs that send the run elsewhere than the local database (Spaces, a server).
_REMOTE = ("space_id", "server_url", "dataset_id", "bucket_id")
_REMOTE_ENV = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
# trackio's module-level paths (read once, when trackio is imported) and what each is under
# the folder: rebound together by use_trackio_folder.
_FOLDER_NAMES = {"TRACKIO_DIR": "", "MEDIA_DIR": "media", "ARTIFACTS_DIR": "artifacts"}
_FOLDER_LOCK = threading.Lock()


def use_trackio_folder(folder: str | os.PathLike[str]) -> Any:
    """Import trackio with its local database in ``folder``, and return the module.

    trackio reads where it keeps its files (``TRACKIO_DIR``, else ``$HF_HOME/trackio``) once,
    when it is imported, into module-level paths. This points those paths at ``folder`` (its
    database, ``media`` and ``artifacts``), in every trackio module already imported, so that
    a run (and trackio's own readers, ``SQLiteStorage``) use ``folder``. One folder per
    process at a time: trackio has no per-run folder.

    Args:
        folder: the folder trackio keeps its files in.

    Returns:
        The ``trackio`` module.
    """
    import trackio
    import trackio.sqlite_storage
    import trackio.utils

    root = Path(folder)
    with _FOLDER_LOCK:
        # A copy in one C call: list(sys.modules.items()) iterates, and a garbage collection
        # during it can run another thread, whose import (another tracker starting) changes
        # sys.modules ("dictionary changed size during iteration", seen once under load).
        for name, module in sys.modules.copy().items():
            if module is None or not (name == "trackio" or name.startswith("trackio.")):
                continue
            for attr, sub in _FOLDER_NAMES.items():
                if isinstance(getattr(module, attr, None), Path):
                    setattr(module, attr, root / sub if sub else root)
    return trackio


class TrackioTracker(GeneralTracker):
    """Log to trackio (Hugging Face's local-first tracker), as Accelerate's ``TrackioTracker``.

    ``init_trackers(project_name, init_kwargs={"trackio": {...}})`` calls ``trackio.init(
    project=project_name, **init_kwargs)`` (``name``, ``group``, ``space_id``, ``server_url``,
    ``auto_log_cpu``, ...). Without ``space_id`` or ``server_url`` (nor ``TRACKIO_SPACE_ID``,
    ``TRACKIO_SERVER_URL``) trackio is local and never touches the network: its SQLite
    database (``<project>.db``) and media go to ``<logging_dir>/trackio`` when a logging
    directory is set, instead of ``~/.cache/huggingface/trackio`` (``TRACKIO_DIR`` wins over
    the logging directory). Read it back with ``trackio show`` (with ``TRACKIO_DIR`` set to
    that folder) or ``trackio.sqlite_storage.SQLiteStorage``. The configuration is stored as
    plain data (tensors to numbers or lists, paths to text); numbers and strings are logged as
    they are, tensors and arrays of several numbers as ``trackio.Histogram``, anything else
    trackio cannot store (other than its own media, tables and markdown) as its text, with one
    warning per key. trackio keeps one folder per process: two runs of one process logging
    to trackio at once with different logging directories both write to the later one's.

    Experiment continuity: trackio finds a run by its name, so a new run is named
    ``accelkit-<run key>`` (:meth:`name_run`; a ``name`` in ``init_kwargs`` wins) and every
    checkpoint records ``{"project", "name"}`` (and ``run_id`` once open) from the first save.
    A job resumed from it reopens that run (``trackio.init(name=..., resume="allow")``), in
    the same project only (else a warning and a new run), and in the local database removes
    the points the earlier attempt logged after the checkpoint's step, so each step appears
    once; on a Space or server, where accelkit cannot remove points, the run's config records
    ``accelkit/resumed_at_step``. A ``resume`` in ``init_kwargs`` wins over the checkpoint.
    ``accelkit track sync`` sends what the journal kept into the same run.

    Args:
        run_name: the trackio project.
        logging_dir: the run's logging directory (trackio's folder goes under it).
        **kwargs: passed to ``trackio.init``.
    """

    name = "trackio"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run: Any = None
        self._name: str | None = None  # the run name a new run gets (see name_run)
        self._resume_step: int | None = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``trackio.Run``."""
        return self.run

    @property
    def folder(self) -> str | None:
        """The folder trackio keeps this run's database in (``None``: trackio's default)."""
        if os.environ.get("TRACKIO_DIR"):
            return os.environ["TRACKIO_DIR"]
        if self.logging_dir is None:
            return None
        return os.path.join(self.logging_dir, "trackio")

    @override
    def start(self) -> None:
        folder = self.folder
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            trackio = use_trackio_folder(folder)
        else:
            import trackio
        kwargs = dict(self.init_kwargs)
        if self._name is not None:
            kwargs.setdefault("name", self._name)
        step, self._resume_step = self._resume_step, None
        if step is not None:
            kwargs.setdefault("resume", "allow")
        self.run = trackio.init(project=self.run_name, **kwargs)
        if step is not None:
            self._forget_after(step)

    def _forget_after(self, step: int) -> None:
        """Remove the continued run's points after ``step`` from the local database; on a
        Space or server, record where the run was resumed instead."""
        if self._remote():
            self.run.config["accelkit/resumed_at_step"] = step
            return
        from trackio.sqlite_storage import SQLiteStorage

        path = SQLiteStorage.get_project_db_path(self.run_name)
        if not os.path.isfile(path):
            return
        with sqlite3.connect(path, timeout=30) as connection:
            connection.execute(
                "DELETE FROM metrics WHERE run_id = ? AND step > ?", (self.run.id, int(step))
            )
        connection.close()

    def _remote(self) -> bool:
        return any(self.init_kwargs.get(k) for k in _REMOTE) or any(
            os.environ.get(k) for k in _REMOTE_ENV
        )

    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        """Whether the run's local database already has the numbers of one journal entry at
        ``step`` (the tracker journal asks after a sender was killed mid-call; trackio would
        keep a second row for a point sent twice). ``False`` on a Space or server."""
        self._require_run("journal_delivered")
        numbers = {key: float(value) for key, value in values.items() if is_number(value)}
        if not numbers or self._remote():
            return False
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs(self.run.project, run_id=self.run.id)
        return any(
            row.get("step") == step
            and all(is_number(row.get(k)) and float(row[k]) == v for k, v in numbers.items())
            for row in rows
        )

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._require_run("store_init_configuration")
        self.run.config.update(to_plain(values))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._require_run("log")
        import trackio

        for key, value in values.items():
            if _is_array(value):
                values[key] = trackio.Histogram(as_numpy(value).reshape(-1))
            elif not _storable(value, trackio):
                self.warn_skipped(key, value, "logged to trackio as its text")
                values[key] = str(value)
        self.run.log(values, step=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: each value is an image (or a list of images, logged as ``key/0``,
        ``key/1``, ...): a path, a PIL image, or a CHW or HWC tensor or array (floats in 0-1)."""
        self._require_run("log_images")
        import trackio

        images: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, list):
                for index, image in enumerate(value):
                    images[f"{key}/{index}"] = trackio.Image(hwc_uint8(image))
            else:
                images[key] = trackio.Image(hwc_uint8(value))
        self.run.log(images, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """A new run is named ``accelkit-<key>`` (a ``name`` in ``init_kwargs`` wins).

        Args:
            key: the run key.
        """
        name = self.init_kwargs.get("name") or f"accelkit-{key}"
        if not isinstance(name, str) or not _RUN_NAME.fullmatch(name):
            self._name = None
            return None
        self._name = name
        return {"project": self.run_name, "name": name}

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"project", "name", "run_id"}`` of the open run."""
        if self.run is None:
            return None
        return {"project": self.run.project, "name": self.run.name, "run_id": self.run.id}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` reopen the checkpoint's run, when it is in this project,
        and forget its points after ``step``.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step.
        """
        self._resume_step = None
        if reference is None or "resume" in self.init_kwargs:
            return
        name = continuable_id(
            "trackio",
            reference,
            id_key="name",
            id_name="a trackio run name",
            pattern=_RUN_NAME,
            expected="1-128 letters, digits, '-', '_' or '.'",
            project=reference.get("project"),
            own_project=self.run_name,
            new="run",
        )
        if name is None:
            self._name = None
            return
        if self.init_kwargs.get("name") not in (None, name):
            warnings.warn(
                f"Tracker 'trackio': the checkpoint's run is {short(name)}, but init_kwargs "
                f"name it {short(self.init_kwargs['name'])}; logging to that one.",
                UserWarning,
                stacklevel=2,
            )
            return
        self._name = name
        self._resume_step = int(step)

    def _require_run(self, method: str) -> None:
        if self.run is None:
            raise UsageError(
                f"TrackioTracker.{method}() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )


def _is_array(value: Any) -> bool:
    """A tensor or array of several numbers (logged as a trackio histogram)."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 1
    return isinstance(value, np.ndarray) and value.size > 1 and value.dtype.kind in "biuf"


def _storable(value: Any, trackio: Any) -> bool:
    """Whether trackio stores ``value`` itself: JSON data and its own media and table types."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    own = (trackio.Histogram, trackio.Markdown, trackio.Table, _trackio_media(trackio))
    if isinstance(value, own):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and _storable(v, trackio) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_storable(v, trackio) for v in value)
    return False


def _trackio_media(trackio: Any) -> type:
    """trackio's base class of media objects (``Image``, ``Video``, ``Audio``, ...)."""
    from trackio.media import TrackioMedia

    media: type = TrackioMedia
    return media
