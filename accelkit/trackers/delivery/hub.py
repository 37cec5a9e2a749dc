"""`TrackerHub`: one ``log()`` call fanned out to every tracker, off the training loop's path.

Each started tracker gets its own worker thread and queue. ``log()`` on the caller's thread only
snapshots the values (:func:`accelkit.trackers.values.snapshot`) and puts them on each queue, so
a slow backend (an MLflow server, a TensorBoard flush) never blocks the training step, and a
hung one never delays the others. Each worker calls its tracker in the order ``log()`` was
called, with the same steps.

A tracker that raises in ``start``, ``store_init_configuration``, ``log`` or ``finish`` is
reported once (a :class:`TrackerWarning` naming it and the error) and skipped from then on; the
other trackers and the training run go on. With ``on_error="raise"`` the failure is raised as a
:class:`TrackerError`: at once from ``init`` when the runs open there, and from the next
``log``/``flush``/``finish`` call for failures that happen in a worker (a run opened at its
first use included, see "Continuing runs"). When every tracker of the run has failed, one
error-level log record (logger ``accelkit.trackers``) says so, naming each of them: training
goes on, but nothing is being logged any more.
These decisions are :class:`~accelkit.trackers.delivery.failures.FailurePolicy`'s: the hub
creates one and hands it to every tracker's worker, which reports to it (never to the hub).

No wait is unbounded. ``start`` and ``store_init_configuration`` run on the tracker's worker
thread, and the hub waits at most ``timeout`` seconds for each tracker to open its run (in
``init``, or at the first wait after a lazy opening); ``finish()`` (called by
``Accelerator.end_training``) and interpreter exit drain the queues within ``timeout`` seconds.
A backend that does not return in time is reported like a failure and left behind (its worker
is a daemon thread).

Steps: ``log(values)`` without a ``step`` logs at the hub's own step counter, which starts at 0
for each run (each ``init``) and advances by one per ``log()`` call; a ``log()`` with an explicit
``step`` sets the counter, so the next call without one logs at ``step + 1``. There is one
counter per hub, so every tracker records a call at the same step (left to each backend,
TensorBoard and MLflow would put every point at step 0 and W&B would count on its own). W&B's
``commit=False`` (several calls filling one row) therefore needs the same explicit ``step`` on
each of those calls.

Continuing runs: when a job resumes from a checkpoint, :meth:`TrackerHub.resume` hands each
tracker the reference its run left in the checkpoint (``continue_run`` before ``start``) and
sets the step counter past the checkpoint's last logged step. That works whichever of
``init_trackers`` and ``load_state`` comes first because, with ``defer_start`` (what
``Accelerator`` uses unless ``ProjectConfiguration(continue_tracker_runs=False)``), ``init``
only builds the trackers ``log_with`` named and their runs are opened at their first use: the
first ``log``, ``flush``, ``get``, ``trackers``, a checkpoint save, or ``finish``. A start
failure is then reported at that use, like a failure in ``log``. Tracker instances given to
``log_with`` are started by ``init``, as Accelerate does (their owner may call their methods
right after ``init_trackers``); a ``load_state`` before anything was logged makes each that
continues runs give up the run it opened for the checkpoint's (``finish``, then
``discard_run``, which deletes a run holding nothing but its configuration, then
``continue_run`` and ``start``). A job that forks the checkpoint (``resume(..., fork=True)``)
gets ``fork_run`` instead of ``continue_run``: new runs under a new key, linked to the
checkpoint's, which are left as they are. :meth:`TrackerHub.references` gives the
references for a new checkpoint (see "Run keys") and :meth:`TrackerHub.event` queues a
checkpoint event (:mod:`accelkit.trackers.events`) for every tracker's worker.

Run keys: each run has a key chosen by the hub (:attr:`TrackerHub.run_key`: new at ``init``, the
checkpoint's own when a job resumes from one), handed to each tracker's ``name_run`` before its
run opens. The tracker maps the key to its backend's run (W&B's run id, Comet's experiment key,
an MLflow run tag) and returns that run's reference at once, so a checkpoint names every run
from the first save without waiting for any backend's start-up, and a job killed at any moment
resumes into the same runs. A tracker that records its runs (``run_reference``) but cannot
name one before it opens (no ``name_run``) is waited for at a save instead, at most
``timeout`` seconds.

Journal: with a logging directory, each tracker's worker keeps a journal of what it sends
(:mod:`accelkit.trackers.delivery.journal`): a backend that raises is retried with backoff
and caught up from its last acknowledged entry rather than skipped, and what a run could not
deliver is sent later by ``accelkit track sync``. ``journal=False`` (or
``ACCELKIT_TRACKER_JOURNAL=0``) turns it off.

Pickling: a hub pickles (``Accelerator`` objects are pickled, by Accelerate's own tests among
others) without its threads, locks, queues or started trackers, which belong to the process that
started them. The copy is detached: ``log`` and ``flush`` do nothing, ``get`` returns a stand-in
whose methods do nothing for every requested tracker, and ``init`` refuses to start a second set
of trackers writing the same run. See :meth:`TrackerHub.__getstate__`.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from accelkit._env import number, switch
from accelkit._text import short
from accelkit.delivery.exit import TRACKERS, ExitHook, at_exit, move_last
from accelkit.errors import ConfigurationError, UsageError, WrongTypeError
from accelkit.trackers.base import GeneralTracker, NullTracker
from accelkit.trackers.delivery.failures import (
    FailurePolicy,
    TrackerError,
    TrackerFailure,
    TrackerWarning,
)
from accelkit.trackers.delivery.items import JournalSettings, Log, Mark, Stop
from accelkit.trackers.delivery.options import TrackerOptions
from accelkit.trackers.delivery.roster import Roster
from accelkit.trackers.delivery.runs import RunPlan, references
from accelkit.trackers.delivery.waits import wait_for, wait_opened
from accelkit.trackers.delivery.worker import Worker
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.registry import constructor_arguments, resolve_log_with
from accelkit.trackers.values import snapshot

__all__ = ["TrackerError", "TrackerFailure", "TrackerHub", "TrackerWarning"]


class TrackerHub:
    """The trackers of one run.

    Build it with :meth:`create`; ``Accelerator`` does this from ``log_with``.

    Args:
        specs: tracker classes (built in ``init``) and user-made instances.
        logging_dir: the run's logging directory, or ``None``.
        is_main_process: whether this process is the main one; main-process-only trackers are
            never created elsewhere.
        on_error: ``"warn"`` or ``"raise"`` (see the module docstring).
        timeout: the most seconds ``flush``/``finish`` wait for a tracker.
        defer_start: open the backends' runs at the first use after ``init`` rather than in
            it (see "Continuing runs" in the module docstring).
        journal: keep each tracker's journal under ``logging_dir`` (see "Journal" in the
            module docstring); ``None``: on unless ``ACCELKIT_TRACKER_JOURNAL=0``. Without a
            logging directory there is no journal.
    """

    def __init__(
        self,
        specs: list[type[GeneralTracker] | GeneralTracker],
        *,
        logging_dir: str | None,
        is_main_process: bool,
        on_error: str = "warn",
        timeout: float = 60.0,
        defer_start: bool = False,
        journal: bool | None = None,
        options: TrackerOptions | None = None,
    ) -> None:
        options = options or TrackerOptions()
        self.journal = _journal_on(journal, options) and logging_dir is not None
        self._journal_max_bytes = (
            None if options.journal_max_mb is None else int(options.journal_max_mb * 2**20)
        )
        self._policy = FailurePolicy(
            on_error,
            timeout=timeout,
            max_pending=options.max_pending,
            drain=options.drain_seconds,
            on_skip=self._drop_failed,
            retry_max=options.retry_max_seconds,
        )
        self.logging_dir = logging_dir
        self.is_main_process = is_main_process
        self.requested_names = [spec.name for spec in specs]
        self._specs = [s for s in specs if is_main_process or not s.main_process_only]
        self._exit = _ExitHook(self._drain_at_exit)  # finish() at interpreter exit
        self._detached = False  # an unpickled copy: no trackers of its own
        self.defer_start = defer_start
        self._runs = RunPlan()  # the run key, a loaded checkpoint's runs, early events
        self._roster = Roster(self._runs, self._policy)  # the workers, when each run opens

    @classmethod
    def create(
        cls,
        log_with: Any,
        *,
        logging_dir: str | os.PathLike[str] | None = None,
        is_main_process: bool = True,
        on_error: str = "warn",
        timeout: float | None = None,
        defer_start: bool = False,
        journal: bool | None = None,
        options: TrackerOptions | None = None,
    ) -> TrackerHub:
        """Check ``log_with`` and build the hub (nothing is started until :meth:`init`).

        Args:
            log_with: ``None``, a name, ``"all"``, a `GeneralTracker` instance or a list of those.
            logging_dir: the run's logging directory, or ``None``.
            is_main_process: whether this process is the main one.
            on_error: ``"warn"`` (default) or ``"raise"``.
            timeout: the most seconds ``flush``/``finish`` wait for the trackers; default
                ``ACCELKIT_TRACKER_TIMEOUT`` or 60.
            defer_start: open the backends' runs at their first use, not in ``init``.
            journal: keep a journal per tracker (``None``: ``options.journal``, else
                ``ACCELKIT_TRACKER_JOURNAL``, on by default).
            options: the waits, retries and journal (:class:`TrackerOptions`); ``timeout`` and
                ``journal``, when given, win over its fields.

        Raises:
            ValueError: an unknown name (the message lists the available ones), a tracker that
                needs a logging directory without one, or a bad ``on_error``.
            ImportError: a tracker whose package is missing (the message has the pip command).
        """
        directory, remote = _local_folder(logging_dir)
        specs = resolve_log_with(log_with, directory, remote_logging_dir=remote)
        if options is not None and not isinstance(options, TrackerOptions):
            raise WrongTypeError(
                f"tracker_options={short(options)}: expected a TrackerOptions "
                "(from accelkit import TrackerOptions)."
            )
        if timeout is None and options is not None:
            timeout = options.timeout
        if timeout is None:
            timeout = number("ACCELKIT_TRACKER_TIMEOUT")
        return cls(
            specs,
            logging_dir=directory,
            is_main_process=is_main_process,
            on_error=on_error,
            timeout=timeout,
            defer_start=defer_start,
            journal=journal,
            options=options,
        )

    def __getstate__(self) -> dict[str, Any]:
        """The hub's settings, without what belongs to this process.

        Worker threads, their queues, locks, the started trackers (open files, network runs)
        and the tracker instances given to ``log_with`` stay behind (the roster pickles
        empty), as do recorded failures (their exceptions may not pickle: the policy pickles
        its settings only). The copy keeps the settings, the requested tracker names and the
        step counter, and is detached (see the module docstring).
        """
        state = self.__dict__.copy()
        state.update(_specs=[], _exit=None, _detached=True)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a detached copy (see :meth:`__getstate__`)."""
        self.__dict__.update(state)
        self._exit = _ExitHook(self._drain_at_exit)

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The started trackers of this process, failed ones included (their runs are opened
        first if they were not yet)."""
        self._roster.open(wait=True)
        wait_opened(self._roster.live, self.timeout)
        return [worker.tracker for worker in self._roster.workers]

    @property
    def run_key(self) -> str | None:
        """The key of this run (see "Run keys" in the module docstring); ``None`` before
        ``init``."""
        return self._runs.key

    @property
    def failures(self) -> list[TrackerFailure]:
        """Every tracker failure reported so far."""
        return self._policy.failures

    @property
    def on_error(self) -> str:
        """``"warn"`` or ``"raise"``: what a tracker failure does (see the module docstring)."""
        return self._policy.on_error

    @property
    def timeout(self) -> float:
        """The most seconds a run may take to open and ``flush``/``finish`` wait by default."""
        return self._policy.timeout

    @property
    def max_pending(self) -> int:
        """How many values may wait for a hung tracker before it is skipped."""
        return self._policy.max_pending

    def _limit(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _drop_failed(self) -> None:
        """Stop feeding failed trackers (the policy's ``on_skip``)."""
        self._roster.drop_failed()

    def init(
        self,
        project_name: str,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Create and start every tracker of this process and store ``config``.

        Args:
            project_name: the run / project name each tracker receives.
            config: hyperparameters to store (nested dicts, lists, tensors, paths and ``None``
                are accepted).
            init_kwargs: tracker name -> keyword arguments for that tracker's constructor.

        Raises:
            RuntimeError: trackers are already running (call ``end_training()`` first), or this
                hub is an unpickled copy (start the trackers in the original process).
            TrackerError: a tracker failed and ``on_error="raise"``.
        """
        if self._detached:
            raise UsageError(
                "init_trackers() was called on an unpickled copy of an Accelerator: its trackers "
                "(if any) run in the process that pickled it, and a copy starting its own would "
                "write the same run twice. Call init_trackers() on the original Accelerator, or "
                "create a new Accelerator in this process."
            )
        if self._roster.workers:
            raise UsageError(
                "init_trackers() was already called for this run; call end_training() before "
                "starting new trackers."
            )
        init_kwargs = dict(init_kwargs or {})
        self._runs.begin()
        self._policy.begin_run({spec.name for spec in self._specs})
        unknown = sorted(set(init_kwargs) - {spec.name for spec in self._specs})
        if unknown and self.is_main_process:
            warnings.warn(
                f"init_kwargs has entries for {unknown}, which are not trackers of this run "
                f"({[spec.name for spec in self._specs]}); they are ignored.",
                stacklevel=3,
            )
        self._roster.config = config
        journal = self.logging_dir if self.journal else None
        rank = None if self.is_main_process else os.environ.get("RANK", "0")
        built = _build(self._specs, project_name, init_kwargs, self.logging_dir, self._policy)
        for tracker in built:  # a worker per tracker as it is built (a failure may raise)
            worker = Worker(
                tracker,
                self._policy,
                _journal_settings(
                    journal, rank, tracker, project_name, init_kwargs, self._journal_max_bytes
                ),
            )
            worker.session.on_started = self._exit.move_last
            self._roster.add(worker)
        if not self.defer_start:
            self._roster.open(wait=True)
        else:
            self._roster.open_deferred(self._specs)
        if self._roster.workers:
            self._exit.arm()
        self._policy.raise_pending()

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        log_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Hand ``values`` at ``step`` to every live tracker and return without waiting.

        Args:
            values: metric name -> value; tensors are copied or read before this returns.
            step: the training step. ``None`` (the default) logs at the hub's counter: 0 for
                the run's first call, then one more per ``log()`` call; an explicit ``step``
                sets the counter, so the next call without one logs at ``step + 1``. Every
                tracker receives the same step.
            log_kwargs: tracker name -> keyword arguments for that tracker's ``log``.

        Raises:
            TrackerError: an earlier failure, with ``on_error="raise"``.
        """
        step = self._runs.advance(step)
        if self._roster.unstarted:  # the run's first use: open the backends' runs now
            self._roster.open(wait=False)
        live = self._roster.live
        if not live:
            if self._policy.pending is not None:
                self._policy.raise_pending()
            return
        policy = self._policy
        if policy.pending is not None:
            policy.raise_pending()
        copied, pending = snapshot(values)
        for worker in live:
            kwargs = log_kwargs.get(worker.name) if log_kwargs else None
            item: Log = (copied, step, kwargs, pending)
            worker.log(item)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every value logged so far has reached its tracker.

        Args:
            timeout: the most seconds to wait in all (default: the hub's ``timeout``).

        Returns:
            ``True`` if every live tracker caught up; ``False`` if one did not in time (it is
            reported with a warning and left running).

        Raises:
            TrackerError: a failure, with ``on_error="raise"``.
        """
        self._roster.open(wait=False)
        done = wait_for(list(self._roster.live), Mark, self._limit(timeout), self._policy, "flush")
        self._policy.raise_pending()
        return done

    def finish(self, timeout: float | None = None) -> bool:
        """Drain every queue, finish every tracker and stop the workers.

        Args:
            timeout: the most seconds to wait in all (default: the hub's ``timeout``).

        Returns:
            ``True`` if every tracker finished in time.

        Raises:
            TrackerError: a failure, with ``on_error="raise"``.
        """
        self._roster.open(wait=False)  # a run with only its configuration is still a run
        workers = self._roster.take()
        self._runs.end()
        self._exit.disarm()
        done = wait_for(workers, Stop, self._limit(timeout), self._policy, "finish")
        self._policy.raise_pending()
        return done

    def _drain_at_exit(self) -> None:
        try:
            self.finish()
        except TrackerError as error:
            self._policy.unraised(error)

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (or its backend object with ``unwrap=True``).

        Values logged so far are flushed first, so the backend object is up to date. Where the
        tracker does not exist because this is not the main process, or because this hub is an
        unpickled copy, a stand-in whose methods do nothing is returned.

        Raises:
            ValueError: no tracker of this run has this name.
        """
        self._roster.open(wait=False)
        for worker in self._roster.workers:
            if worker.name == name:
                wait_for([worker], Mark, self.timeout, self._policy, "flush")
                return worker.tracker.tracker if unwrap else worker.tracker
        if name in self.requested_names and (self._detached or not self.is_main_process):
            stand_in = NullTracker(name)
            return stand_in.tracker if unwrap else stand_in
        started = [worker.name for worker in self._roster.workers]
        hint = "" if started else " Call accelerator.init_trackers(...) first."
        raise ConfigurationError(
            f"No tracker named {name!r} in this run; the trackers are {started or 'none'} "
            f"(log_with asked for {self.requested_names}).{hint}"
        )

    # ------------------------------------------------------------------ checkpoints

    @property
    def last_step(self) -> int:
        """The step of the last ``log()`` call of this run (``-1`` before the first)."""
        return self._runs.next_step - 1

    def references(self) -> dict[str, dict[str, Any]]:
        """Tracker name -> the reference of its run, for a checkpoint's manifest, named
        without waiting for a backend where the tracker can (:func:`~accelkit.trackers.
        delivery.runs.references`). Opens the runs not opened yet (a checkpoint saved before
        the first ``log()``)."""
        self._roster.open(wait=False)
        return references(self._roster.live, self.timeout)

    def resume(
        self,
        runs: Mapping[str, Any],
        step: int,
        key: str | None = None,
        forked_from: Mapping[str, Any] | None = None,
        *,
        fork: bool = False,
    ) -> bool:
        """Continue (``fork``: fork) the runs a loaded checkpoint names, after its last
        logged ``step`` (see "Continuing runs" above): the step counter goes to ``step + 1``,
        the run key to ``key``; runs already logging are left alone (a checkpoint loaded
        mid-run, to evaluate it, keeps the curves so far).

        Args:
            runs: tracker name -> the reference the checkpoint recorded for it.
            step: the checkpoint's last logging step (``-1``: nothing was logged before it).
            key: the checkpoint's run key (``None``: a checkpoint from before run keys; the
                run keeps its own); with ``fork``, the new runs' key.
            forked_from: the fork the runs descend from, stored in their configuration as
                :data:`~accelkit.trackers.delivery.runs.FORKED_FROM`; ``None``: none.
            fork: open new runs forked from the checkpoint's.

        Returns:
            Whether the runs will be continued (or forked): not once this run logged.
        """
        if self.logging or self._detached:
            return False
        given_up = self._roster.give_up(self.timeout)  # the instances init started
        # A run is named once a tracker's opening was queued (init, then a first use).
        self._runs.continue_from(
            runs, step, key, named=self._roster.named, forked=forked_from, fork=fork
        )
        self._roster.open(wait=True, only=given_up)  # usable when load_state returns
        return True

    @property
    def logging(self) -> bool:
        """Whether this run logged already (its runs then stay as they are on a load)."""
        return self._runs.logged

    def event(self, event: CheckpointEvent) -> None:
        """Queue a checkpoint event for every live tracker (``on_checkpoint``) and return.

        Safe to call from any thread (an asynchronous save's writer calls it after the commit).
        An event before the runs are open (a ``load_state`` before ``init_trackers`` or before
        the first ``log``) is kept and delivered right after they open.
        """
        self._roster.deliver(event, expected=bool(self._specs))


def _journal_on(journal: bool | None, options: TrackerOptions) -> bool:
    """Whether to keep journals: ``journal``, else ``options.journal``, else
    ``ACCELKIT_TRACKER_JOURNAL`` (on by default)."""
    if journal is None:
        journal = options.journal
    return bool(switch("ACCELKIT_TRACKER_JOURNAL") if journal is None else journal)


def _local_folder(logging_dir: str | os.PathLike[str] | None) -> tuple[str | None, str | None]:
    """``(the local logging folder, the URL it was set to)``: trackers write local files, so
    a remote ``project_dir`` leaves them without a folder (a ``file://`` URL is local)."""
    directory = None if logging_dir is None else os.fspath(logging_dir)
    if directory is None or "://" not in directory:
        return directory, None
    if directory.startswith("file://"):
        return directory[len("file://") :], None
    return None, directory


def _build(
    specs: list[type[GeneralTracker] | GeneralTracker],
    project_name: str,
    init_kwargs: Mapping[str, Mapping[str, Any]],
    logging_dir: str | None,
    policy: FailurePolicy,
) -> Iterator[GeneralTracker]:
    """The trackers of ``specs``, built one by one (instances as given). Every class is
    checked against its call before any is built; one whose construction raises is reported
    to ``policy`` (raised at once with ``on_error="raise"``) and left out."""
    calls = []
    for spec in specs:
        arguments = None
        if not isinstance(spec, GeneralTracker):
            kwargs = init_kwargs.get(spec.name, {})
            arguments = constructor_arguments(spec, project_name, logging_dir, kwargs)
        calls.append((spec, arguments))
    for spec, arguments in calls:
        if isinstance(spec, GeneralTracker):
            yield spec
            continue
        args, named = arguments or ((), {})
        try:
            tracker = spec(*args, **named)
        except Exception as error:
            policy.report(TrackerFailure(spec.name, "__init__", error))
            policy.raise_pending()
            continue
        yield tracker


def _journal_settings(
    logging_dir: str | None,
    rank: str | None,
    tracker: GeneralTracker,
    project_name: str,
    init_kwargs: Mapping[str, Mapping[str, Any]],
    max_bytes: int | None,
) -> JournalSettings | None:
    """Where ``tracker``'s journal goes (``logging_dir``: ``None`` without journals; ``rank``:
    ``None`` on the main process) and the run ``accelkit track sync`` needs."""
    if logging_dir is None:
        return None
    name = tracker.name if rank is None else f"{tracker.name}.rank{rank}"
    run: dict[str, Any] = {"tracker": tracker.name, "project_name": project_name}
    if init_kwargs.get(tracker.name):
        run["init_kwargs"] = init_kwargs[tracker.name]
    return JournalSettings(logging_dir, name, run, max_bytes)


class _ExitHook:
    """The hub's ``finish`` at interpreter exit, registered once the trackers are made.

    It is the last of accelkit's exit drains (:mod:`accelkit.delivery.exit`: after the saves
    in flight and the replication queue, whose checkpoint events it delivers), which run
    before ``atexit``'s hooks, so the backends' own exit hooks (wandb's tears its service down,
    after which ``finish()`` fails with "Connection lost") run after it and their runs still
    accept values. After each ``start()`` the drains move behind any threading exit hook the
    backend registered (:meth:`move_last`). It also keeps the hub alive until exit, so a
    dropped ``Accelerator`` still flushes.
    """

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook
        self._lock = threading.Lock()
        self._registered: ExitHook | None = None

    def arm(self) -> None:
        with self._lock:
            if self._registered is None:
                self._registered = at_exit(self._hook, TRACKERS, "finishing the trackers")

    def disarm(self) -> None:
        with self._lock:
            if self._registered is not None:
                self._registered.cancel()
                self._registered = None

    def move_last(self) -> None:
        """Run the exit drains before the threading exit hooks a backend's ``start()`` may
        have registered (a thread pool's, after which it takes no work). Called on a worker's
        thread when its ``start()`` returned."""
        move_last()
