"""MLflow tracker: by default a sqlite store and artifacts under the logging directory."""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accelkit.errors import UsageError
from accelkit.trackers.backends._mlflow_runs import (
    MAX_KEY_LENGTH,
    MAX_TAG_LENGTH,
    PARENT_RUN_TAG,
    RESUMED_AT_MS_TAG,
    RESUMED_AT_STEP_TAG,
    RUN_KEY,
    RUN_KEY_TAG,
    MLflowRuns,
)
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import flatten, is_number

if TYPE_CHECKING:
    from accelkit.trackers.events import CheckpointEvent

__all__ = [
    "CHECKPOINT_TAG_PREFIX",
    "RUN_KEY_TAG",
    "LATEST_CHECKPOINT_TAG",
    "LOADED_CHECKPOINT_TAG",
    "RESUMED_AT_MS_TAG",
    "RESUMED_AT_STEP_TAG",
    "MLflowTracker",
]

CHECKPOINT_TAG_PREFIX = "accelkit.checkpoint."
LATEST_CHECKPOINT_TAG = CHECKPOINT_TAG_PREFIX + "latest"
LOADED_CHECKPOINT_TAG = CHECKPOINT_TAG_PREFIX + "loaded"

_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LENGTH = 6000


class MLflowTracker(GeneralTracker):
    """Log to MLflow through an ``MlflowClient`` (no global "active run" state).

    The tracking URI is, in order: ``tracking_uri=``, ``MLFLOW_TRACKING_URI``, then
    ``sqlite:///<logging_dir>/mlflow.db`` with artifacts in ``<logging_dir>/mlartifacts`` (the
    reference writes ``./mlruns`` whatever the project directory), then MLflow's own default.
    Numbers are metrics (a ``step`` of ``None`` is MLflow's step 0), dicts of numbers
    ``key/inner`` metrics; other values are skipped with one warning per key. Metric names with
    characters MLflow rejects have them replaced by ``_``. The configuration is flattened to
    ``outer/inner`` params, values as text (cut at MLflow's 6000 characters).

    As in the reference, ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (a JSON
    object) and ``MLFLOW_NESTED_RUN`` take priority over the matching arguments.

    Checkpoints. A new run is tagged ``accelkit.run_key`` with accelkit's run key
    (:meth:`name_run`), so a checkpoint saved before the server has answered names the run by
    ``{"run_key", "experiment_name", "tracking_uri"}``; once the run is open, checkpoints record
    ``{"run_id", "experiment_id", "tracking_uri", "run_key"}`` (the URI with any user name and
    password removed; it is only compared, never used to connect). A job resuming from that
    checkpoint reopens the same run (status set back to ``RUNNING``), found by its id or by its
    run key in this tracker's experiment (created with that tag if the saving job was killed
    before it reached the server), when this tracker logs to the same tracking URI and
    experiment now and the run still exists there; otherwise (another URI or experiment, a
    deleted or unknown run, a malformed id) it warns and creates a new run. MLflow cannot delete
    metric points, so the points the killed job logged after the checkpoint stay: the run then
    holds two values for those steps. The resume point is recorded in the run's tags
    ``accelkit.resumed_at_step`` (the checkpoint's last logged step) and
    ``accelkit.resumed_at_ms`` (when the run was reopened, in ms since the epoch),
    comma-separated lists when a run is resumed several times: a point at a step past
    ``resumed_at_step`` whose timestamp is at or after ``resumed_at_ms`` belongs to the resumed
    timeline, an earlier one to the abandoned one. The configuration stored again by the resumed
    job keeps MLflow's params (they cannot change): those with the same value are skipped,
    changed ones are skipped with one warning. A forked job (``load_state(..., fork=True)``) gets
    a new run tagged ``mlflow.parentRunId`` (the checkpoint's run, if in this store) and
    ``accelkit.forked_at_step``; its params hold ``forked_from/...`` in every case.

    Checkpoint events (:mod:`accelkit.trackers.events`) are metrics at the event's step
    (``checkpoint/save_seconds``, ...) and tags holding the checkpoint's path:
    ``accelkit.checkpoint.latest`` and ``accelkit.checkpoint.<iteration>`` (the folder name for
    a checkpoint without a number) for each save, ``accelkit.checkpoint.loaded`` for a load.

    Args:
        experiment_name: the MLflow experiment (the project name of ``init_trackers``); created
            if missing.
        logging_dir: the run's logging directory.
        run_id: resume this run instead of creating one.
        tags: run tags (a dict, or a JSON object as text).
        nested_run: make the run a child of the active ``mlflow`` run of this process, if any
            (tag ``mlflow.parentRunId``).
        run_name: the MLflow run name.
        description: the run description.
        tracking_uri: where to log (a sqlite URL, ``http://host:port``, a folder).
        artifact_location: where a newly created experiment keeps its artifacts.
    """

    name = "mlflow"
    requires_logging_directory = False
    main_process_only = True
    max_batch_values = _MAX_METRICS_PER_BATCH

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | str | None = False,
        run_name: str | None = None,
        description: str | None = None,
        *,
        tracking_uri: str | None = None,
        artifact_location: str | None = None,
    ) -> None:
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags_given = os.environ.get("MLFLOW_TAGS", tags)
        parsed_tags: dict[str, Any] = (
            json.loads(tags_given) if isinstance(tags_given, str) else dict(tags_given or {})
        )
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        if isinstance(nested_run, str):
            nested_run = nested_run.strip().lower() in ("1", "true", "yes", "on", "y", "t")
        directory = None if logging_dir is None else os.fspath(logging_dir)
        super().__init__(experiment_name or "", directory)
        self.experiment_name = experiment_name or "Default"
        self.mlflow_run_name = run_name
        self.run_id = self._given_run_id = run_id  # the given run is never discarded
        self.tags = parsed_tags
        self.nested_run = bool(nested_run)
        self.description = description
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.client: Any = None
        self.run: Any = None
        self._runs = MLflowRuns(self.experiment_name)  # which run a resumed job continues
        self._tag_warned = False

    @property
    @override
    def tracker(self) -> Any:
        """The ``mlflow.entities.Run`` as it was when the run started."""
        return self.run

    @property
    def active_run(self) -> Any:
        """The open ``mlflow.entities.Run`` (``None`` before ``start``): Accelerate's name."""
        return self.run

    def _resolve_uri(self) -> tuple[str | None, str | None]:
        if self.tracking_uri:
            return self.tracking_uri, self.artifact_location
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"], self.artifact_location
        if self.logging_dir is not None and "://" not in self.logging_dir:
            root = Path(self.logging_dir).absolute()
            root.mkdir(parents=True, exist_ok=True)
            artifacts = self.artifact_location or (root / "mlartifacts").as_uri()
            return f"sqlite:///{root / 'mlflow.db'}", artifacts
        return None, self.artifact_location

    @override
    def start(self) -> None:
        from mlflow import MlflowClient

        uri, artifacts = self._resolve_uri()
        self.client = MlflowClient(tracking_uri=uri)
        continuation = self._runs.take()
        if self.run_id is not None:
            self.run = self.client.get_run(self.run_id)
            if continuation is not None and continuation.run_id == self.run_id:
                self._runs.mark_resumed(self.client, self.run, continuation.step)
            elif continuation is not None:
                warnings.warn(
                    f"Tracker 'mlflow': the checkpoint's run {continuation.label} is not "
                    f"continued: run_id={self.run_id!r} (or MLFLOW_RUN_ID) was given and takes "
                    "priority; logging to that run.",
                    UserWarning,
                    stacklevel=2,
                )
            return
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(
                self.experiment_name, artifact_location=artifacts
            )
        if continuation is not None:
            self.run = self._runs.reopen(self.client, continuation, experiment_id)
            if self.run is not None:
                self.run_id = self.run.info.run_id
                return
        self.run = self._create_run(experiment_id)
        self.run_id = self.run.info.run_id
        if continuation is not None and self._runs.key is not None:  # named, never created
            self._runs.mark_resumed(self.client, self.run, continuation.step)

    def _create_run(self, experiment_id: str) -> Any:
        """A new run in ``experiment_id``, tagged with the run key (if any) and the run it
        forks (if any)."""
        tags = {str(k): str(v) for k, v in self.tags.items()}
        if self.description:
            tags["mlflow.note.content"] = self.description
        if self.nested_run:
            import mlflow

            parent = mlflow.active_run()
            if parent is not None:
                tags.setdefault(PARENT_RUN_TAG, parent.info.run_id)
        return self._runs.create(self.client, experiment_id, self.mlflow_run_name, tags)

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """Tag a new run with ``key`` (``accelkit.run_key``): the run is then found by it.

        ``None`` when a ``run_id`` (or ``MLFLOW_RUN_ID``) was given: that run is logged to.

        Args:
            key: the run key.
        """
        self._runs.key = None
        if self.run_id is not None or not RUN_KEY.fullmatch(key):
            return None
        uri, _ = self._resolve_uri()  # None: MLflow's default, known once the client exists
        return self._runs.name(key, uri)

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"run_id", "experiment_id", "tracking_uri"}`` of the open run (``None`` before),
        with the ``run_key`` and ``experiment_name`` :meth:`name_run` recorded before it opened.

        The tracking URI is recorded without user name and password, for display and for
        :meth:`continue_run` to compare with the URI it logs to then.
        """
        if self.client is None or self.run is None:
            return None
        return self._runs.reference(self.client, self.run)

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Reopen the checkpoint's run at the next :meth:`start` (see the class docstring).

        Only the reference's shape is checked here; :meth:`start` checks that the run exists
        where this tracker logs now. A malformed reference is a warning and a new run.

        Args:
            reference: what :meth:`run_reference` returned when the checkpoint was saved.
            step: the checkpoint's last logged step, recorded in ``accelkit.resumed_at_step``.
        """
        self._runs.expect(reference, step)

    @override
    def fork_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` open a new run linked to ``reference``'s run, forked
        after ``step`` (see the class docstring)."""
        self._runs.fork(reference, step)

    @override
    def discard_run(self) -> bool:
        """Delete the new run if it holds params and tags only (``MLflowRuns.discard``)."""
        run, self.run, self.run_id = self.run, None, self._given_run_id
        return self._given_run_id is not None or self._runs.discard(self.client, run)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # A reopened run keeps its params: MLflow refuses to change one.
        existing = dict(self.run.data.params) if self.run is not None else {}
        params = []
        changed = []
        for key, value in flatten(values).items():
            text = "None" if value is None else str(value)
            if len(text) > _MAX_PARAM_LENGTH:
                self.warn_skipped(key, value, f"cut to MLflow's {_MAX_PARAM_LENGTH} characters")
                text = text[:_MAX_PARAM_LENGTH]
            name = self._key(key)
            if name in existing:
                if existing[name] != text:
                    changed.append(name)
                continue
            params.append(Param(name, text))
        if changed:
            warnings.warn(
                f"Tracker 'mlflow': run {self.run_id!r} already has params "
                f"{', '.join(repr(name) for name in changed[:10])}"
                f"{' and more' if len(changed) > 10 else ''} with other values; MLflow params "
                "cannot change, so the run keeps its values (log the new ones as metrics or "
                "start a new run to record them).",
                UserWarning,
                stacklevel=2,
            )
        for i in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS_PER_BATCH])

    def _key(self, key: str) -> str:
        clean = _BAD_KEY_CHARS.sub("_", key)
        if clean != key:
            self.warn_skipped(
                key, key, f"the name has characters MLflow rejects; logged as {clean!r}"
            )
        return clean

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log the numbers of ``values`` (and of one level of nested dicts) as metrics.

        ``kwargs`` are ``mlflow.log_metrics``'s, as in Accelerate: ``timestamp`` (ms),
        ``model_id``, ``dataset`` (its name and digest go with each metric), ``run_id`` (log
        to that run instead) and ``synchronous``.
        """
        timestamp = kwargs.pop("timestamp", None) or int(time.time() * 1000)
        dataset = kwargs.pop("dataset", None)
        extra = {
            "model_id": kwargs.pop("model_id", None),
            "dataset_name": None if dataset is None else dataset.name,
            "dataset_digest": None if dataset is None else dataset.digest,
        }
        run_id = kwargs.pop("run_id", None) or self.run_id
        metrics = self._metrics(values, 0 if step is None else int(step), timestamp, extra)
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH], **kwargs)

    @override
    def log_batch(self, batch: Sequence[tuple[dict[str, Any], int, float]]) -> None:
        """Log several value sets in one ``MlflowClient.log_batch`` request per 1000 metrics
        (MLflow's limit), each point with its own step and the wall time it was logged at
        (points sent after an outage keep their time)."""
        metrics = []
        for values, step, wall_time in batch:
            metrics += self._metrics(values, int(step), int(wall_time * 1000), {})
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH])

    def _metrics(
        self, values: dict[str, Any], step: int, timestamp: int, extra: dict[str, Any]
    ) -> list[Any]:
        """MLflow ``Metric`` objects for the numbers of ``values`` (and of one level of nested
        dicts); other values are skipped with one warning per key."""
        from mlflow.entities import Metric

        metrics = []
        for key, value in values.items():
            if is_number(value):
                metrics.append(Metric(self._key(key), float(value), timestamp, step, **extra))
            elif isinstance(value, dict) and value and all(is_number(v) for v in value.values()):
                for inner, number in value.items():
                    name = self._key(f"{key}/{inner}")
                    metrics.append(Metric(name, float(number), timestamp, step, **extra))
            else:
                self.warn_skipped(key, value, "skipped by MLflow (metrics are numbers)")
        return metrics

    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        """Whether this run already has the numbers of one journal entry at ``step`` (the
        tracker journal asks after a sender was killed mid-call; MLflow would keep a second
        copy of a point sent twice)."""
        client = self._started_client("journal_delivered")
        for key, value in values.items():
            if is_number(value):
                history = client.get_metric_history(self.run_id, self._key(key))
                return any(m.step == step and m.value == float(value) for m in history)
        return False

    def _started_client(self, method: str) -> Any:
        if self.client is None or self.run_id is None:
            raise UsageError(
                f"MLflowTracker.{method}() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )
        return self.client

    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """Store a matplotlib or plotly figure as an artifact of the run.

        Args:
            figure: a ``matplotlib.figure.Figure`` or ``plotly.graph_objects.Figure``.
            artifact_file: the run-relative path to write, e.g. ``"plots/loss.png"``.
            **save_kwargs: passed to the figure's save function (``dpi=``, ...).
        """
        self._started_client("log_figure").log_figure(
            self.run_id, figure, artifact_file, save_kwargs=save_kwargs or None
        )

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Store every file of ``local_dir`` as artifacts of the run.

        Args:
            local_dir: the folder to upload.
            artifact_path: the folder inside the run's artifacts (default: their root).
        """
        self._started_client("log_artifacts").log_artifacts(
            self.run_id, os.fspath(local_dir), artifact_path
        )

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Store one file as an artifact of the run.

        Args:
            local_path: the file to upload.
            artifact_path: the folder inside the run's artifacts (default: their root).
        """
        self._started_client("log_artifact").log_artifact(
            self.run_id, os.fspath(local_path), artifact_path
        )

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Log the event's numbers at its step and tag the run with the checkpoint's path.

        Args:
            event: the checkpoint saved or loaded.
        """
        from mlflow.entities import Metric, RunTag

        client = self._started_client("on_checkpoint")
        timestamp = int(time.time() * 1000)
        metrics = [
            Metric(self._key(key), float(value), timestamp, int(event.step))
            for key, value in event.values.items()
        ]
        path = event.path
        if len(path) > MAX_TAG_LENGTH:
            if not self._tag_warned:
                self._tag_warned = True
                warnings.warn(
                    f"Tracker 'mlflow': checkpoint path {path[:80]!r}... is longer than the "
                    f"{MAX_TAG_LENGTH} characters of an MLflow tag; its tags hold its end.",
                    UserWarning,
                    stacklevel=2,
                )
            path = path[-MAX_TAG_LENGTH:]
        tags = [RunTag(key, path) for key in dict.fromkeys(_checkpoint_tag_keys(event))]
        client.log_batch(self.run_id, metrics=metrics, tags=tags)

    @override
    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


def _tag_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)[:MAX_KEY_LENGTH]


def _checkpoint_tag_keys(event: CheckpointEvent) -> list[str]:
    """The tags an event sets to its checkpoint's path: a save's ``latest`` and its own, a
    load's ``loaded``; none for a replication (its numbers only: the save's tags name it)."""
    if event.kind == "save":
        label = event.name if event.iteration is None else str(event.iteration)
        return [LATEST_CHECKPOINT_TAG, _tag_key(CHECKPOINT_TAG_PREFIX + label)]
    return [LOADED_CHECKPOINT_TAG] if event.kind == "load" else []
