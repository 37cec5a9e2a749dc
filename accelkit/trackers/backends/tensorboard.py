"""TensorBoard tracker: event files under ``<logging_dir>/<run_name>``."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
import warnings
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from accelkit._text import short
from accelkit.trackers.backends._files import make_run_folder, same_path, write_text
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.values import flatten, is_number, scalar_or_text, to_plain

__all__ = ["TensorBoardTracker"]

# Where each kind of checkpoint event keeps the checkpoint's path.
_PATH_TAGS = {
    "save": "checkpoint/path",
    "load": "checkpoint/loaded_path",
    "replicate": "checkpoint/remote_path",
}

_ROLE = "the TensorBoard tracker writes its event files"
_EVENT_PREFIX = "events.out.tfevents."


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
    by the resume's. TensorBoard reads a folder's event files in name order and a purge only
    drops points read before it, so event files that would be read after the new one (from a
    clock that ran ahead) are first renamed to be read just before it: their points up to the
    checkpoint stay, the later ones are purged (nothing is deleted; a warning says which).

    Files: the run folder (``run_name`` under ``logging_dir``) and ``config.json`` are never
    followed: a link, a pipe, a device or a folder there makes :meth:`start` (or
    :meth:`store_init_configuration`) raise a ``TrackerFileError`` naming it and the fix.

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

        make_run_folder(self.logging_dir or ".", self.run_name, _ROLE)
        kwargs = dict(self.init_kwargs)
        if self._purge_step is not None:
            kwargs["purge_step"] = self._purge_step
            _read_before_new_files(self.log_dir, self._purge_step)
            _wait_past_newest_event_file(self.log_dir)
        self.writer = SummaryWriter(log_dir=self.log_dir, **kwargs)

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """The run is this tracker's run folder, known before it opens: :meth:`run_reference`.

        Args:
            key: the run key (not needed: the folder names the run).
        """
        return self.run_reference()

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"log_dir": <absolute path of the run folder>}``, for display only."""
        return {"log_dir": os.path.abspath(self.log_dir)}

    @override
    def discard_run(self) -> bool:
        """Nothing to delete: the run is this tracker's run folder, which the continued run
        keeps (its next :meth:`start` drops what was logged after the checkpoint)."""
        return True

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
        if reference is not None and not same_path(recorded, self.log_dir):
            warnings.warn(
                f"Tracker 'tensorboard': the checkpoint's run wrote to {short(recorded, 200)}, "
                f"this job writes to {os.path.abspath(self.log_dir)!r}; continuing in this job's "
                "folder (purging the points logged after the checkpoint was saved: those after "
                f"step {step}, the last step logged before it), the other one is left alone.",
                UserWarning,
                stacklevel=2,
            )
        self._purge_step = int(step) + 1

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Write the event's numbers as scalars and the checkpoint's path as text."""
        for key, value in event.values.items():
            self.writer.add_scalar(key, value, global_step=event.step)
        tag = _PATH_TAGS[event.kind]
        self.writer.add_text(tag, event.path, global_step=event.step)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {key: scalar_or_text(value) for key, value in flatten(values).items()}
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        text = json.dumps(to_plain(values), indent=2, default=str)
        write_text(
            os.path.join(self.log_dir, "config.json"), text, "the TensorBoard tracker writes"
        )

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


def _event_second(name: str) -> int | None:
    """The second in a standard event file name (``events.out.tfevents.<second>.<host>...``)."""
    parts = name.split(".")
    if name.startswith(_EVENT_PREFIX) and len(parts) > 3 and parts[3].isdigit():
        return int(parts[3])
    return None


def _read_before_new_files(log_dir: str, purge_step: int) -> None:
    """Rename the event files a new one would be read before, so that they are read after it.

    TensorBoard reads every file of a run folder with ``tfevents`` in its name, in name order,
    and the purge event at the start of the resumed job's file drops only the points read
    before it. A new file's name begins with the second it is created in, so a file named
    from a clock that ran ahead (or any name sorting after ``events.out.tfevents.<next
    second>``) would be read after the purge and bring the abandoned attempt's points back.
    Each such file (or link) is renamed to ``events.out.tfevents.<T>.~<n>.<old name>``, where
    ``T`` is the newest second of the other files (or now): the renamed files keep their
    order among themselves, sort after every other file and before the new one (see
    :func:`_wait_past_newest_event_file`), and the purge then applies to them.
    """
    now = int(time.time())
    limit = f"{_EVENT_PREFIX}{now + 1:010d}"
    try:
        names = sorted(os.listdir(log_dir))
    except OSError:
        return
    ahead: list[str] = []
    seconds: list[int] = []
    for name in names:
        if "tfevents" not in name:
            continue
        if name < limit:
            second = _event_second(name)
            if second is not None and second <= now:
                seconds.append(second)
            continue
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(os.path.join(log_dir, name)).st_mode):
                ahead.append(name)
    if not ahead:
        return
    base = f"{_EVENT_PREFIX}{max(seconds, default=now):010d}.~"
    used = [
        int(n[len(base) :][:6])
        for n in names
        if n.startswith(base) and n[len(base) :][:6].isdigit()
    ]
    index = max(used, default=-1) + 1
    renamed: list[str] = []
    left: list[str] = []
    for name in ahead:
        target = f"{base}{index:06d}.{name[:150]}"
        index += 1
        try:
            # An old file that cannot be moved must not cost the resumed run its new points.
            if os.path.lexists(os.path.join(log_dir, target)):
                raise FileExistsError(errno.EEXIST, "name taken", target)
            os.rename(os.path.join(log_dir, name), os.path.join(log_dir, target))
            renamed.append(target)
        except OSError as error:
            left.append(f"{short(name)} ({type(error).__name__}: {error.strerror})")
    said = (
        f"Renamed to be read before it (the first is now {short(renamed[0])}): their points "
        f"before step {purge_step} stay, the later ones are purged"
        if renamed
        else "None could be renamed"
    )
    if left:
        said += f". Left as they are, so their later points still show: {', '.join(left[:3])}"
    warnings.warn(
        f"Tracker 'tensorboard': {len(ahead)} event file(s) in {log_dir} are named after this "
        f"second (a clock that ran ahead?), the first {short(ahead[0])}: TensorBoard would read "
        f"them after this job's file and show the abandoned attempt's points again. {said}.",
        UserWarning,
        stacklevel=3,
    )
