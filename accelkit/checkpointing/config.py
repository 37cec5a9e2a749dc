"""``ProjectConfiguration``: where a run's logs and checkpoints go, and how many are kept."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from accelkit.checkpointing.catalog.retention import RetentionPolicy, build_policy
from accelkit.runtime import preemption as _preemption

__all__ = ["ProjectConfiguration", "resolve_project_configuration"]


def _as_location(value: str | os.PathLike[str] | None) -> str | None:
    # URLs must stay strings: pathlib would collapse the "//" of "s3://".
    return None if value is None else os.fspath(value)


@dataclass
class ProjectConfiguration:
    """Where a run's logs and checkpoints go.

    Args:
        project_dir: root folder, a local path or any fsspec URL (``s3://bucket/run``,
            ``memory://run``). Automatically named checkpoints go to
            ``<project_dir>/checkpoints/checkpoint_<iteration>``.
        logging_dir: folder for trackers' logs; defaults to ``project_dir``.
        automatic_checkpoint_naming: ``save_state()`` without ``output_dir`` writes
            ``checkpoint_<iteration>`` under ``<project_dir>/checkpoints``.
        total_limit: keep at most this many automatically named checkpoints (the newest).
            Unlike the reference, the oldest ones are deleted only *after* the new checkpoint
            is committed, only committed ``checkpoint_<n>`` folders are counted, and stray
            folders (``checkpoints/best``) are left alone.
        iteration: number of the next automatic checkpoint. ``load_state()`` sets it past every
            existing ``checkpoint_<n>`` so the next save never collides.
        save_on_each_node: ``Accelerator.save`` writes once per machine instead of once.
        storage_options: keyword arguments for the fsspec filesystem of ``project_dir`` and of
            explicit ``output_dir``/``input_dir`` URLs (S3: ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs``...).
        keep_every: also keep every checkpoint whose iteration is a multiple of this.
        keep_best: also keep the best K checkpoints by ``best_metric``, a metric passed as
            ``save_state(metrics={...})``.
        best_metric: metric name for ``keep_best``.
        best_mode: ``"min"`` (lower is better) or ``"max"``.
        verify_checksums: ``load_state`` checks every file against the manifest's checksums
            before restoring anything (``load_state(verify=False)`` skips it once).
        async_save: ``save_state()`` copies the state to host memory and writes it in the
            background, returning a handle (see ``Accelerator.save_state``); costs one host
            copy of the saved tensors, reused across saves.
        continue_tracker_runs: a job resumed with ``load_state`` continues the tracker runs
            its checkpoint names (the same W&B run id, MLflow run, Comet experiment;
            TensorBoard and jsonl in the same folder with the points logged after the
            checkpoint dropped), whichever of ``init_trackers`` and ``load_state`` comes
            first. For that, trackers open their runs at their first use (the first ``log``)
            rather than in ``init_trackers``. ``False``: every job starts new runs, opened in
            ``init_trackers`` (the reference's behaviour).
        checkpoint_events: tell the trackers about every save and load
            (``checkpoint/save_seconds``, ``checkpoint/bytes``, ... and the checkpoint's path;
            see :mod:`accelkit.trackers.events`).
        save_every_steps: ``Accelerator.should_save()`` is True every this many optimizer
            steps since the last save (``None``: off). Must be >= 1.
        save_every_seconds: ``should_save()`` is True once this many seconds passed since the
            last save, measured on the main process and shared with every process (``None``:
            off).
        preemption_signals: signals (names like ``"SIGTERM"``, ``"SIGUSR1"``, or numbers) that
            mean "save and stop": their handler only sets a flag, every process agrees on it
            at the next step boundary, ``should_save()`` and
            ``Accelerator.preemption_requested`` turn True, and, with
            ``automatic_checkpoint_naming``, a script that never asks is saved at the prepared
            dataloader's next batch and exits with ``preemption_exit_code``. See
            ``docs/guides/preemption.md``.
        preemption_exit_code: the exit status of a process that stopped for a preemption after
            committing its checkpoint (default 75, ``EX_TEMPFAIL``); ``accelkit launch``
            passes it through.

    Example:
        >>> config = ProjectConfiguration(
        ...     project_dir="s3://bucket/run-7",
        ...     automatic_checkpoint_naming=True,
        ...     total_limit=3,
        ...     storage_options={"endpoint_url": "http://127.0.0.1:8333"},
        ... )
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    verify_checksums: bool = True
    async_save: bool = False
    continue_tracker_runs: bool = True
    checkpoint_events: bool = True
    # preemption (#25): save decisions and preemption signals (accelkit.runtime.preemption)
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    preemption_signals: tuple[str | int, ...] = ()
    preemption_exit_code: int = _preemption.DEFAULT_EXIT_CODE

    def __post_init__(self) -> None:
        self.project_dir = _as_location(self.project_dir)
        self.logging_dir = _as_location(self.logging_dir)
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int):
            raise ValueError(f"iteration must be an int >= 0, got {self.iteration!r}.")
        if self.iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {self.iteration}.")
        self.storage_options = dict(self.storage_options or {})
        self.retention_policy()  # validate the retention settings now, not at the first save
        if isinstance(self.preemption_signals, (str, int)):
            self.preemption_signals = (self.preemption_signals,)
        self.preemption_signals = tuple(self.preemption_signals or ())
        self.preemption_signal_numbers()  # the preemption settings too (#25)
        _preemption.check_interval("save_every_steps", self.save_every_steps, integer=True)
        _preemption.check_interval("save_every_seconds", self.save_every_seconds, integer=False)
        _preemption.check_exit_code(self.preemption_exit_code)
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike[str] | None = None) -> None:
        """Set ``project_dir``; ``logging_dir`` follows it unless it was given."""
        self.project_dir = _as_location(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir

    def preemption_signal_numbers(self) -> tuple[int, ...]:
        """The numbers of :attr:`preemption_signals`.

        Raises:
            ConfigurationError: naming a value that is no catchable signal (an unknown name,
                SIGKILL, SIGSTOP) and the fix.
        """
        return _preemption.parse_signals(self.preemption_signals)

    def retention_policy(self) -> RetentionPolicy:
        """The :class:`~accelkit.checkpointing.catalog.retention.RetentionPolicy` these settings
        make (:func:`~accelkit.checkpointing.catalog.retention.build_policy`, as ``ckpt prune``
        uses).

        Raises:
            ValueError: naming the bad setting (e.g. ``total_limit=0``).
        """
        try:
            return build_policy(
                keep_last=self.total_limit,
                keep_every=self.keep_every,
                keep_best=self.keep_best,
                metric=self.best_metric,
                mode=self.best_mode,
                names=_SETTING_NAMES,
            )
        except ValueError as exc:
            raise ValueError(f"ProjectConfiguration: {exc}") from None


_SETTING_NAMES = {
    "keep_last": "total_limit",
    "keep_every": "keep_every",
    "keep_best": "keep_best",
    "metric": "best_metric",
    "mode": "best_mode",
}


def resolve_project_configuration(
    project_config: ProjectConfiguration | None,
    project_dir: str | os.PathLike[str] | None = None,
    logging_dir: str | os.PathLike[str] | None = None,
) -> ProjectConfiguration:
    """The configuration ``Accelerator(project_config=, project_dir=, logging_dir=)`` means.

    ``project_dir``/``logging_dir`` fill in what ``project_config`` leaves unset.

    Raises:
        TypeError: if ``project_config`` is not a :class:`ProjectConfiguration`.
    """
    if project_config is None:
        return ProjectConfiguration(
            project_dir=_as_location(project_dir), logging_dir=_as_location(logging_dir)
        )
    if not isinstance(project_config, ProjectConfiguration):
        raise TypeError(
            f"project_config must be an accelkit ProjectConfiguration, got "
            f"{type(project_config).__name__}. Build one: "
            "from accelkit import ProjectConfiguration."
        )
    if logging_dir is not None and project_config.logging_dir is None:
        project_config.logging_dir = _as_location(logging_dir)
    if project_dir is not None and project_config.project_dir is None:
        project_config.set_directories(project_dir)
    return project_config
