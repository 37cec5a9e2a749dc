"""``ProjectConfiguration``: where a run's logs and checkpoints go, and how many are kept."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelkit._text import short
from accelkit._units import parse_bytes
from accelkit.checkpointing.catalog.retention import RetentionPolicy, build_policy
from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.runtime import preemption as _preemption
from accelkit.runtime import saving as _saving

__all__ = ["ProjectConfiguration", "resolve_project_configuration"]


def _as_location(value: str | os.PathLike[str] | None) -> str | None:
    # URLs must stay strings: pathlib would collapse the "//" of "s3://".
    return None if value is None else os.fspath(value)


# The values of async_writer (accelkit.checkpointing.commit.async_save.WRITER_MODES).
_ASYNC_WRITERS = ("auto", "process", "thread")
# The values of async_snapshot (accelkit.checkpointing.commit.async_save.SNAPSHOT_MODES).
_ASYNC_SNAPSHOTS = ("blocking", "overlapped")


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
        keep_every_seconds: also keep one checkpoint in every window of this many seconds of
            the clock (the first committed in it, by the commit time its manifest records;
            windows start at multiples of it since the UNIX epoch, so ``3600`` keeps the first
            of every hour). ``None`` (the default): off.
        keep_recent_seconds: also keep every checkpoint committed in the last this many
            seconds (``None``: off). E.g. ``total_limit=3, keep_recent_seconds=3600,
            keep_every_seconds=86400``: the newest 3, all of the last hour, one a day.
        max_total_bytes: a byte budget for the checkpoints folder (an int, or a string like
            ``"500GB"``, ``"2TiB"``; ``None``, the default: none). Everything listed there
            counts; after the rules above, the oldest checkpoints they keep are deleted until
            the folder fits, never the newest committed checkpoint, never one the script named
            (``save_state(output_dir=...)``), nor folders accelkit did not write (Hugging Face
            accelerate's, foreign ones), corrupt or incomplete ones. If only those are left, a
            warning says by how much the budget is exceeded. Checkpoints held back for
            replication follow ``replicate_local_budget_bytes``.
        verify_checksums: ``load_state`` checks every file against the manifest's checksums
            before restoring anything (``load_state(verify=False)`` skips it once).
        async_save: ``save_state()`` copies the state to host memory and writes it in the
            background, returning a handle (see ``Accelerator.save_state``); costs one host
            copy of the saved tensors, reused across saves.
        async_writer: who hashes and writes an asynchronous save's files. ``"auto"`` (the
            default): a persistent writer process at lower CPU and I/O priority, fed from a
            shared-memory snapshot (so the work does not compete with training for the GIL),
            wherever it can be used (Linux, local disk, shared memory available, state on
            the CPU), else a thread of the training process (state on a GPU: the snapshot is
            the device-to-host copy with either writer). ``"process"``: the process also for
            GPU state, with a warning when it falls back to the thread. ``"thread"``: always
            the thread (no extra process).
            See docs/guides/async-writer.md.
        async_snapshot: how an asynchronous save copies CPU state to host memory.
            ``"blocking"`` (the default): ``save_state`` returns once every tensor is copied.
            ``"overlapped"``: it copies everything small or unguarded at once and leaves the
            large parameters and state tensors of the *prepared* optimizers to a background
            copy that overlaps the next forward and backward; the prepared optimizer's
            ``step()``, ``load_state``, the next ``save_state``, LocalSGD's averaging,
            ``free_memory``, ``wait_for_checkpoints``/``end_training`` and
            ``Accelerator.wait_for_snapshot()`` wait for that copy first. A deferred tensor
            changed by any other path before it was copied (in place, through ``.data``,
            ``numpy()``...) fails the save, never committed: its bytes are checked against a
            checksum taken in ``save_state`` (a read of them, about two thirds of the time of
            the copy it replaces). GPU and sharded (FSDP) state is always copied as with
            ``"blocking"``. See docs/guides/async-writer.md.
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
        replicate_to: a second, remote tier (any fsspec URL, ``s3://bucket/run``; reached with
            ``storage_options``). Each committed automatic checkpoint under ``project_dir``
            (the local tier) is copied there by a background thread, its manifest written
            last; a storage outage is retried, never fatal. See ``docs/guides/replication.md``.
        replicate_keep: retention on the remote tier: ``None`` keeps every replicated
            checkpoint; an int keeps the newest N; a mapping takes the local settings' names
            (``{"total_limit": 5, "keep_every": 1000, "keep_best": 2, "best_metric": "loss",
            "best_mode": "min"}``), with the same rules.
        replicate_deadline_seconds: how long ``end_training()`` (and interpreter exit) waits
            for the replication queue to drain; what is left is named in a warning, and the
            process exits without waiting for an upload in flight. Once a preemption signal
            arrived, ``replicate_preemption_seconds`` holds instead.
        replicate_queue_size: checkpoints waiting for replication beyond the one in flight;
            when the queue is full, intermediate ones are skipped (never the newest, never one
            the remote retention keeps).
        replicate_local_budget_bytes: the most bytes of local checkpoints that local
            retention holds back because they are not replicated yet (``None``, the default:
            no limit besides ``replicate_queue_size``). Retention (``total_limit``/``keep_*``)
            keeps a checkpoint it would delete until it reaches the remote tier; with the
            remote tier down, those pile up on the local disk. When they would exceed this
            budget, the oldest of them is deleted anyway (never the newest checkpoint, never
            one whose copy is in flight) and that is said once per checkpoint: a warning
            naming it and a ``checkpoint/replication_dropped`` tracker event. ``0`` holds
            nothing back.
        storage_retry_seconds: how long one storage operation of a direct remote save
            (``project_dir="s3://..."``) retries transient errors (connection refused or
            reset, timeouts, 5xx, throttling) before the save fails; ``0`` disables it.
        replicate_preemption_seconds: with ``preemption_signals`` and ``replicate_to``, how
            long a preemption exit waits for the checkpoints still queued (its own included) to
            reach the remote tier before the process exits; the log says whether they did.
            ``end_training()`` keeps to it too once a preemption signal arrived (a script that
            saves and exits by itself).
            Keep it inside the grace period (see ``docs/guides/preemption.md``).
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
    # retention by time and space (#42)
    keep_every_seconds: float | None = None
    keep_recent_seconds: float | None = None
    max_total_bytes: int | str | None = None
    verify_checksums: bool = True
    async_save: bool = False
    async_writer: str = "auto"
    async_snapshot: str = "blocking"
    continue_tracker_runs: bool = True
    checkpoint_events: bool = True
    # replication (#26)
    replicate_to: str | None = None
    replicate_keep: int | Mapping[str, Any] | None = None
    replicate_deadline_seconds: float = 300.0
    replicate_queue_size: int = 4
    replicate_local_budget_bytes: int | None = None
    storage_retry_seconds: float = 120.0
    replicate_preemption_seconds: float = 60.0
    # preemption (#25): save decisions and preemption signals (accelkit.runtime.preemption)
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    preemption_signals: tuple[str | int, ...] = ()
    preemption_exit_code: int = _preemption.DEFAULT_EXIT_CODE

    def __post_init__(self) -> None:
        self.project_dir = _as_location(self.project_dir)
        self.logging_dir = _as_location(self.logging_dir)
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int):
            raise ConfigurationError(f"iteration must be an int >= 0, got {self.iteration!r}.")
        if self.iteration < 0:
            raise ConfigurationError(f"iteration must be >= 0, got {self.iteration}.")
        self.storage_options = dict(self.storage_options or {})
        if self.async_writer not in _ASYNC_WRITERS:
            raise ConfigurationError(
                f"ProjectConfiguration: async_writer must be one of "
                f"{', '.join(map(repr, _ASYNC_WRITERS))}, got {short(self.async_writer)}; e.g. "
                "async_writer='thread' to write asynchronous saves in a thread of the training "
                "process."
            )
        if self.async_snapshot not in _ASYNC_SNAPSHOTS:
            raise ConfigurationError(
                f"ProjectConfiguration: async_snapshot must be one of "
                f"{', '.join(map(repr, _ASYNC_SNAPSHOTS))}, got {short(self.async_snapshot)}; "
                "e.g. async_snapshot='overlapped' to copy the optimizer's parameters and state "
                "during the next step, or 'blocking' (the default) to copy everything before "
                "save_state returns."
            )
        if isinstance(self.max_total_bytes, str):
            try:
                self.max_total_bytes = parse_bytes(self.max_total_bytes, "max_total_bytes")
            except ValueError as exc:
                raise ConfigurationError(
                    f"ProjectConfiguration: {exc} E.g. max_total_bytes='500GB', or None for no "
                    "budget."
                ) from None
        self.retention_policy()  # validate the retention settings now, not at the first save
        self._check_replication()
        if isinstance(self.preemption_signals, (str, int)):
            self.preemption_signals = (self.preemption_signals,)
        self.preemption_signals = tuple(self.preemption_signals or ())
        self.preemption_signal_numbers()  # the preemption settings too (#25)
        _saving.check_interval("save_every_steps", self.save_every_steps, integer=True)
        _saving.check_interval("save_every_seconds", self.save_every_seconds, integer=False)
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
        # Parsed once per value (here, when the configuration is made), whoever asks later.
        signals = self.preemption_signals
        parsed = self.__dict__.get("_parsed_signals")
        if parsed is None or parsed[0] != signals:
            parsed = self.__dict__["_parsed_signals"] = (
                signals,
                _preemption.parse_signals(signals),
            )
        return parsed[1]

    def retention_policy(self) -> RetentionPolicy:
        """The :class:`~accelkit.checkpointing.catalog.retention.RetentionPolicy` these settings
        make (:func:`~accelkit.checkpointing.catalog.retention.build_policy`, as ``ckpt prune``
        uses).

        Raises:
            ValueError: naming the bad setting (e.g. ``total_limit=0``).
        """
        budget = self.max_total_bytes
        try:
            return build_policy(
                keep_last=self.total_limit,
                keep_every=self.keep_every,
                keep_best=self.keep_best,
                metric=self.best_metric,
                mode=self.best_mode,
                names=_LOCAL_SETTING_NAMES,
                keep_every_seconds=self.keep_every_seconds,
                keep_recent_seconds=self.keep_recent_seconds,
                # a string was parsed in __post_init__; one set since is parsed here
                max_total_bytes=(
                    parse_bytes(budget, "max_total_bytes") if isinstance(budget, str) else budget
                ),
            )
        except ValueError as exc:
            raise ConfigurationError(f"ProjectConfiguration: {exc}") from None

    def _check_replication(self) -> None:
        self.replicate_to = _as_location(self.replicate_to)
        if self.replicate_to is not None and self.replicate_to.rstrip("/") == (
            self.project_dir or ""
        ).rstrip("/"):
            raise ConfigurationError(
                f"ProjectConfiguration: replicate_to={self.replicate_to!r} is project_dir "
                "itself; give the remote tier a location of its own (e.g. s3://bucket/run)."
            )
        for name in (
            "replicate_deadline_seconds",
            "storage_retry_seconds",
            "replicate_preemption_seconds",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigurationError(
                    f"ProjectConfiguration: {name} must be a number of seconds >= 0, got "
                    f"{short(value)}; e.g. {name}=60."
                )
        size = self.replicate_queue_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(
                f"ProjectConfiguration: replicate_queue_size must be an int >= 1, got {size!r}."
            )
        budget = self.replicate_local_budget_bytes
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 0
        ):
            raise ConfigurationError(
                f"ProjectConfiguration: replicate_local_budget_bytes must be None (no limit) or "
                f"an int number of bytes >= 0, got {short(budget)}; e.g. "
                "replicate_local_budget_bytes=50 * 2**30 for 50 GiB."
            )
        self.remote_retention_policy()

    def remote_retention_policy(self) -> RetentionPolicy:
        """The retention policy of the remote tier, from ``replicate_keep``.

        Raises:
            ValueError: naming the bad key or value of ``replicate_keep``.
        """
        keep = self.replicate_keep
        if keep is None:
            settings: dict[str, Any] = {}
        elif isinstance(keep, bool) or not isinstance(keep, (int, Mapping)):
            raise ConfigurationError(
                f"ProjectConfiguration: replicate_keep must be None, an int (keep the newest N) "
                f"or a mapping with keys {', '.join(_SETTING_NAMES.values())}; got {keep!r}."
            )
        elif isinstance(keep, int):
            settings = {"keep_last": keep}
        else:
            reverse = {v: k for k, v in _SETTING_NAMES.items()}
            unknown = sorted(str(k) for k in keep if k not in reverse)
            if unknown:
                raise ConfigurationError(
                    f"ProjectConfiguration: replicate_keep has unknown keys {unknown}; valid "
                    f"keys: {', '.join(_SETTING_NAMES.values())}."
                )
            settings = {reverse[k]: v for k, v in keep.items()}
        names = {k: f"replicate_keep[{v!r}]" for k, v in _SETTING_NAMES.items()}
        if isinstance(keep, int):
            names["keep_last"] = "replicate_keep"
        try:
            return build_policy(
                keep_last=settings.get("keep_last"),
                keep_every=settings.get("keep_every"),
                keep_best=settings.get("keep_best"),
                metric=settings.get("metric"),
                mode=settings.get("mode", "min"),
                names=names,
            )
        except ValueError as exc:
            raise ConfigurationError(f"ProjectConfiguration: {exc}") from None


# The settings replicate_keep takes too (the remote tier's retention runs without a clock or a
# byte budget).
_SETTING_NAMES = {
    "keep_last": "total_limit",
    "keep_every": "keep_every",
    "keep_best": "keep_best",
    "metric": "best_metric",
    "mode": "best_mode",
}
_LOCAL_SETTING_NAMES = {
    **_SETTING_NAMES,
    "keep_every_seconds": "keep_every_seconds",
    "keep_recent_seconds": "keep_recent_seconds",
    "max_total_bytes": "max_total_bytes",
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
        raise WrongTypeError(
            f"project_config must be an accelkit ProjectConfiguration, got "
            f"{type(project_config).__name__}. Build one: "
            "from accelkit import ProjectConfiguration."
        )
    if logging_dir is not None and project_config.logging_dir is None:
        project_config.logging_dir = _as_location(logging_dir)
    if project_dir is not None and project_config.project_dir is None:
        project_config.set_directories(project_dir)
    return project_config
