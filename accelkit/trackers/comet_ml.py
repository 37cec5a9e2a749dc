"""Comet tracker: offline archives go under ``<logging_dir>/comet_ml``."""

from __future__ import annotations

import os
from typing import Any

from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["CometMLTracker"]

_COMET_DEFAULT_OFFLINE_DIR = ".cometml-runs"


class CometMLTracker(GeneralTracker):
    """Log to Comet through ``comet_ml.start``.

    When no Comet API key is configured and ``online`` is not given, the experiment runs offline
    (the reference fails instead); offline archives are written to ``<logging_dir>/comet_ml``
    rather than ``./.cometml-runs``. Numbers go to ``log_metrics``, dicts of numbers to
    ``log_metrics`` with the key as prefix, strings to ``log_other`` (with one warning per key:
    Comet keeps only their latest value); anything else is skipped with one warning per key.

    Args:
        run_name: the Comet project name.
        logging_dir: the run's logging directory.
        **kwargs: passed to ``comet_ml.start`` (``api_key``, ``workspace``, ``online``,
            ``experiment_config``, ...).
    """

    name = "comet_ml"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.experiment: Any = None

    @property
    @override
    def tracker(self) -> Any:
        """The Comet experiment (``OfflineExperiment`` when offline)."""
        return self.experiment

    @override
    def start(self) -> None:
        import comet_ml

        kwargs = dict(self.init_kwargs)
        # Comet's auto-logging patches other libraries (TensorBoard's SummaryWriter among them),
        # so with tensorboard in the same run every scalar would reach Comet twice. accelkit
        # logs explicitly; a user who wants auto-logging passes their own experiment_config.
        config = kwargs.pop("experiment_config", None) or comet_ml.ExperimentConfig(
            auto_metric_logging=False, auto_param_logging=False
        )
        if self.logging_dir is not None and config.offline_directory in (
            None,
            _COMET_DEFAULT_OFFLINE_DIR,
        ):
            config.offline_directory = os.path.join(self.logging_dir, "comet_ml")
        if config.offline_directory:
            os.makedirs(config.offline_directory, exist_ok=True)
        if "online" not in kwargs and not _has_api_key(comet_ml, kwargs):
            kwargs["online"] = False
        self.experiment = comet_ml.start(
            project_name=self.run_name, experiment_config=config, **kwargs
        )

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.experiment.log_parameters(to_plain(values))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        metrics = {}
        for key, value in values.items():
            if is_number(value):
                metrics[key] = value
            elif isinstance(value, dict) and all(is_number(v) for v in value.values()):
                self.experiment.log_metrics(value, prefix=key, step=step, **kwargs)
            elif isinstance(value, str):
                self.warn_skipped(key, value, "stored with Comet's log_other (latest value only)")
                self.experiment.log_other(key, value)
            else:
                self.warn_skipped(key, value, "skipped by Comet")
        if metrics:
            self.experiment.log_metrics(metrics, step=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: each value is anything ``Experiment.log_image`` accepts."""
        for key, image in values.items():
            self.experiment.log_image(image, name=key, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.experiment is not None:
            self.experiment.end()


def _has_api_key(comet_ml: Any, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("api_key") or os.environ.get("COMET_API_KEY"):
        return True
    try:
        return bool(comet_ml.get_config().get_string(None, "comet.api_key"))
    except Exception:
        # An unreadable Comet config means no usable key; offline is the safe choice.
        return False
