"""Weights & Biases tracker: the run's files go under ``<logging_dir>/wandb``."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from accelkit.delivery.failures import TRANSIENT, classify
from accelkit.errors import UsageError
from accelkit.trackers.backends._reference import continuable_id
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import to_plain

if TYPE_CHECKING:
    from accelkit.trackers.events import CheckpointEvent

__all__ = ["WandBTracker"]

# Where each kind of checkpoint event keeps the checkpoint's path.
_PATH_KEYS = {
    "save": "checkpoint/latest",
    "load": "checkpoint/resumed_from",
    "replicate": "checkpoint/latest_remote",
}

# What accelkit accepts as a W&B run id from a checkpoint: wandb's generated ids and the usual
# user-chosen ones (letters, digits, ``-``, ``_``, ``.``); anything else starts a new run.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# init_kwargs that already say which run to open: the user's choice wins over the checkpoint's.
_OWN_RUN_CHOICE = ("id", "resume", "resume_from", "fork_from")
RESUMED_AT_STEP = "accelkit/resumed_at_step"
CHECKPOINT_STEP = "checkpoint/step"


class WandBTracker(GeneralTracker):
    """Log to Weights & Biases (online, or offline with ``WANDB_MODE=offline``).

    Unlike the reference tracker, which lets wandb write to ``./wandb`` whatever the project
    directory, the run's files go to ``<logging_dir>/wandb`` when a logging directory is set
    (``dir=`` in ``init_kwargs``, or the ``WANDB_DIR`` environment variable, overrides it).
    The configuration is converted to plain data
    (tensors to numbers or lists, paths to text) so wandb can serialise it. wandb stores numbers,
    strings, arrays and its media objects itself; any other value is logged as its text with one
    warning per key.

    Experiment continuity: the run's id is accelkit's run key (:meth:`name_run`; an ``id`` in
    ``init_kwargs`` wins), so every checkpoint records ``{"run_id", "project"}`` of the run
    from the first save, before ``wandb.init`` has returned (and the ``entity``, for display
    only, once the run is open). A job resumed from it opens the same run
    (``wandb.init(id=..., resume="allow")``, offline too: the offline folders then share the
    run id and ``wandb sync`` appends to one run), but only when the checkpoint's project is
    the project this tracker logs to (``run_name``, else ``WANDB_PROJECT``); the entity comes
    from this job's settings, never from the checkpoint. An ``id``, ``resume``,
    ``resume_from`` or ``fork_from`` in ``init_kwargs`` wins over the checkpoint. W&B cannot
    forget the points logged after the checkpoint, so the run's config records where it was
    resumed (``accelkit/resumed_at_step``: the checkpoint's step; the resumed job logs from
    the next one). Online, W&B keeps its run at the last step it received and drops points
    logged at a lower step (with a warning): the steps between the checkpoint and the crash
    keep the first attempt's values (pass ``resume_from="<id>?_step=<n>"`` yourself to rewind
    where your W&B server allows it). Offline the resumed folder starts at step 0 and holds
    every resumed step. An id W&B refuses, or (online) an id no longer in the project, is a
    warning and a new run; offline there is no server to ask, so a vanished run is found only
    at ``wandb sync``.

    Forks (``load_state(..., fork=True)``): the new run opens with ``fork_from="<the
    checkpoint's run id>?_step=<its last logged step>"`` when that run is in this project (W&B
    shows the new run as a branch of it: its history up to that step, then the new run's; a
    server without forking refuses it, and the run is opened without it, with a warning), and
    its config holds ``forked_from`` in every case. An ``id``, ``resume``, ``resume_from`` or
    ``fork_from`` in ``init_kwargs`` wins.

    Checkpoint events are logged without moving the run's step: their numbers join the row
    being written (``commit=False``; the next row logged when the run has not reached the
    event's step yet, as a run continued offline) with ``checkpoint/step`` set to the event's
    step, and
    ``checkpoint/*`` is plotted against ``checkpoint/step``. The run's summary keeps the last
    saved checkpoint's path (``checkpoint/latest``) and the one it resumed from
    (``checkpoint/resumed_from``).

    Args:
        run_name: the wandb project.
        logging_dir: the run's logging directory.
        **kwargs: passed to ``wandb.init`` (``name``, ``entity``, ``tags``, ``mode``, ...).
    """

    name = "wandb"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run: Any = None
        self._resume: tuple[str, int] | None = None
        self._fork_from: str | None = None  # "<run id>?_step=<n>" (see fork_run)
        self._key: str | None = None  # the run id a new run gets (see name_run)
        # Checkpoint numbers waiting for the run to reach their step (see on_checkpoint).
        self._pending: dict[str, Any] = {}
        # What discard_run reads: values were logged through this tracker, the run's step
        # when it finished, its offline folder.
        self._logged = False
        self._ended_step: int | None = None
        self._folder: str | None = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``wandb.Run``."""
        return self.run

    @override
    def start(self) -> None:
        import wandb

        kwargs = dict(self.init_kwargs)
        # An explicit WANDB_DIR wins over the logging directory (passed on as dir=: wandb's
        # settings, once set up in this process, would not read the variable again).
        folder = os.environ.get("WANDB_DIR") or self.logging_dir
        if folder is not None:
            kwargs.setdefault("dir", folder)
        if kwargs.get("dir") is not None:
            os.makedirs(kwargs["dir"], exist_ok=True)
        resume, self._resume = self._resume, None
        if self._fork_from is not None and not _own_run_choice(kwargs):
            # Kept until a run opens: a start() retried after a refused connection forks too.
            self.run = self._init_forked(wandb, kwargs, self._fork_from)
        elif resume is None and self._key is not None and not _own_run_choice(kwargs):
            self.run = wandb.init(project=self.run_name, id=self._key, **kwargs)
        elif resume is None:
            self.run = wandb.init(project=self.run_name, **kwargs)
        else:
            self.run = self._init_continued(wandb, kwargs, *resume)
        self._fork_from = None
        if not self.run.disabled:
            self.run.define_metric("checkpoint/*", step_metric=CHECKPOINT_STEP)
        self._logged, self._ended_step = False, None
        self._folder = self.run.settings.sync_dir if self.run.offline else None

    def _init_forked(self, wandb: Any, kwargs: dict[str, Any], fork_from: str) -> Any:
        """A new run branched from ``fork_from``; without the branch when W&B refuses it (not
        when it cannot be reached: the retried start forks)."""
        if self._key is not None:
            kwargs = {**kwargs, "id": self._key}
        try:
            return wandb.init(project=self.run_name, fork_from=fork_from, **kwargs)
        except Exception as error:
            if classify(error, chain=False, builtin_types=True) == TRANSIENT:
                raise  # W&B unreachable: start() is retried, with the fork
            _warn(
                f"could not fork W&B run {fork_from!r} ({type(error).__name__}: {error}); "
                "the new run is opened without the link (its config's forked_from names the "
                "checkpoint and its runs)"
            )
            return wandb.init(project=self.run_name, **kwargs)

    def _init_continued(self, wandb: Any, kwargs: dict[str, Any], run_id: str, step: int) -> Any:
        """Open run ``run_id`` again; a new run (and a warning) when W&B refuses it."""
        try:
            run = wandb.init(project=self.run_name, id=run_id, resume="allow", **kwargs)
        except Exception as error:
            _warn(
                f"could not continue W&B run {run_id!r} ({type(error).__name__}: {error}); "
                "logging to a new run"
            )
            return wandb.init(project=self.run_name, **kwargs)
        if not (run.offline or run.disabled or run.resumed):
            _warn(
                f"W&B run {run_id!r} no longer exists in project {run.project!r}; W&B started "
                "a new run with that id"
            )
        run.config.update({RESUMED_AT_STEP: step}, allow_val_change=True)
        return run

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(to_plain(values), allow_val_change=True)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from wandb.sdk.data_types.base_types.wb_value import WBValue

        for key, value in values.items():
            if not _storable(value, WBValue):
                self.warn_skipped(key, value, "logged to wandb as its text")
                values[key] = str(value)
        if self._pending:
            values, self._pending = {**self._pending, **values}, {}
        self._logged = True
        self.run.log(values, step=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: each value is an image (or list of images) ``wandb.Image`` accepts."""
        import wandb

        images = {
            key: [wandb.Image(v) for v in value] if isinstance(value, list) else wandb.Image(value)
            for key, value in values.items()
        }
        self._logged = True
        self.run.log(images, step=step, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a ``wandb.Table`` from ``columns`` and ``data`` rows, or from a ``dataframe``.

        Args:
            table_name: the key the table is logged under.
            columns: the column names.
            data: the rows (any values ``wandb.Table`` accepts: text, numbers, media).
            dataframe: a pandas ``DataFrame`` instead of ``columns``/``data``.
            step: the training step.
            **kwargs: passed to ``Run.log``.
        """
        import wandb

        if self.run is None:
            raise UsageError(
                "WandBTracker.log_table() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )
        names: list[str | int] | None = None if columns is None else list(columns)
        table = wandb.Table(columns=names, data=data, dataframe=dataframe)
        self._logged = True
        self.run.log({table_name: table}, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.run is not None:
            if self._pending:
                self.run.log(self._pending, commit=False)
                self._pending = {}
            if not (self._logged or self.run.disabled):
                # A run finished empty may be discarded (discard_run): whether values were
                # logged to it directly (run.log) is only known before it finishes.
                try:
                    self._ended_step = self.run.step
                except Exception:  # W&B's service did not answer: the run is kept
                    self._ended_step = None
            self.run.finish()

    @override
    def discard_run(self) -> bool:
        """Delete the offline run folder :meth:`start` made, given up for a checkpoint's run,
        when nothing was logged to it (neither through this tracker nor to its ``run``
        directly: its configuration only), and forget the run.

        An online run is kept (deleting it needs W&B's API and credentials): accelkit names
        it in a warning.

        Returns:
            ``True`` if the run was deleted (or W&B was disabled); ``False`` if it is kept.
        """
        run, self.run = self.run, None
        folder, self._folder = self._folder, None
        if run is None or run.disabled:
            return True
        if self._logged or self._ended_step != 0 or folder is None:
            return False
        shutil.rmtree(folder, ignore_errors=True)
        return not os.path.exists(folder)

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """A new run's id is ``key`` (an ``id`` in ``init_kwargs`` wins); ``None`` when the
        run cannot be named before it opens (W&B disabled, or ``resume_from`` or ``fork_from``
        in ``init_kwargs``).

        Args:
            key: the run key.
        """
        self._key = None
        mode = self.init_kwargs.get("mode") or os.environ.get("WANDB_MODE")
        if mode == "disabled" or any(
            name in self.init_kwargs for name in ("resume_from", "fork_from")
        ):
            return None
        run_id = self.init_kwargs.get("id") or key
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            return None
        self._key = key
        # No entity: W&B resolves the default one when the run opens (it is display only).
        return {"run_id": run_id, "project": _project(self.run_name)}

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"run_id", "project", "entity"}`` of the run (``None`` when W&B is disabled)."""
        if self.run is None or self.run.disabled:
            return None
        return {"run_id": self.run.id, "project": self.run.project, "entity": self.run.entity}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` open the checkpoint's run, when it is in this project.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step, recorded as ``accelkit/resumed_at_step``.
        """
        self._resume = self._fork_from = None
        if reference is None or _own_run_choice(self.init_kwargs):
            return
        project = reference.get("project")
        run_id = continuable_id(
            "wandb",
            reference,
            id_key="run_id",
            id_name="a run id",
            pattern=_RUN_ID,
            expected="1-128 letters, digits, '-', '_' or '.'",
            project=_project(project) if isinstance(project, str) else project,
            own_project=_project(self.run_name),
            new="run",
        )
        if run_id is None:
            self._key = None  # refused: a new run, with an id of W&B's own
            return
        self._resume = (run_id, int(step))

    @override
    def fork_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` open a new run branched from the checkpoint's run at
        ``step``, when that run is in this project and logged something (W&B ``fork_from``).

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step.
        """
        self._resume = self._fork_from = None
        if reference is None or step < 0 or _own_run_choice(self.init_kwargs):
            return
        run_id, project = reference.get("run_id"), reference.get("project")
        if not (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
            return  # recorded in the config only
        if not isinstance(project, str) or _project(project) != _project(self.run_name):
            return
        self._fork_from = f"{run_id}?_step={int(step)}"

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Log the event's numbers beside a row of the run and keep the path in the summary."""
        if self.run is None or self.run.disabled:
            return
        values: dict[str, Any] = dict(event.values)
        values[CHECKPOINT_STEP] = event.step
        self._logged = True
        if self.run.step < event.step:
            # A run continued offline counts from 0 again: rather than a row of its own at
            # that step, the numbers join the next row the job logs.
            self._pending.update(values)
        else:
            self.run.log(values, commit=False)
        key = _PATH_KEYS[event.kind]
        self.run.summary[key] = event.path


def _own_run_choice(kwargs: dict[str, Any]) -> bool:
    """Whether ``init_kwargs`` already say which run to open."""
    return any(key in kwargs for key in _OWN_RUN_CHOICE)


def _project(name: str) -> str:
    """The project a run named ``name`` logs to (wandb's own fallbacks for an empty name)."""
    return name or os.environ.get("WANDB_PROJECT") or "uncategorized"


def _warn(what: str) -> None:
    warnings.warn(f"Tracker 'wandb': {what}.", UserWarning, stacklevel=3)


def _storable(value: Any, media: type) -> bool:
    """Whether wandb can serialise ``value`` itself (JSON data, arrays, its media objects)."""
    if isinstance(value, (int, float, str, type(None), torch.Tensor, np.ndarray, media)):
        return True
    if isinstance(value, dict):
        return all(_storable(v, media) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_storable(v, media) for v in value)
    return False
