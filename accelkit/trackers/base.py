"""`GeneralTracker`: the interface every experiment tracker implements.

A tracker class is constructed as Accelerate constructs it: ``cls(run_name, logging_dir,
**init_kwargs)`` when ``requires_logging_directory`` is true, else ``cls(run_name,
**init_kwargs)`` (plus ``logging_dir=`` when its ``__init__`` names that parameter). Then
``start()`` opens the backend's run (this is where the backend's SDK is imported, so importing
accelkit never imports wandb, mlflow, comet_ml or tensorboard), ``store_init_configuration()``
records the hyperparameters, ``log()`` records values at a step and ``finish()`` closes the run.
Five optional methods connect a tracker to checkpoints: ``name_run()`` (name the run from the
run key before it opens), ``run_reference()`` (what a checkpoint records to continue the run),
``continue_run()`` (reopen that run on resume), ``discard_run()`` (delete a run given up for a
checkpoint's before anything was logged to it) and ``on_checkpoint()`` (a checkpoint was saved
or loaded).

Custom trackers subclass `GeneralTracker`, set the class attributes ``name``,
``requires_logging_directory`` and ``main_process_only``, and implement ``log`` (and usually
``store_init_configuration`` and the ``tracker`` property). Pass an instance to
``Accelerator(log_with=[...])`` or register the class with
:func:`accelkit.trackers.register_tracker` so that its name works in ``log_with``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from accelkit.trackers.events import CheckpointEvent

__all__ = ["GeneralTracker", "on_main_process"]

F = TypeVar("F", bound=Callable[..., Any])


def _process_index() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


def on_main_process(function: F) -> F:
    """Decorate a tracker method to run only on the main process when ``main_process_only``.

    As Accelerate's decorator of the same name: on other processes the call does nothing and
    returns ``None``; the process is looked up at call time (the process group, else
    ``RANK``), so decorating creates no process state. accelkit's own trackers do not need it
    (a main-process-only tracker is never created elsewhere); it is for trackers written for
    Accelerate that use it.

    Example:
        >>> class MyTracker(GeneralTracker):
        ...     name = "mine"
        ...
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
    """

    @functools.wraps(function)
    def run_on_main_process(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and _process_index() != 0:
            return None
        return function(self, *args, **kwargs)

    return run_on_main_process  # type: ignore[return-value]


class GeneralTracker:
    """Base class of every tracker.

    Class attributes:
        name: the name used in ``log_with`` and :meth:`Accelerator.get_tracker`.
        requires_logging_directory: ``True`` when the tracker writes files and needs the run's
            logging directory (``project_dir`` / ``logging_dir``).
        main_process_only: ``True`` (the default) when only the main process creates and uses the
            tracker; on every other process it is never constructed.
        required_packages: importable package names the tracker needs (an accelkit extension:
            a registered tracker whose packages are missing is left out of ``"all"``).

    Args:
        run_name: the project / run name given to ``init_trackers``.
        logging_dir: the directory (or ``None``) where the backend writes its files.
        **kwargs: backend options (``init_kwargs[name]`` of ``init_trackers``).

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name = "print"
        ...     requires_logging_directory = False
        ...
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
    """

    name: ClassVar[str] = ""
    requires_logging_directory: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    required_packages: ClassVar[tuple[str, ...]] = ()
    max_batch_values: ClassVar[int] = 1000
    """The most values one :meth:`log_batch` call receives (an entry with more comes alone):
    a backend's limit per request, so that a batch goes out in one request."""

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.init_kwargs = kwargs
        self._warned_keys: set[str] = set()

    @property
    def tracker(self) -> Any:
        """The backend's own run object (a ``SummaryWriter``, a wandb ``Run``, ...)."""
        return None

    def start(self) -> None:
        """Open the backend's run. Called once by ``init_trackers``, before any ``log``."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters.

        Args:
            values: the configuration; may hold nested dicts, lists, tensors, paths and ``None``.
                Each backend flattens or converts what it cannot store as it is.
        """

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``.

        Args:
            values: metric name -> value (numbers, strings or backend objects).
            step: the training step. ``Accelerator.log`` always passes one (its own counter
                when the caller gives none); ``None`` only comes from a direct call, and lets
                the backend count.
            **kwargs: backend options (``log_kwargs[name]`` of ``Accelerator.log``).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement log(values, step)")

    def log_batch(self, batch: Sequence[tuple[dict[str, Any], int, float]]) -> None:
        """Record several ``log`` calls at once, in order (optional: a hook for backends with a
        batch request).

        With the tracker journal (:mod:`accelkit.trackers.delivery.journal`), a tracker that defines
        its own ``log_batch`` receives what is waiting when its worker has a backlog (a fast
        loop, a catch-up after an outage, ``accelkit track sync``) in calls of at most 200
        entries and :attr:`max_batch_values` values; each call's entries are recorded as
        delivered when it returns, so a call should store all of them or none (one request),
        and raise when it could not. Values logged with ``log_kwargs`` for this tracker go to
        :meth:`log` instead. The default calls :meth:`log` for each; a tracker without its own
        ``log_batch`` gets one ``log`` call per value set, each recorded on its own.

        Args:
            batch: ``(values, step, wall_time)`` per ``log`` call: the values, their step,
                and when they were logged (seconds since the epoch; backends that take a
                timestamp should store this one, so that points sent late keep their time).
        """
        for values, step, _ in batch:
            self.log(values, step)

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record images (optional; backends that support images override it).

        Args:
            values: image name -> image (a tensor or array, CHW/NCHW or HWC as the backend takes).
            step: the training step.
            **kwargs: backend options.

        Raises:
            NotImplementedError: the backend has no image support.
        """
        raise NotImplementedError(f"Tracker {self.name!r} does not support log_images().")

    def finish(self) -> None:
        """Flush and close the backend's run. Called by ``Accelerator.end_training``."""

    # Experiment continuity: optional, for trackers whose runs a resumed job can continue.

    def name_run(self, key: str) -> dict[str, Any] | None:
        """Name the run this tracker is about to open, before it opens: what a checkpoint
        saved while :meth:`start` is still running records for it.

        Called once per run, before :meth:`continue_run` and :meth:`start`, on the thread that
        opens the runs (not the tracker's worker), with the run key accelkit chose for the run:
        32 letters and digits, new for a new run, the checkpoint's own when a job resumes from
        one. It must not contact the backend: it decides, from ``key`` and the tracker's
        configuration alone, which run :meth:`start` will open or find (W&B opens the run
        whose id is ``key``, Comet the experiment whose key is ``key``, MLflow the run tagged
        ``accelkit.run_key`` = ``key``), remembers that, and returns a reference
        :meth:`continue_run` accepts for it. Every checkpoint then names the run from the first
        save, and a job killed at any moment, even before :meth:`start` returned, resumes into
        that same run.

        Args:
            key: the run key.

        Returns:
            The run's reference (JSON values), or ``None`` (the default): the run is named
            only in checkpoints saved after :meth:`start` returned (:meth:`run_reference`),
            and a job killed before that resumes into a new run.
        """
        return None

    def run_reference(self) -> dict[str, Any] | None:
        """What a checkpoint records so that a resumed job continues this tracker's run.

        Called on the tracker's worker thread after :meth:`start` (and after a continued
        start); the result is stored in every checkpoint's manifest (``experiment.runs``,
        shown by ``accelkit ckpt ls``) and handed back to :meth:`continue_run` on resume.

        Returns:
            JSON values (for example ``{"run_id": ..., "project": ...}``), or ``None`` (the
            default): nothing to record, a resumed job starts a new run.
        """
        return None

    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Prepare to continue a run when a job resumes from a checkpoint.

        Called before :meth:`start` (on the worker thread) when ``Accelerator.load_state``
        restores a checkpoint, whichever of ``init_trackers`` and ``load_state`` came first.
        The next :meth:`start` should then reopen the run ``reference`` describes and, where
        the backend can, forget the points logged after ``step`` (they belong to the timeline
        the resumed job replaces); where it cannot, record the resume point (a tag or
        parameter). The default does nothing: the tracker starts a new run.

        A reference comes from a checkpoint file, so it is checked against this run's own
        configuration: it may only continue a run in the place this tracker logs to now (the
        same folder, server, project), never send values elsewhere. A run that no longer
        exists on the backend is a warning and a new run, never a failure.

        Args:
            reference: what :meth:`run_reference` returned when the checkpoint was saved, or
                ``None`` when the checkpoint recorded nothing for this tracker (a file-based
                tracker still forgets the points after ``step`` in its own folder).
            step: the last logging step the checkpoint covers; the resumed job logs after it.
        """

    def fork_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Prepare to open a new run that descends from a checkpoint's run (a fork).

        Called before :meth:`start` (on the worker thread, instead of :meth:`continue_run`)
        when ``Accelerator.load_state(..., fork=True)`` restores a checkpoint: the job goes on
        from the checkpoint's state in a new run, and the checkpoint's run is left as it is.
        The next :meth:`start` should open a new run (the one :meth:`name_run` named) and,
        where the backend records where a run came from, link it to the run ``reference``
        describes at ``step`` (W&B's ``fork_from``, MLflow's parent run). Every tracker also
        gets the link as the ``forked_from`` entry of its configuration
        (:meth:`store_init_configuration`), so the default, which does nothing more, is
        enough for a backend with no such notion.

        A reference comes from a checkpoint file: link to it only where it names a run in the
        place this tracker logs to now (a run elsewhere is recorded in the configuration
        only), and never read from or write to that run.

        Args:
            reference: what :meth:`run_reference` returned when the checkpoint was saved, or
                ``None`` when the checkpoint recorded nothing for this tracker.
            step: the checkpoint's last logging step; the new run logs after it.
        """

    def discard_run(self) -> bool:
        """Delete the run :meth:`start` opened, given up for a checkpoint's run before anything
        was logged to it, and forget it, so that the next :meth:`start` opens another.

        A tracker instance given to ``Accelerator(log_with=...)`` is started by
        ``init_trackers``, as Accelerate does (its owner may call its methods at once). When
        ``load_state`` then loads a checkpoint before anything was logged, that run is given
        up for the checkpoint's: accelkit calls :meth:`finish`, then this method, then
        :meth:`continue_run` and :meth:`start`. Called on the tracker's worker thread.

        It should delete the run only when it holds nothing but its configuration (values the
        owner logged to it directly keep it), and never a run the tracker was told to log to
        (a run id given to its constructor: the next :meth:`start` continues that same run).

        Returns:
            ``True`` when nothing of that run is left apart from the run logged to next (it was
            deleted, or the next :meth:`start` continues the same run or folder); ``False``
            (the default) when it is kept: accelkit then warns once, naming it.
        """
        return False

    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Record that a checkpoint was saved or loaded (see :mod:`accelkit.trackers.events`).

        Called on the tracker's worker thread. The default logs ``event.values`` at
        ``event.step`` with :meth:`log`; backends override it to also keep a reference to the
        checkpoint (its path as a tag, a text entry or a summary value).

        Args:
            event: what happened, when, and its numbers.
        """
        self.log(dict(event.values), step=event.step)

    def warn_skipped(self, key: str, value: Any, reason: str) -> None:
        """Warn once per key that a value was skipped or converted.

        Args:
            key: the metric name.
            value: the value that could not be stored as it is.
            reason: what was done instead (for example ``"skipped"`` or ``"stored as text"``).
        """
        warned: set[str] = self.__dict__.setdefault("_warned_keys", set())
        if key in warned:
            return
        warned.add(key)
        warnings.warn(
            f"Tracker {self.name!r}: value for {key!r} of type {type(value).__name__} is not a "
            f"number; {reason}. Log numbers (or this backend's media objects) to keep it.",
            UserWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        run_name = getattr(self, "run_name", None)
        return f"{type(self).__name__}(name={self.name!r}, run_name={run_name!r})"


class NullTracker(GeneralTracker):
    """Stand-in returned by ``get_tracker`` where the real tracker does not exist.

    On non-main processes a main-process-only tracker is never created; code that calls
    ``accelerator.get_tracker("wandb").log(...)`` on every process still works, doing nothing.
    """

    def __init__(self, name: str) -> None:
        super().__init__(run_name="")
        self.name = name  # type: ignore[misc]

    @property
    def tracker(self) -> Any:
        """A null run object: every attribute and call on it does nothing."""
        return _NullRun()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Do nothing."""

    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Do nothing."""

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return _NullRun()

    def __repr__(self) -> str:
        return f"NullTracker({self.name!r})"


class _NullRun:
    """An object whose attributes and calls all return itself."""

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _NullRun:
        return self

    def __bool__(self) -> bool:
        return False
