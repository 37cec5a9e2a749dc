"""TensorBoard tracker: event files under ``<logging_dir>/<run_name>``."""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.values import flatten, is_number, scalar_or_text, to_plain

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(GeneralTracker):
    """Write scalars, text, histograms and hyperparameters to TensorBoard event files.

    Numbers become scalars, strings text, dicts of numbers ``add_scalars`` groups and
    multi-element tensors/arrays histograms; anything else is skipped with one warning per key.
    The configuration is written as TensorBoard hparams in the run's own folder (not in an extra
    timestamped sub-run as ``SummaryWriter.add_hparams`` does) and as ``config.json``; lists and
    ``None`` become their text, nested dicts ``outer/inner`` keys.

    Checkpoints: each save (once committed) and each load writes the event's numbers
    (``checkpoint/save_seconds``, ... see :mod:`accelkit.trackers.events`) as scalars at the
    step the checkpoint belongs to, in their own ``checkpoint/`` charts, and the checkpoint's
    path as a text entry: ``checkpoint/path`` for a save, ``checkpoint/loaded_path`` for a load
    (stored by ``add_text`` under the tags ``checkpoint/path/text_summary``, ...).

    Resume: :meth:`run_reference` is ``{"log_dir": <the run folder>}`` (shown by
    ``accelkit ckpt ls``; never used to choose a folder). After :meth:`continue_run`, the next
    :meth:`start` writes into this tracker's own run folder with ``SummaryWriter(...,
    purge_step=step + 1)``: TensorBoard's readers then drop every point the earlier attempt
    logged after the checkpoint's step (the event files stay on disk), so each step appears
    once, with the resumed job's values. A ``purge_step`` given in ``init_kwargs`` is replaced
    by the resume's.

    Args:
        run_name: the sub-folder of ``logging_dir`` the events go to.
        logging_dir: the run's logging directory.
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.log_dir = os.path.join(self.logging_dir or ".", run_name)
        self.writer: Any = None
        self._purge_step: int | None = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    @override
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        kwargs = dict(self.init_kwargs)
        if self._purge_step is not None:
            kwargs["purge_step"] = self._purge_step
            _wait_past_newest_event_file(self.log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, **kwargs)

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"log_dir": <absolute path of the run folder>}``, for display only."""
        return {"log_dir": os.path.abspath(self.log_dir)}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` purge the points logged after ``step`` in this run folder.

        Only this tracker's own folder is written to: a reference naming another folder (a
        moved project, or a crafted manifest) gets a warning and is not followed.

        Args:
            reference: what :meth:`run_reference` returned in the saving job, or ``None``.
            step: the checkpoint's last logged step (``-1``: purge every point).
        """
        recorded = reference.get("log_dir") if isinstance(reference, dict) else None
        if reference is not None and not _same_folder(recorded, self.log_dir):
            warnings.warn(
                f"Tracker 'tensorboard': the checkpoint's run wrote to {recorded!r}, this job "
                f"writes to {os.path.abspath(self.log_dir)!r}; continuing in this job's folder "
                f"(purging its points after step {step}), the other one is left alone.",
                UserWarning,
                stacklevel=2,
            )
        self._purge_step = int(step) + 1

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Write the event's numbers as scalars and the checkpoint's path as text."""
        for key, value in event.values.items():
            self.writer.add_scalar(key, value, global_step=event.step)
        tag = "checkpoint/path" if event.kind == "save" else "checkpoint/loaded_path"
        self.writer.add_text(tag, event.path, global_step=event.step)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {key: scalar_or_text(value) for key, value in flatten(values).items()}
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "config.json"), "w", encoding="utf-8") as file:
            json.dump(to_plain(values), file, indent=2, default=str)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if is_number(value):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict) and all(is_number(v) for v in value.values()):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            elif _is_array(value):
                self.writer.add_histogram(key, value, global_step=step, **kwargs)
            else:
                self.warn_skipped(key, value, "skipped by TensorBoard")

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write images: each value is a CHW tensor/array or an NCHW batch."""
        for key, images in values.items():
            if getattr(images, "ndim", 0) == 4:
                self.writer.add_images(key, images, global_step=step, **kwargs)
            else:
                self.writer.add_image(key, images, global_step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _same_folder(recorded: Any, folder: str) -> bool:
    if not isinstance(recorded, str):
        return False
    return os.path.normcase(os.path.realpath(recorded)) == os.path.normcase(
        os.path.realpath(folder)
    )


def _is_array(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return isinstance(value, np.ndarray) and value.size > 0 and value.dtype.kind in "biuf"


def _wait_past_newest_event_file(log_dir: str) -> None:
    """Wait (at most a second) until a new event file sorts after every existing one.

    TensorBoard reads a folder's event files in name order, and a name starts with the whole
    second it was created in; the purge of a continued run only applies to files read after
    it. A job restarted within the second its previous file was created in (or on a clock a
    little behind) would otherwise write a file that sorts first.
    """
    try:
        names = os.listdir(log_dir)
    except OSError:
        return
    seconds = []
    for name in names:
        parts = name.split(".")
        if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
            seconds.append(int(parts[3]))
    if not seconds:
        return
    wait = max(seconds) + 1 - time.time()
    if 0 < wait <= 1.0:
        time.sleep(wait)
