"""Continuing an MLflow run across a restart: the run key a new run is tagged with, the
checkpoint's run reference checked for shape, the run found again (by id or by key) where the
tracker logs now, reopened, and its resume point recorded in its tags.

``mlflow.py`` holds the tracker (the client, the run, what is logged); this module holds which
run that is when a job resumes from a checkpoint. It imports MLflow only inside the calls that
talk to the store, as the tracker does.
"""

from __future__ import annotations

import re
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any

from accelkit._text import short

__all__ = [
    "FORKED_AT_STEP_TAG",
    "PARENT_RUN_TAG",
    "RESUMED_AT_MS_TAG",
    "RESUMED_AT_STEP_TAG",
    "RUN_KEY",
    "RUN_KEY_TAG",
    "MAX_KEY_LENGTH",
    "MAX_TAG_LENGTH",
    "MLflowRuns",
    "display_uri",
]

RESUMED_AT_STEP_TAG = "accelkit.resumed_at_step"
RUN_KEY_TAG = "accelkit.run_key"
FORKED_AT_STEP_TAG = "accelkit.forked_at_step"
PARENT_RUN_TAG = "mlflow.parentRunId"
RESUMED_AT_MS_TAG = "accelkit.resumed_at_ms"

_RUN_ID = re.compile(r"[0-9a-fA-F]{8,64}")
_EXPERIMENT_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# A run key (letters and digits only: it goes into a search filter as it is).
RUN_KEY = re.compile(r"[0-9A-Za-z]{1,64}")
MAX_KEY_LENGTH = 250
# MLflow takes 8000 characters in a tag value since 2.x; older servers took 5000.
MAX_TAG_LENGTH = 5000
_MAX_URI_LENGTH = 2000


@dataclass(frozen=True)
class _Continuation:
    """A checkpoint's run reference, checked for shape (not yet against the store): a run id
    and its experiment id, or (a checkpoint saved before the run opened) a run key and its
    experiment's name."""

    run_id: str | None
    experiment_id: str | None
    tracking_uri: str | None
    step: int
    run_key: str | None = None
    experiment_name: str | None = None

    @property
    def label(self) -> str:
        """The run, in words."""
        if self.run_id is not None:
            return repr(self.run_id)
        return f"tagged {RUN_KEY_TAG}={self.run_key!r}"


