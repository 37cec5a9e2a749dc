"""``ProjectConfiguration``: where a run's logs and checkpoints go, and how many are kept.

Accelerate's six fields, then one options object per concern: :class:`RetentionOptions`,
:class:`SaveOptions`, :class:`AsyncOptions`,
:class:`~accelkit.checkpointing.replication.options.ReplicationOptions`,
:class:`PreemptionOptions` and :class:`~accelkit.checkpointing.memory.options.MemoryOptions`.
The flat keywords of the 0.x releases (``keep_best=``, ``async_save=``, ``replicate_to=``...)
remain as aliases, both as keyword arguments and as attributes (:data:`FLAT_ALIASES` lists
them): they read and write the options' fields.

Public API: :class:`ProjectConfiguration`, the options classes, :data:`FLAT_ALIASES`,
:func:`resolve_project_configuration`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from accelkit._text import short
from accelkit._units import parse_bytes
from accelkit.checkpointing.catalog.retention import RetentionPolicy, build_policy
from accelkit.checkpointing.memory.options import MemoryOptions
from accelkit.checkpointing.replication.options import (
    RETENTION_SETTING_NAMES,
    ReplicationOptions,
)
from accelkit.errors import ConfigurationError, WrongTypeError
from accelkit.runtime import preemption as _preemption
from accelkit.runtime import saving as _saving

__all__ = [
    "FLAT_ALIASES",
    "AsyncOptions",
    "MemoryOptions",
    "PreemptionOptions",
    "ProjectConfiguration",
    "ReplicationOptions",
    "RetentionOptions",
    "SaveOptions",
    "resolve_project_configuration",
]


def _as_location(value: str | os.PathLike[str] | None) -> str | None:
    # URLs must stay strings: pathlib would collapse the "//" of "s3://".
    return None if value is None else os.fspath(value)


# The values of async_writer (accelkit.checkpointing.commit.async_save.WRITER_MODES).
_ASYNC_WRITERS = ("auto", "process", "thread")
# The values of async_snapshot (accelkit.checkpointing.commit.async_save.SNAPSHOT_MODES).
_ASYNC_SNAPSHOTS = ("blocking", "overlapped")


@dataclass
class RetentionOptions:
    """Which committed automatic checkpoints local retention keeps besides the newest
    ``total_limit`` (``ProjectConfiguration.retention``; each field is also a flat keyword of
    ``ProjectConfiguration`` of the same name).

    Args:
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
            warning says by how much the budget is exceeded. Checkpoints held back for the
            remote tier follow ``ReplicationOptions.local_budget_bytes``.
    """

    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_every_seconds: float | None = None
    keep_recent_seconds: float | None = None
    max_total_bytes: int | str | None = None


@dataclass
class SaveOptions:
    """When a run saves, and how its checkpoints' storage is trusted
    (``ProjectConfiguration.saving``).

    Args:
        every_steps: ``Accelerator.should_save()`` is True every this many optimizer steps
            since the last save (``None``: off). Must be >= 1. Flat alias:
            ``save_every_steps``.
        every_seconds: ``should_save()`` is True once this many seconds passed since the last
            save, measured on the main process and shared with every process (``None``: off).
            Flat alias: ``save_every_seconds``.
        verify_checksums: ``load_state`` checks every file against the manifest's checksums
            before restoring anything (``load_state(verify=False)`` skips it once). Flat alias:
            ``verify_checksums``.
        storage_retry_seconds: how long one storage operation of a direct remote save or load
            (``project_dir="s3://..."``) retries transient errors (connection refused or reset,
            timeouts, 5xx, throttling) before it fails; ``0`` disables it. Flat alias:
            ``storage_retry_seconds``.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    verify_checksums: bool = True
    storage_retry_seconds: float = 120.0


