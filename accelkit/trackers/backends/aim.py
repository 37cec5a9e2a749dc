"""Aim tracker: a run in the Aim repository ``<logging_dir>/.aim``.

Aim keeps one value per step of each sequence (a point sent twice is stored once), so the
tracker journal needs no delivery check here. A resumed job reopens the checkpoint's run and
removes the points the abandoned attempt logged after the checkpoint (see :class:`AimTracker`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import warnings
from typing import Any

import numpy as np
from typing_extensions import override

from accelkit._text import short
from accelkit.errors import UsageError
from accelkit.trackers.backends._images import as_numpy, hwc_uint8
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["AimTracker"]

# Aim's run hashes: 24 lowercase hex digits (the first 24 of a uuid4). A reference read from a
# checkpoint names a folder of the repository by it, so anything else starts a new run.
_RUN_HASH = re.compile(r"[0-9a-f]{24}")
# Aim names a new run with aim.sdk.base_run.generate_run_hash(); a run accelkit names in advance
# (name_run) is opened by having that function answer the chosen hash for one construction.
_HASH_LOCK = threading.Lock()
# The sequences Aim's own resource tracker logs (CPU, memory, ...): not the owner's values.
_SYSTEM_PREFIX = "__system__"


def run_hash_of(key: str) -> str:
    """The Aim run hash accelkit gives the run of run key ``key`` (stable, Aim's format).

    Args:
        key: the run key.
    """
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class AimTracker(GeneralTracker):
    """Log to Aim, as Accelerate's ``AimTracker``: a run in the repository at the logging dir.

    ``init_trackers(project_name, init_kwargs={"aim": {...}})`` opens ``aim.Run(repo=
    logging_dir, **init_kwargs)`` (``experiment``, ``system_tracking_interval``,
    ``capture_terminal_logs``, ``run_hash``, ...) and names it ``project_name``, as Accelerate
    does; the repository is ``<logging_dir>/.aim`` (``aim up --repo <logging_dir>`` shows it,
    ``aim.Repo`` reads it). Aim is local: nothing leaves the machine unless ``logging_dir`` is
    an ``aim://`` server. The configuration is stored as the run's ``hparams`` (plain data:
    tensors to numbers or lists, paths to text). ``log`` tracks each value with
    ``Run.track(value, name=key, step=step, **kwargs)`` (``epoch``, ``context``): numbers as
    metrics, strings as ``aim.Text``, tensors and arrays of several numbers as
    ``aim.Distribution``, Aim's own objects as they are, anything else as its text (one warning
    per key). ``log_images`` takes Accelerate's forms (an image, or ``(image, caption)``; a
    ``kwargs={"aim_image": {...}, "track": {...}}`` argument) and also paths, PIL images and
    CHW or HWC tensors and arrays (floats in 0-1), and lists of them.

    Experiment continuity: a new run's hash is derived from accelkit's run key
    (:meth:`name_run`), so every checkpoint records ``{"run_hash"}`` from the first save. A
    job resumed from it reopens that run in this repository, never another, and removes from
    each of the run's sequences the points logged after the checkpoint's step: each step
    appears once, with the resumed job's values (on an ``aim://`` server, where accelkit does
    not remove points, the run's ``accelkit_resumed_at_step`` parameter records the step). A
    ``run_hash`` in ``init_kwargs`` wins over the checkpoint. A run another live process holds
    (Aim's run lock) is not forced open: a warning, and a new run. Unlike Accelerate's, whose
    repository defaults to the working directory, the tracker needs a logging directory
    (``Accelerator(project_dir=...)``).

    Args:
        run_name: the run's name (Accelerate's ``run_name``: the project given to
            ``init_trackers``).
        logging_dir: the folder that holds the Aim repository (``.aim``).
        **kwargs: passed to ``aim.Run``.
    """

    name = "aim"
    requires_logging_directory = True
    main_process_only = True

    def __init__(
        self, run_name: str = "", logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any
    ) -> None:
        folder = None if logging_dir is None else os.fspath(logging_dir)
        super().__init__(run_name, folder, **kwargs)
        self.aim_repo_path = self.logging_dir or "."  # Accelerate's attribute
        self.writer: Any = None
        self._hash: str | None = None  # the run the next start opens (name_run, continue_run)
        self._resume_step: int | None = None
        self._holds_values = False  # the finished run holds values of its owner's

    @property
    @override
    def tracker(self) -> Any:
        """The ``aim.Run``."""
        return self.writer

    @override
    def start(self) -> None:
        from aim import Run
        from aim.sdk.errors import RunLockingError
        from aimrocks.errors import RocksIOError

        step, self._resume_step = self._resume_step, None
        chosen = self._hash if "run_hash" not in self.init_kwargs else None
        try:
            self.writer = _open_run(Run, self.aim_repo_path, chosen, self.init_kwargs)
        except (RunLockingError, RocksIOError) as error:  # Aim's lock, or its database's
            warnings.warn(
                f"Tracker 'aim': run {chosen} is held by another process ({short(error)}); logging "
                f"to a new run. If that process is gone, `aim runs --repo "
                f"{self.aim_repo_path} close --force {chosen}` releases it.",
                UserWarning,
                stacklevel=2,
            )
            step = None
            fresh = {k: v for k, v in self.init_kwargs.items() if k != "run_hash"}
            self.writer = _open_run(Run, self.aim_repo_path, None, fresh)
        self._hash = self.writer.hash
        self.writer.name = self.run_name
        if step is not None:
            if self.writer.repo.is_remote_repo:
                self.writer["accelkit_resumed_at_step"] = step
            else:
                forget_after(self.writer, step)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._require_run("store_init_configuration")
        self.writer["hparams"] = to_plain(values)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._require_run("log")
        import aim

        for key, value in values.items():
            self.writer.track(self._trackable(aim, key, value), name=key, step=step, **kwargs)

    def _trackable(self, aim: Any, key: str, value: Any) -> Any:
        """``value`` as something ``Run.track`` stores."""
        if is_number(value) or isinstance(value, aim.storage.object.CustomObject):
            return value
        if isinstance(value, str):
            return aim.Text(value)
        array = as_numpy(value)
        if isinstance(array, (np.ndarray, np.generic)) and array.dtype.kind in "biuf":
            if array.size == 1:
                return array.reshape(-1)[0].item()
            if array.size > 1:
                return aim.Distribution(array.reshape(-1))
        own = aim.storage.object.CustomObject
        if isinstance(value, list) and value and all(isinstance(v, own) for v in value):
            return value
        self.warn_skipped(key, value, "logged to Aim as its text")
        return aim.Text(str(value))

    @override
    def log_images(
        self,
        values: dict[str, Any],
        step: int | None = None,
        kwargs: dict[str, dict[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        """Log images as ``aim.Image``: each value is an image, an ``(image, caption)`` pair,
        or a list of those; an image is a path, a PIL image, or a CHW or HWC tensor or array.

        Args:
            values: name -> image(s).
            step: the training step.
            kwargs: Accelerate's options: ``"aim_image"`` for ``aim.Image``, ``"track"`` for
                ``Run.track``.
            **options: more options for ``Run.track``.
        """
        self._require_run("log_images")
        import aim

        image_kw = dict((kwargs or {}).get("aim_image", {}))
        track_kw = {**(kwargs or {}).get("track", {}), **options}

        def image(value: Any) -> Any:
            picture, caption = value if isinstance(value, tuple) else (value, "")
            return aim.Image(hwc_uint8(picture), caption=caption, **image_kw)

        for key, value in values.items():
            item = [image(v) for v in value] if isinstance(value, list) else image(value)
            self.writer.track(item, name=key, step=step, **track_kw)

    @override
    def finish(self) -> None:
        if self.writer is None:
            return
        with contextlib.suppress(Exception):  # a closed run has no trees to read
            self._holds_values = any(
                not name.startswith(_SYSTEM_PREFIX)
                for names in (self.writer.meta_run_tree.get("traces") or {}).values()
                for name in names
            )
        self.writer.close()

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """A new run's hash is derived from ``key`` (a ``run_hash`` in ``init_kwargs`` wins).

        Args:
            key: the run key.
        """
        chosen = self.init_kwargs.get("run_hash")
        if chosen is not None:
            self._hash = None
            valid = isinstance(chosen, str) and _RUN_HASH.fullmatch(chosen)
            return {"run_hash": chosen} if valid else None
        self._hash = run_hash_of(key)
        return {"run_hash": self._hash}

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"run_hash"}`` of the open run."""
        if self.writer is None:
            return None
        return {"run_hash": self.writer.hash}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` reopen the checkpoint's run in this repository and
        forget its points after ``step``.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step.
        """
        self._resume_step = None
        if "run_hash" in self.init_kwargs:
            return
        if reference is not None:
            run_hash = reference.get("run_hash")
            if not isinstance(run_hash, str) or not _RUN_HASH.fullmatch(run_hash):
                warnings.warn(
                    f"Tracker 'aim': the checkpoint's run_hash {short(run_hash)} is not an Aim "
                    "run hash (24 lowercase hex digits); logging to a new run.",
                    UserWarning,
                    stacklevel=2,
                )
                return
            self._hash = run_hash
        if self._hash is not None:
            self._resume_step = int(step)

    @override
    def discard_run(self) -> bool:
        """Delete the finished run when it holds nothing but its configuration (and Aim's
        system metrics); a run named by ``run_hash`` in ``init_kwargs`` is kept."""
        if self.writer is None or self._holds_values or "run_hash" in self.init_kwargs:
            return False
        from aim import Repo

        run_hash, self.writer, self._hash = self.writer.hash, None, None
        deleted: bool = Repo.from_path(self.aim_repo_path).delete_run(run_hash)
        return deleted

    def _require_run(self, method: str) -> None:
        if self.writer is None:
            raise UsageError(
                f"AimTracker.{method}() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )


def _open_run(run_class: Any, repo: str, run_hash: str | None, kwargs: dict[str, Any]) -> Any:
    """``aim.Run(repo=repo, **kwargs)``, as the run ``run_hash`` when one is given: the run of
    that hash in ``repo`` if there is one, else a new run with that hash."""
    if run_hash is None:
        return run_class(repo=repo, **kwargs)
    import aim.sdk.base_run as base_run

    with _HASH_LOCK:
        original = base_run.generate_run_hash
        base_run.generate_run_hash = lambda *args, **kw: run_hash
        try:
            return run_class(repo=repo, **kwargs)
        finally:
            base_run.generate_run_hash = original


def forget_after(run: Any, step: int) -> None:
    """Remove from every sequence of the open ``run`` its points after ``step``, and set each
    sequence's summary (last step and value, bounds) to what is left.

    Aim stores a sequence as arrays (``val``, ``step``, ``epoch``, ``time``) keyed by the step
    (version 1) or by a hash of it (version 2, numbers), under the run's series tree; the
    run's meta tree holds each sequence's summary under ``traces``.

    Args:
        run: an ``aim.Run`` opened for writing.
        step: the last step to keep.
    """
    traces = run.meta_run_tree.get("traces") or {}
    for context, names in traces.items():
        for name, info in names.items():
            version = info.get("version", 1)
            series = run.series_run_trees[version].subtree((context, name))
            if version == 2:
                steps = dict(series.array("step", dtype="int64").items())
            else:
                # (keys() of an array of objects fails on its marker record; items() reads)
                steps = {key: key for key, _ in series.array("time").items()}
            late = [key for key, at in steps.items() if at > step]
            if not late:
                continue
            for key in late:
                for column in ("val", "step", "epoch", "time"):
                    with contextlib.suppress(KeyError):
                        del series[(column, key)]
            kept = {key: at for key, at in steps.items() if at <= step}
            if not kept:
                del run.meta_run_tree["traces", context, name]
                continue
            last = max(kept, key=kept.__getitem__)
            summary = {"last_step": kept[last], "last": series.array("val")[last]}
            if version == 2:
                kept_values = [series.array("val")[key] for key in kept]
                summary.update(max=max(kept_values), min=min(kept_values))
            for field, value in summary.items():
                run.meta_run_tree["traces", context, name, field] = value
    # The run's tracker read the summaries when the run opened: it reads them again.
    tracker = run._tracker
    tracker.sequence_infos.clear()
    tracker._preload_sequence_infos()
