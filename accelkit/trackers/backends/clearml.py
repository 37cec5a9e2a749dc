"""ClearML tracker: offline sessions go under ``<logging_dir>/clearml``."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from typing_extensions import override

from accelkit._text import short
from accelkit.errors import ConfigurationError, UsageError
from accelkit.trackers.backends._images import hwc_uint8
from accelkit.trackers.backends._reference import continuable_id
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["ClearMLTracker", "RESUMED_AT_STEP", "title_series"]

RESUMED_AT_STEP = "accelkit/resumed_at_step"
# ClearML's task ids: 32 hex digits on a server, "offline-" and 32 hex digits offline.
_ONLINE_ID = re.compile(r"[0-9a-f]{32}")
_OFFLINE_ID = re.compile(r"offline-[0-9a-f]{32}")
_CREDENTIALS_ENV = ("CLEARML_API_ACCESS_KEY", "TRAINS_API_ACCESS_KEY", "CLEARML_AUTH_TOKEN")
_OFFLINE_ENV = ("CLEARML_OFFLINE_MODE", "TRAINS_OFFLINE_MODE")
_CACHE_ENV = "CLEARML_CACHE_DIR"
_MASTER_ENV = ("CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID")
# Task.init reads where it keeps its files from process-wide settings: one run at a time.
_FOLDER_LOCK = threading.Lock()
# The ids of the tasks this process's trackers opened: ClearML keeps one open task per
# process, and one of these still open (a tracker that failed and was skipped) is closed
# before the next opens, where a task the script opened itself is used as it is.
_OPENED: set[str] = set()
# Task.init's defaults that accelkit changes (init_kwargs win): ClearML's torch.save hook
# would copy every checkpoint file into the task (offline: into the session folder), and its
# TensorBoard hook would log a second copy of every value logged to TensorBoard as well.
_FRAMEWORKS = {"pytorch": False, "tensorboard": False}


def title_series(key: str) -> tuple[str, str]:
    """ClearML's ``(title, series)`` for a metric key, as Accelerate reports it:
    ``eval_``/``test_``/``train_`` prefixes name the series (``"train_loss"`` -> ``("loss",
    "train")``); any other key is its own title in the ``"train"`` series.

    Args:
        key: the metric name given to ``log``.
    """
    for prefix in ("eval", "test", "train"):
        if key.startswith(prefix + "_"):
            return key[len(prefix) + 1 :], prefix
    return key, "train"


class ClearMLTracker(GeneralTracker):
    """Log to ClearML, as Accelerate's ``ClearMLTracker`` (a server, or offline).

    ``init_trackers(project_name, init_kwargs={"clearml": {...}})`` calls ``Task.init(
    project_name=..., task_name=..., **init_kwargs)``; both names default to the project name
    given to ``init_trackers`` (``CLEARML_PROJECT`` and ``CLEARML_TASK`` win over it, keys of
    ``init_kwargs`` over them). A task the script opened itself (``Task.current_task()``) is
    used as it is and left open by :meth:`finish`. ``log`` reports numbers as scalars: a key
    ``train_x``, ``eval_x`` or ``test_x`` is title ``x`` in series ``train``/``eval``/``test``
    (any other key is its own title in series ``train``; see :func:`title_series`), at the
    step as ClearML's iteration, or as a single value when the step is ``None``; anything else
    is skipped with one warning per key. The configuration goes to
    ``task.connect_configuration`` as plain data (tensors to numbers or lists, paths to text).
    ClearML keeps one open task per process: a task an earlier accelkit run left open (a
    tracker that failed) is closed first. A process started by one whose ClearML task is closed
    inherits ClearML's mark of it (``CLEARML_PROC_MASTER_ID=<pid>:``), with which ``Task.init``
    would return a stub that drops every value: the tracker removes that stale mark.

    Offline: ClearML's own switch, ``CLEARML_OFFLINE_MODE=1`` (or ``Task.set_offline(True)``
    before ``init_trackers``). The session folder (``offline/<task id>``: ``task.json``,
    ``metrics.jsonl``, ``log.jsonl``, images under ``data``, and the ``.zip`` that
    ``clearml-task --import-offline-session <zip>`` uploads) goes to
    ``<logging_dir>/clearml`` when a logging directory is set (``CLEARML_CACHE_DIR`` wins), and
    so does ClearML's session cache (``~/.clearml/.session.json`` otherwise). Not offline and
    no server configured (no ``CLEARML_API_ACCESS_KEY`` nor ``api.credentials`` in
    ``clearml.conf``): :meth:`start` raises a :class:`~accelkit.errors.ConfigurationError`
    saying so, instead of Accelerate's ClearML error.

    Unlike Accelerate's, a new run is a new task (``reuse_last_task_id=False``: ClearML would
    otherwise reset the last task of the same name, a killed run's included), ClearML's
    PyTorch and TensorBoard hooks are off (``auto_connect_frameworks``: its ``torch.save`` hook
    copies checkpoint files into the task, its TensorBoard hook logs TensorBoard's values a
    second time), and the reporter runs in a thread rather than a subprocess (whose close
    waits ~10 s). Keys of ``init_kwargs`` win over the first two, a configured
    ``sdk.development.report_use_subprocess`` over the third.

    Experiment continuity: ClearML chooses task ids, so a checkpoint records ``{"task_id",
    "project"}`` once the task is open. A job resumed from it continues that task
    (``Task.init(reuse_last_task_id=<id>, continue_last_task=0)``: the same iterations, no
    offset), in the same project and mode only (else a warning and a new task): offline, the
    same session folder, from which the points the earlier attempt logged after the
    checkpoint's step are removed first; on a server, where they stay, the configuration
    records ``accelkit/resumed_at_step``. ``continue_last_task`` or ``reuse_last_task_id`` in
    ``init_kwargs`` win over the checkpoint. A job killed before its task opened resumes into
    a new task. ``accelkit track sync`` sends what the journal kept into the same task. A fork
    (``load_state(..., fork=True)``) opens a new task, the checkpoint's task its parent on a
    server (:meth:`fork_run`).

    Args:
        run_name: the ClearML project (and task name).
        logging_dir: the run's logging directory (offline sessions go under it).
        **kwargs: passed to ``Task.init``.
    """

    name = "clearml"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.task: Any = None
        self._external = False  # the script's own task: finish() leaves it open
        self._continue: str | None = None  # the task id the next start() continues
        self._parent: str | None = None  # the parent of the task the next start() opens
        self._resume_step: int | None = None
        self._config: dict[str, Any] = {}

    @property
    @override
    def tracker(self) -> Any:
        """The ``clearml.Task``."""
        return self.task

    @property
    def folder(self) -> str | None:
        """Where ClearML keeps this run's files (offline sessions under ``offline/``), or
        ``None``: ClearML's default (``~/.clearml/cache``)."""
        if os.environ.get(_CACHE_ENV):
            return os.environ[_CACHE_ENV]
        if self.logging_dir is None:
            return None
        return os.path.join(self.logging_dir, "clearml")

    @property
    def project(self) -> str:
        """The ClearML project the task is in."""
        return str(
            self.init_kwargs.get("project_name")
            or os.environ.get("CLEARML_PROJECT")
            or self.run_name
        )

    @override
    def start(self) -> None:
        from clearml import Task

        current: Any = Task.current_task()
        if current is not None and str(current.id) not in _OPENED:
            self.task, self._external = current, True
            return
        if current is not None:
            current.close()
        offline = _offline(Task)
        if not offline and not _configured():
            raise ConfigurationError(
                "ClearML has no server configured (no CLEARML_API_ACCESS_KEY / "
                "CLEARML_API_SECRET_KEY in the environment, no api.credentials in clearml.conf) "
                "and is not offline. To log to a server, run `clearml-init` or set "
                "CLEARML_API_HOST, CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY; to keep "
                f"the run on this machine, set CLEARML_OFFLINE_MODE=1 (its session goes to "
                f"{self.folder or '~/.clearml/cache'}/offline)."
            )
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project_name", self.project or None)
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK") or self.run_name or None)
        kwargs.setdefault("auto_connect_frameworks", dict(_FRAMEWORKS))
        step, self._resume_step = self._resume_step, None
        if self._continue is not None:
            kwargs["reuse_last_task_id"], kwargs["continue_last_task"] = self._continue, 0
            if offline and step is not None:
                self._forget_after(self._continue, step)
        else:
            kwargs.setdefault("reuse_last_task_id", False)
        from clearml.config import config

        if config.get("development.report_use_subprocess", None) is None:
            task_class: Any = Task  # the reporter in a thread (see the class docstring)
            task_class._report_subprocess_enabled = False
        _forget_a_closed_master()
        with self._files_here():
            self.task = Task.init(**kwargs)
        _OPENED.add(str(self.task.id))
        self._external = False
        parent, self._parent = self._parent, None
        if parent is not None and self._continue is None:
            self.task.set_parent(parent)
        self._config = {} if step is None else {RESUMED_AT_STEP: step}
        if self._config:
            self.task.connect_configuration(dict(self._config))

    @contextmanager
    def _files_here(self) -> Iterator[None]:
        """Point ClearML's cache (its offline sessions) and session cache at :attr:`folder`
        while ``Task.init`` runs (the task keeps its folder once open)."""
        folder = self.folder
        if folder is None:
            yield
            return
        from clearml.config.cache import SessionCache

        os.makedirs(folder, exist_ok=True)
        with _FOLDER_LOCK:
            env, cache = os.environ.get(_CACHE_ENV), SessionCache.SESSION_CACHE_FOLDER
            os.environ[_CACHE_ENV], SessionCache.SESSION_CACHE_FOLDER = folder, folder
            try:
                yield
            finally:
                SessionCache.SESSION_CACHE_FOLDER = cache
                if env is None:
                    os.environ.pop(_CACHE_ENV, None)
                else:
                    os.environ[_CACHE_ENV] = env

    def _session(self, task_id: str) -> Path | None:
        """The offline session folder of ``task_id`` under :attr:`folder` (``None``: no
        folder of this run)."""
        return None if self.folder is None else Path(self.folder, "offline", task_id)

    def _forget_after(self, task_id: str, step: int) -> None:
        """Remove the reports after ``step`` from the continued task's offline session."""
        session = self._session(task_id)
        if session is None or not (session / "metrics.jsonl").is_file():
            return
        path = session / "metrics.jsonl"
        kept = []
        for events in _events(path):
            events = [e for e in events if not _after(e, step)]
            if events:
                kept.append(json.dumps(events))
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        partial.replace(path)

    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        """Whether the offline session already holds the numbers of one journal entry at
        ``step`` (the tracker journal asks after a sender was killed mid-call). ``False`` on a
        server."""
        self._require_task("journal_delivered")
        numbers = {title_series(k): float(v) for k, v in values.items() if is_number(v)}
        session = self.task.get_offline_mode_folder() if _offline_task(self.task) else None
        if not numbers or session is None:
            return False
        self.task.flush(wait_for_uploads=True)
        found: dict[tuple[str, str], float] = {}
        for events in _events(Path(session) / "metrics.jsonl"):
            for event in events:
                at = (event.get("metric"), event.get("variant"))
                if event.get("iter") == step and at in numbers:
                    found[at] = float(event["value"])
        return found == numbers

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Connect the configuration to the task (``task.connect_configuration``); a second
        call adds to the first."""
        self._require_task("store_init_configuration")
        self._config.update(to_plain(values))
        self.task.connect_configuration(dict(self._config))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report numbers as scalars at ``step`` (see :func:`title_series`), or as single values
        when ``step`` is ``None``; ``kwargs`` go to ``report_scalar``/``report_single_value``."""
        self._require_task("log")
        logger = self.task.get_logger()
        for key, value in values.items():
            if not is_number(value):
                self.warn_skipped(key, value, "skipped (ClearML scalars are numbers)")
                continue
            if step is None:
                logger.report_single_value(name=key, value=float(value), **kwargs)
                continue
            title, series = title_series(key)
            logger.report_scalar(title, series, value=float(value), iteration=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Report images (``report_image``, title and series as :func:`title_series`): each
        value is an image or a list of images (series ``<series>/0``, ``/1``, ...): a path, a
        PIL image, or a CHW or HWC tensor or array (floats in 0-1)."""
        self._require_task("log_images")
        logger = self.task.get_logger()
        for key, value in values.items():
            title, series = title_series(key)
            images = value if isinstance(value, list) else [value]
            for index, image in enumerate(images):
                name = f"{series}/{index}" if isinstance(value, list) else series
                source = {"local_path": os.fspath(image)} if _is_path(image) else {}
                logger.report_image(
                    title,
                    name,
                    iteration=step,
                    **(source or {"image": hwc_uint8(image)}),
                    **kwargs,
                )

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Report a table (``report_table``), as Accelerate's ``ClearMLTracker.log_table``.

        Args:
            table_name: its title and series (see :func:`title_series`).
            columns: the column names (else the first row of ``data`` names them).
            data: the rows.
            dataframe: a pandas ``DataFrame`` instead of ``columns`` and ``data``.
            step: the iteration.
            **kwargs: passed to ``clearml.Logger.report_table``.

        Raises:
            ConfigurationError: neither ``data`` nor ``dataframe`` was given.
        """
        self._require_task("log_table")
        table = dataframe
        if dataframe is None:
            if data is None:
                raise ConfigurationError(
                    f"ClearMLTracker.log_table({table_name!r}) got no rows: pass data=[[...], "
                    "...] (with columns=[...] naming them) or dataframe=<a pandas DataFrame>."
                )
            table = [list(columns), *data] if columns else data
        title, series = title_series(table_name)
        self.task.get_logger().report_table(
            title, series, iteration=step, table_plot=table, **kwargs
        )

    @override
    def finish(self) -> None:
        """Close the task (a task the script opened itself is left open)."""
        if self.task is not None and not self._external:
            self.task.close()

    @override
    def discard_run(self) -> bool:
        """Delete the offline session :meth:`start` opened, given up for a checkpoint's task
        before anything was reported to it (its configuration only), and forget the task.

        A task on a server is kept (accelkit names it in a warning), and so is the script's own
        task; a continued task is the one the next :meth:`start` logs to.

        Returns:
            ``True`` if the session was deleted (or is the one logged to next).
        """
        task, self.task = self.task, None
        if task is None or self._continue is not None:
            return True
        if self._external or not _offline_task(task):
            return False
        session = Path(task.get_offline_mode_folder())
        if any(_events(session / "metrics.jsonl")):
            return False
        shutil.rmtree(session, ignore_errors=True)
        session.with_name(session.name + ".zip").unlink(missing_ok=True)
        return True

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"task_id", "project"}`` of the open task."""
        if self.task is None:
            return None
        return {"task_id": str(self.task.id), "project": self.project}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` continue the checkpoint's task, when it is in this
        project and mode (offline: its session is in this run's folder).

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step.
        """
        self._continue, self._resume_step, self._parent = None, None, None
        own = ("continue_last_task", "reuse_last_task_id")
        if reference is None or any(key in self.init_kwargs for key in own):
            return
        offline, task_id = self._checked(reference)
        if task_id is None:
            return
        session = self._session(task_id)
        if offline and session is not None and not (session / "task.json").is_file():
            warnings.warn(
                f"Tracker 'clearml': the checkpoint's offline task {short(task_id)} has no "
                f"session in {session.parent}; logging to a new task.",
                UserWarning,
                stacklevel=2,
            )
            return
        self._continue, self._resume_step = task_id, int(step)

    @override
    def fork_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` open a new task whose parent is the checkpoint's task
        (ClearML's task parent), on a server and in this project only: an offline task's id
        means nothing to the server its session is imported into, so offline the
        ``forked_from`` configuration entry alone names it.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step.
        """
        self._continue, self._resume_step, self._parent = None, None, None
        if reference is None:
            return
        offline, task_id = self._checked(reference)
        if not offline:
            self._parent = task_id

    def _checked(self, reference: dict[str, Any]) -> tuple[bool, str | None]:
        """Whether ClearML runs offline, and the reference's task id if it is a task of this
        project in this mode (else ``None``, after a warning)."""
        from clearml import Task

        offline = _offline(Task)
        task_id = continuable_id(
            "clearml",
            reference,
            id_key="task_id",
            id_name=f"an {'offline' if offline else 'online'} ClearML task id",
            pattern=_OFFLINE_ID if offline else _ONLINE_ID,
            expected="'offline-' and 32 hex digits" if offline else "32 hex digits",
            project=reference.get("project"),
            own_project=self.project,
            new="task",
        )
        return offline, task_id

    def _require_task(self, method: str) -> None:
        if self.task is None:
            raise UsageError(
                f"ClearMLTracker.{method}() needs a started task: call "
                "accelerator.init_trackers(...) first."
            )


def _offline(task_class: Any) -> bool:
    """Whether ClearML runs offline (``CLEARML_OFFLINE_MODE``, read by ClearML only when
    imported, or ``Task.set_offline(True)``); the variable switches it on."""
    if task_class.is_offline():
        return True
    flag = next((os.environ[k] for k in _OFFLINE_ENV if os.environ.get(k)), "")
    if flag.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    task_class.set_offline(True)
    return True


def _forget_a_closed_master() -> None:
    """Drop ClearML's mark of another process's closed task.

    ClearML marks a process that opened a task with ``CLEARML_PROC_MASTER_ID=<pid>:<task id>``
    for its subprocesses, and leaves ``<pid>:`` once the task is closed. A process forked or
    started after that (a preloaded job, a launcher's child) would get a stub from
    ``Task.init`` that silently drops every value.
    """
    for name in _MASTER_ENV:
        pid, _, task_id = os.environ.get(name, "").partition(":")
        if pid and not task_id and pid != str(os.getpid()):
            del os.environ[name]


def _offline_task(task: Any) -> bool:
    return _OFFLINE_ID.fullmatch(str(task.id)) is not None


def _configured() -> bool:
    """Whether ClearML has credentials for a server (environment or ``clearml.conf``)."""
    if any(os.environ.get(k) for k in _CREDENTIALS_ENV):
        return True
    from clearml.config import config_obj

    return bool(config_obj.get("api.credentials.access_key", None))


def _after(event: dict[str, Any], step: int) -> bool:
    """Whether a report of an offline session is at an iteration after ``step``."""
    at = event.get("iter")
    return isinstance(at, int) and at > step


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _events(path: Path) -> Iterator[list[dict[str, Any]]]:
    """The reports of an offline session's ``metrics.jsonl`` (a JSON list per line), up to
    a torn last line (a killed job's)."""
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                events = json.loads(line)
            except ValueError:
                return
            if isinstance(events, list):
                yield [e for e in events if isinstance(e, dict)]