class MLflowRuns:
    """Which run an :class:`~accelkit.trackers.backends.mlflow.MLflowTracker` logs to when a
    job resumes: the run key a new run is tagged with (``key``), the checkpoint's run waiting
    for the next ``start()``, and finding and reopening that run.

    Args:
        experiment_name: the experiment the tracker logs to.
    """

    def __init__(self, experiment_name: str) -> None:
        self.experiment_name = experiment_name
        # A new run is tagged with it; None after a warning that the checkpoint's run is not
        # continued (the new run is not the checkpoint's: it does not take its key).
        self.key: str | None = None
        self._pending: _Continuation | None = None
        self._parent: _Continuation | None = None  # the run a new run forks (see fork)

    def name(self, key: str, uri: str | None) -> dict[str, Any]:
        """Tag the next new run with run key ``key``: the reference a checkpoint saved before
        that run opens records (``uri``: where the tracker will log, ``None`` for MLflow's
        default, known only once the client exists)."""
        self.key = key
        reference: dict[str, Any] = {"run_key": key, "experiment_name": self.experiment_name}
        if uri is not None:
            reference["tracking_uri"] = display_uri(uri)
        return reference

    def discard(self, client: Any, run: Any) -> bool:
        """Delete ``run``, given up for a checkpoint's run, when it holds no metric and no
        artifact (its params and tags only), as MLflow's UI deletes one (lifecycle stage
        ``deleted``); ``True`` once nothing of it is left, ``False`` when it is kept."""
        if run is None or client is None:
            return True
        run_id = run.info.run_id
        if client.get_run(run_id).data.metrics or client.list_artifacts(run_id):
            return False
        client.delete_run(run_id)
        return True

    def reference(self, client: Any, run: Any) -> dict[str, Any]:
        """The open ``run``'s reference: its ids and the tracking URI (without user name and
        password), and its run key and experiment name if :meth:`name` tagged it."""
        reference = {
            "run_id": run.info.run_id,
            "experiment_id": str(run.info.experiment_id),
            "tracking_uri": display_uri(str(client.tracking_uri)),
        }
        key = run.data.tags.get(RUN_KEY_TAG)
        if isinstance(key, str) and RUN_KEY.fullmatch(key):  # as name() named it
            reference.update(run_key=key, experiment_name=self.experiment_name)
        return reference

    def expect(self, reference: dict[str, Any] | None, step: int) -> None:
        """Reopen the run ``reference`` names at the next start; a malformed reference is a
        warning and a new run."""
        self._pending = self._parent = None
        if reference is None:
            return
        problem, continuation = _parse_reference(reference, int(step))
        if continuation is None:
            warnings.warn(
                f"Tracker 'mlflow': the checkpoint's run reference is malformed ({problem}); "
                "it is ignored and a new run is started. Was the checkpoint's accelkit.json "
                "edited?",
                UserWarning,
                stacklevel=3,
            )
            self.key = None  # a new run of its own: the key stays the checkpoint's run's
            return
        self._pending = continuation

    def fork(self, reference: dict[str, Any] | None, step: int) -> None:
        """Link the next new run to the run ``reference`` names (forked after ``step``); a
        malformed reference links nothing (the run's ``forked_from`` params still name it)."""
        self._pending = self._parent = None
        if reference is not None:
            self._parent = _parse_reference(reference, int(step))[1]

    def create(
        self, client: Any, experiment_id: str, name: str | None, tags: dict[str, str]
    ) -> Any:
        """A new run of ``experiment_id`` named ``name``, with ``tags`` and its own: its run
        key (``accelkit.run_key``), and when it forks its parent (``mlflow.parentRunId``, when
        that run is in this store and ``tags`` name no parent) and the step it forks after.
        The fork is forgotten once the run exists (a creation the server refused is retried
        with it)."""
        tags = {**self._fork_tags(client), **tags}
        if self.key is not None:
            tags[RUN_KEY_TAG] = self.key
        run = client.create_run(experiment_id, run_name=name, tags=tags)
        self._parent = None
        return run

    def _fork_tags(self, client: Any) -> dict[str, str]:
        from mlflow.exceptions import MlflowException

        parent = self._parent
        if parent is None:
            return {}
        tags = {FORKED_AT_STEP_TAG: str(parent.step)}
        if parent.tracking_uri is not None and parent.tracking_uri != display_uri(
            str(client.tracking_uri)
        ):
            return tags
        try:
            if parent.run_id is not None:
                run = client.get_run(parent.run_id)
            else:  # named before it opened: found by its key
                experiment = client.get_experiment_by_name(str(parent.experiment_name))
                run = experiment and self._by_key(
                    client, experiment.experiment_id, str(parent.run_key)
                )
        except MlflowException:
            return tags
        if run is not None and run.info.lifecycle_stage == "active":
            tags[PARENT_RUN_TAG] = run.info.run_id
        return tags

    def take(self) -> _Continuation | None:
        """The checkpoint's run to continue at this start (once), or ``None``."""
        continuation, self._pending = self._pending, None
        return continuation

    def reopen(self, client: Any, continuation: _Continuation, experiment_id: str) -> Any:
        """The checkpoint's run, reopened, or ``None`` if it may not be (a warning) or was
        named by its key and never created (no warning: the tracker creates it)."""
        run = self._find(client, continuation, experiment_id)
        if run is None:
            return None
        if run.info.status != "RUNNING":
            client.update_run(run.info.run_id, status="RUNNING")
        self.mark_resumed(client, run, continuation.step)
        return client.get_run(run.info.run_id)

    def _find(self, client: Any, continuation: _Continuation, experiment_id: str) -> Any:
        """The checkpoint's run where the tracker logs now, or ``None`` (see :meth:`reopen`;
        the run key is forgotten after a warning: the new run is not the checkpoint's)."""
        from mlflow.exceptions import MlflowException

        here = display_uri(str(client.tracking_uri))
        if continuation.tracking_uri is not None and continuation.tracking_uri != here:
            self._warn_new_run(
                continuation,
                f"it was logged to {continuation.tracking_uri!r} and this tracker logs to "
                f"{here!r}; pass tracking_uri= (or MLFLOW_TRACKING_URI) to continue it there",
            )
            return None
        if continuation.run_id is None:
            if continuation.experiment_name != self.experiment_name:
                self._warn_new_run(
                    continuation,
                    f"it belongs to experiment {continuation.experiment_name!r} and this "
                    f"tracker logs to experiment {self.experiment_name!r}",
                )
                return None
            self.key = continuation.run_key
            return self._by_key(client, experiment_id, str(continuation.run_key))
        try:
            run = client.get_run(continuation.run_id)
        except MlflowException as error:
            self._warn_new_run(
                continuation,
                f"{here!r} has no such run ({error.error_code}); was it deleted?",
            )
            return None
        if run.info.lifecycle_stage != "active":
            self._warn_new_run(continuation, f"the run is {run.info.lifecycle_stage} at {here!r}")
            return None
        if str(run.info.experiment_id) != str(experiment_id) or (
            continuation.experiment_id != str(experiment_id)
        ):
            self._warn_new_run(
                continuation,
                f"it belongs to experiment id {run.info.experiment_id!r} and this tracker logs "
                f"to experiment {self.experiment_name!r} (id {experiment_id!r})",
            )
            return None
        return run

    def _by_key(self, client: Any, experiment_id: str, key: str) -> Any:
        """The active run of ``experiment_id`` tagged with run key ``key``, or ``None``."""
        runs = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=2
        )
        if len(runs) > 1:
            warnings.warn(
                f"Tracker 'mlflow': experiment {self.experiment_name!r} has several runs tagged "
                f"{RUN_KEY_TAG}={key!r}; continuing {runs[0].info.run_id!r}.",
                UserWarning,
                stacklevel=4,
            )
        return runs[0] if runs else None

    def mark_resumed(self, client: Any, run: Any, step: int) -> None:
        """Append the resume point to the run's ``accelkit.resumed_at_*`` tags."""
        from mlflow.entities import RunTag

        tags = run.data.tags
        now = int(time.time() * 1000)
        client.log_batch(
            run.info.run_id,
            tags=[
                RunTag(RESUMED_AT_STEP_TAG, _append(tags.get(RESUMED_AT_STEP_TAG), str(step))),
                RunTag(RESUMED_AT_MS_TAG, _append(tags.get(RESUMED_AT_MS_TAG), str(now))),
            ],
        )

    def _warn_new_run(self, continuation: _Continuation, reason: str) -> None:
        self.key = None  # the new run is not the checkpoint's: it does not take its key
        warnings.warn(
            f"Tracker 'mlflow': the checkpoint's run {continuation.label} is not continued: "
            f"{reason}. Logging to a new run of experiment {self.experiment_name!r}.",
            UserWarning,
            stacklevel=3,
        )