@dataclass
class AsyncOptions:
    """Asynchronous saves (``ProjectConfiguration.asynchronous``; see
    ``docs/guides/async-writer.md``).

    Args:
        enabled: ``save_state()`` copies the state to host memory and writes it in the
            background, returning a handle (see ``Accelerator.save_state``); costs one host
            copy of the saved tensors, reused across saves. Flat alias: ``async_save``.
        writer: who hashes and writes an asynchronous save's files. ``"auto"`` (the default):
            a persistent writer process at lower CPU and I/O priority, fed from a shared-memory
            snapshot (so the work does not compete with training for the GIL), wherever it can
            be used (Linux, local disk, shared memory available, state on the CPU), else a
            thread of the training process (state on a GPU: the snapshot is the device-to-host
            copy with either writer). ``"process"``: the process also for GPU state, with a
            warning when it falls back to the thread. ``"thread"``: always the thread (no extra
            process). Flat alias: ``async_writer``.
        snapshot: how an asynchronous save copies CPU state to host memory. ``"blocking"``
            (the default): ``save_state`` returns once every tensor is copied.
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
            ``"blocking"``. Flat alias: ``async_snapshot``.
    """

    enabled: bool = False
    writer: str = "auto"
    snapshot: str = "blocking"


@dataclass
class PreemptionOptions:
    """Save and stop on a preemption signal (``ProjectConfiguration.preemption``; see
    ``docs/guides/preemption.md``).

    Args:
        signals: signals (names like ``"SIGTERM"``, ``"SIGUSR1"``, or numbers) that mean "save
            and stop": their handler only sets a flag, every process agrees on it at the next
            step boundary, ``should_save()`` and ``Accelerator.preemption_requested`` turn
            True, and, with ``automatic_checkpoint_naming``, a script that never asks is saved
            at the prepared dataloader's next batch and exits with ``exit_code``. Flat alias:
            ``preemption_signals``.
        exit_code: the exit status of a process that stopped for a preemption after committing
            its checkpoint (default 75, ``EX_TEMPFAIL``); ``accelkit launch`` passes it
            through. Flat alias: ``preemption_exit_code``.
    """

    signals: tuple[str | int, ...] = ()
    exit_code: int = _preemption.DEFAULT_EXIT_CODE


#: The flat keywords of the 0.x releases -> (the ``ProjectConfiguration`` field holding the
#: options object, the option's name). Each is a keyword argument of ``ProjectConfiguration``
#: and an attribute that reads and writes the option.
FLAT_ALIASES: dict[str, tuple[str, str]] = {
    **{
        name: ("retention", name)
        for name in (
            "keep_every",
            "keep_best",
            "best_metric",
            "best_mode",
            "keep_every_seconds",
            "keep_recent_seconds",
            "max_total_bytes",
        )
    },
    "save_every_steps": ("saving", "every_steps"),
    "save_every_seconds": ("saving", "every_seconds"),
    "verify_checksums": ("saving", "verify_checksums"),
    "storage_retry_seconds": ("saving", "storage_retry_seconds"),
    "async_save": ("asynchronous", "enabled"),
    "async_writer": ("asynchronous", "writer"),
    "async_snapshot": ("asynchronous", "snapshot"),
    "replicate_to": ("replication", "to"),
    "replicate_keep": ("replication", "keep"),
    "replicate_deadline_seconds": ("replication", "deadline_seconds"),
    "replicate_queue_size": ("replication", "queue_size"),
    "replicate_local_budget_bytes": ("replication", "local_budget_bytes"),
    "replicate_preemption_seconds": ("replication", "preemption_seconds"),
    "preemption_signals": ("preemption", "signals"),
    "preemption_exit_code": ("preemption", "exit_code"),
    "memory_snapshot_every_steps": ("memory", "every_steps"),
}

# The options class of each options field.
_OPTIONS: dict[str, type[Any]] = {
    "retention": RetentionOptions,
    "saving": SaveOptions,
    "asynchronous": AsyncOptions,
    "replication": ReplicationOptions,
    "preemption": PreemptionOptions,
    "memory": MemoryOptions,
}

_T = TypeVar("_T")


class _Alias(Generic[_T]):
    """A flat name of the 0.x releases: reads and writes one option of an options field."""

    def __init__(self, group: str, name: str) -> None:
        self.group = group
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> _Alias[_T]: ...

    @overload
    def __get__(self, obj: object, owner: type[Any]) -> _T: ...

    def __get__(self, obj: object | None, owner: type[Any]) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.group), self.name)

    def __set__(self, obj: object, value: _T) -> None:
        setattr(getattr(obj, self.group), self.name, value)


