"""MLflow tracker: by default a sqlite store and artifacts under the logging directory."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import flatten, is_number

__all__ = ["MLflowTracker"]

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
        self.run_id = run_id
        self.tags = parsed_tags
        self.nested_run = bool(nested_run)
        self.description = description
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.client: Any = None
        self.run: Any = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``mlflow.entities.Run`` as it was when the run started."""
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
        if self.run_id is not None:
            self.run = self.client.get_run(self.run_id)
            return
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(
                self.experiment_name, artifact_location=artifacts
            )
        tags = {str(k): str(v) for k, v in self.tags.items()}
        if self.description:
            tags["mlflow.note.content"] = self.description
        if self.nested_run:
            import mlflow

            parent = mlflow.active_run()
            if parent is not None:
                tags.setdefault("mlflow.parentRunId", parent.info.run_id)
        self.run = self.client.create_run(experiment_id, run_name=self.mlflow_run_name, tags=tags)
        self.run_id = self.run.info.run_id

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = []
        for key, value in flatten(values).items():
            text = "None" if value is None else str(value)
            if len(text) > _MAX_PARAM_LENGTH:
                self.warn_skipped(key, value, f"cut to MLflow's {_MAX_PARAM_LENGTH} characters")
                text = text[:_MAX_PARAM_LENGTH]
            params.append(Param(self._key(key), text))
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
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        mlflow_step = 0 if step is None else int(step)
        metrics = []
        for key, value in values.items():
            if is_number(value):
                metrics.append(Metric(self._key(key), float(value), timestamp, mlflow_step))
            elif isinstance(value, dict) and value and all(is_number(v) for v in value.values()):
                for inner, number in value.items():
                    name = self._key(f"{key}/{inner}")
                    metrics.append(Metric(name, float(number), timestamp, mlflow_step))
            else:
                self.warn_skipped(key, value, "skipped by MLflow (metrics are numbers)")
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH], **kwargs
            )

    def _started_client(self, method: str) -> Any:
        if self.client is None or self.run_id is None:
            raise RuntimeError(
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
    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