def _parse_reference(
    reference: dict[str, Any], step: int
) -> tuple[str | None, _Continuation | None]:
    """Check a checkpoint's reference for shape: ``(None, continuation)``, or ``(problem,
    None)``."""
    run_id = reference.get("run_id")
    experiment_id = reference.get("experiment_id")
    tracking_uri = reference.get("tracking_uri")
    run_key = reference.get("run_key")
    if run_key is not None and not (isinstance(run_key, str) and RUN_KEY.fullmatch(run_key)):
        return f"run_key {short(run_key)} is not a run key (1 to 64 letters and digits)", None
    if tracking_uri is not None and (
        not isinstance(tracking_uri, str) or len(tracking_uri) > _MAX_URI_LENGTH
    ):
        return f"tracking_uri {short(tracking_uri)} is not a tracking URI", None
    if run_id is None and run_key is not None:  # named before the run opened
        name = reference.get("experiment_name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_LENGTH:
            return f"experiment_name {short(name)} is not an experiment name", None
        return None, _Continuation(None, None, tracking_uri, step, run_key, name)
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        return f"run_id {short(run_id)} is not an MLflow run id (8 to 64 hex digits)", None
    if not isinstance(experiment_id, str) or not _EXPERIMENT_ID.fullmatch(experiment_id):
        return (
            f"experiment_id {short(experiment_id)} is not an MLflow experiment id "
            "(1 to 64 letters, digits, '_' or '-')"
        ), None
    if tracking_uri is None:
        return "tracking_uri None is not a tracking URI", None
    return None, _Continuation(run_id, experiment_id, tracking_uri, step, run_key)


def display_uri(uri: str) -> str:
    """``uri`` without user name and password (``http://user:pw@host`` -> ``http://host``)."""
    parts = urllib.parse.urlsplit(uri)
    if "@" not in parts.netloc:
        return uri.rstrip("/") if parts.scheme in ("http", "https") else uri
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)).rstrip("/")


def _append(previous: str | None, value: str) -> str:
    """``previous,value``, dropping the oldest entries to stay within a tag's length."""
    entries = [*(previous.split(",") if previous else []), value]
    while len(entries) > 1 and len(",".join(entries)) > MAX_TAG_LENGTH:
        entries.pop(0)
    return ",".join(entries)