@dataclass(init=False)
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
        retention: what local retention keeps besides the newest ``total_limit``
            (:class:`RetentionOptions`: ``keep_every``, ``keep_best``, ``best_metric``,
            ``best_mode``, ``keep_every_seconds``, ``keep_recent_seconds``,
            ``max_total_bytes``).
        saving: when to save and how storage is trusted (:class:`SaveOptions`:
            ``every_steps``, ``every_seconds``, ``verify_checksums``,
            ``storage_retry_seconds``).
        asynchronous: asynchronous saves (:class:`AsyncOptions`: ``enabled``, ``writer``,
            ``snapshot``).
        replication: the remote tier
            (:class:`~accelkit.checkpointing.replication.options.ReplicationOptions`: ``to``,
            ``keep``, ``deadline_seconds``, ``queue_size``, ``local_budget_bytes``,
            ``preemption_seconds``).
        preemption: save and stop on a signal (:class:`PreemptionOptions`: ``signals``,
            ``exit_code``).
        memory: the memory tier, snapshots in host memory for restarts in seconds
            (:class:`~accelkit.checkpointing.memory.options.MemoryOptions`: ``every_steps``).
        **flat: the flat names of the 0.x releases, aliases of the options' fields
            (:data:`FLAT_ALIASES`): ``keep_every``, ``keep_best``, ``best_metric``,
            ``best_mode``, ``keep_every_seconds``, ``keep_recent_seconds``,
            ``max_total_bytes``; ``save_every_steps``, ``save_every_seconds``,
            ``verify_checksums``, ``storage_retry_seconds``; ``async_save``,
            ``async_writer``, ``async_snapshot``; ``replicate_to``, ``replicate_keep``,
            ``replicate_deadline_seconds``, ``replicate_queue_size``,
            ``replicate_local_budget_bytes``, ``replicate_preemption_seconds``;
            ``preemption_signals``, ``preemption_exit_code``;
            ``memory_snapshot_every_steps``. Each is also an attribute that
            reads and writes its option (``config.replicate_to is config.replication.to``).
            A flat name given with its options object overrides that one option (the object
            passed is copied, never changed).

    Example:
        >>> config = ProjectConfiguration(
        ...     project_dir="s3://bucket/run-7",
        ...     automatic_checkpoint_naming=True,
        ...     total_limit=3,
        ...     storage_options={"endpoint_url": "http://127.0.0.1:8333"},
        ...     retention=RetentionOptions(keep_best=2, best_metric="loss"),
        ... )
        >>> config.keep_best  # the flat alias
        2

    Raises:
        TypeError: an unknown keyword, or an options field that is not its options class
            (or a mapping of its fields).
        ConfigurationError: a bad value, naming it and the fix.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    continue_tracker_runs: bool = True
    checkpoint_events: bool = True
    retention: RetentionOptions = field(default_factory=RetentionOptions)
    saving: SaveOptions = field(default_factory=SaveOptions)
    asynchronous: AsyncOptions = field(default_factory=AsyncOptions)
    replication: ReplicationOptions = field(default_factory=ReplicationOptions)
    preemption: PreemptionOptions = field(default_factory=PreemptionOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)

    # The flat names of the 0.x releases (FLAT_ALIASES): attributes, never dataclass fields.
    keep_every = _Alias[int | None]("retention", "keep_every")
    keep_best = _Alias[int | None]("retention", "keep_best")
    best_metric = _Alias[str | None]("retention", "best_metric")
    best_mode = _Alias[str]("retention", "best_mode")
    keep_every_seconds = _Alias[float | None]("retention", "keep_every_seconds")
    keep_recent_seconds = _Alias[float | None]("retention", "keep_recent_seconds")
    max_total_bytes = _Alias[int | str | None]("retention", "max_total_bytes")
    save_every_steps = _Alias[int | None]("saving", "every_steps")
    save_every_seconds = _Alias[float | None]("saving", "every_seconds")
    verify_checksums = _Alias[bool]("saving", "verify_checksums")
    storage_retry_seconds = _Alias[float]("saving", "storage_retry_seconds")
    async_save = _Alias[bool]("asynchronous", "enabled")
    async_writer = _Alias[str]("asynchronous", "writer")
    async_snapshot = _Alias[str]("asynchronous", "snapshot")
    replicate_to = _Alias[str | None]("replication", "to")
    replicate_keep = _Alias[int | Mapping[str, Any] | None]("replication", "keep")
    replicate_deadline_seconds = _Alias[float]("replication", "deadline_seconds")
    replicate_queue_size = _Alias[int]("replication", "queue_size")
    replicate_local_budget_bytes = _Alias[int | None]("replication", "local_budget_bytes")
    replicate_preemption_seconds = _Alias[float]("replication", "preemption_seconds")
    preemption_signals = _Alias[tuple[str | int, ...]]("preemption", "signals")
    preemption_exit_code = _Alias[int]("preemption", "exit_code")
    memory_snapshot_every_steps = _Alias[int | None]("memory", "every_steps")

    def __init__(
        self,
        project_dir: str | os.PathLike[str] | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        automatic_checkpoint_naming: bool = False,
        total_limit: int | None = None,
        iteration: int = 0,
        save_on_each_node: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        continue_tracker_runs: bool = True,
        checkpoint_events: bool = True,
        retention: RetentionOptions | Mapping[str, Any] | None = None,
        saving: SaveOptions | Mapping[str, Any] | None = None,
        asynchronous: AsyncOptions | Mapping[str, Any] | None = None,
        replication: ReplicationOptions | Mapping[str, Any] | None = None,
        preemption: PreemptionOptions | Mapping[str, Any] | None = None,
        memory: MemoryOptions | Mapping[str, Any] | None = None,
        **flat: Any,
    ) -> None:
        self.project_dir = _as_location(project_dir)
        self.logging_dir = _as_location(logging_dir)
        self.automatic_checkpoint_naming = automatic_checkpoint_naming
        self.total_limit = total_limit
        self.iteration = iteration
        self.save_on_each_node = save_on_each_node
        self.storage_options = dict(storage_options or {})
        self.continue_tracker_runs = continue_tracker_runs
        self.checkpoint_events = checkpoint_events
        given = {
            "retention": retention,
            "saving": saving,
            "asynchronous": asynchronous,
            "replication": replication,
            "preemption": preemption,
            "memory": memory,
        }
        for name, value in given.items():
            setattr(self, name, _options(name, value))
        unknown = sorted(set(flat) - set(FLAT_ALIASES))
        if unknown:
            raise WrongTypeError(
                f"ProjectConfiguration got unexpected keyword arguments {unknown}; it takes "
                f"its fields ({', '.join(f.name for f in dataclasses.fields(self))}) and the "
                f"flat aliases {', '.join(FLAT_ALIASES)}."
            )
        for name, value in flat.items():
            setattr(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int):
            raise ConfigurationError(f"iteration must be an int >= 0, got {self.iteration!r}.")
        if self.iteration < 0:
            raise ConfigurationError(f"iteration must be >= 0, got {self.iteration}.")
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
        _saving.check_interval(
            "memory_snapshot_every_steps",
            self.memory_snapshot_every_steps,
            integer=True,
            off="for no memory snapshots",
        )
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
        """The retention policy of the remote tier, from ``replicate_keep``
        (:meth:`ReplicationOptions.retention_policy`).

        Raises:
            ValueError: naming the bad key or value of ``replicate_keep``.
        """
        return self.replication.retention_policy()


_LOCAL_SETTING_NAMES = {
    **RETENTION_SETTING_NAMES,
    "keep_every_seconds": "keep_every_seconds",
    "keep_recent_seconds": "keep_recent_seconds",
    "max_total_bytes": "max_total_bytes",
}


def _options(name: str, value: Any) -> Any:
    """The options object of the field ``name``: ``value`` copied (a flat alias set next must
    not change the caller's object, which other configurations may share), built from a
    mapping of its fields, or the defaults for ``None``.

    Raises:
        TypeError: ``value`` is none of these, or a mapping with a key the class lacks.
    """
    cls = _OPTIONS[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if not unknown:
            return cls(**value)
        raise WrongTypeError(
            f"ProjectConfiguration: {name} has unknown keys {unknown}; {cls.__name__} takes "
            f"{', '.join(sorted(known))}."
        )
    raise WrongTypeError(
        f"ProjectConfiguration: {name} must be a {cls.__name__} (or a mapping of its fields), "
        f"got {type(value).__name__}; e.g. {name}={cls.__name__}()."
    )


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
