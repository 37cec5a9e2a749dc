"""Comet tracker: offline archives go under ``<logging_dir>/comet_ml``."""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from accelkit.trackers.backends._reference import continuable_id
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

if TYPE_CHECKING:
    from accelkit.trackers.events import CheckpointEvent

__all__ = ["CometMLTracker"]

# Where each kind of checkpoint event keeps the checkpoint's path.
_PATH_KEYS = {
    "save": "checkpoint/latest",
    "load": "checkpoint/resumed_from",
    "replicate": "checkpoint/latest_remote",
}

_COMET_DEFAULT_OFFLINE_DIR = ".cometml-runs"
# Comet's experiment keys: 32 to 50 letters and digits.
_EXPERIMENT_KEY = re.compile(r"[A-Za-z0-9]{32,50}")
# init_kwargs that already say which experiment to open: the user's choice wins.
_OWN_EXPERIMENT_CHOICE = ("experiment_key", "mode")
RESUMED_AT_STEP = "accelkit/resumed_at_step"


class CometMLTracker(GeneralTracker):
    """Log to Comet through ``comet_ml.start``.

    When no Comet API key is configured and ``online`` is not given, the experiment runs offline
    (the reference fails instead); offline archives are written to ``<logging_dir>/comet_ml``
    rather than ``./.cometml-runs``. Numbers go to ``log_metrics``, dicts of numbers to
    ``log_metrics`` with the key as prefix, strings to ``log_other`` (with one warning per key:
    Comet keeps only their latest value); anything else is skipped with one warning per key.

    Experiment continuity: a new experiment's key is accelkit's run key (:meth:`name_run`; an
    ``experiment_key`` in ``init_kwargs`` wins), so every checkpoint records
    ``{"experiment_key", "project"}`` from the first save, before ``comet_ml.start`` has
    returned. A job resumed from it continues that experiment
    (``comet_ml.start(experiment_key=..., mode="get_or_create")``), but only when the
    checkpoint's project is the project this tracker logs to (``run_name``); the workspace and
    server come from this job's settings, never from the checkpoint. An ``experiment_key`` or
    ``mode`` in ``init_kwargs`` wins over the checkpoint. Online the server is asked first: an
    experiment it finds in another workspace or project (a key is valid across them) is a
    warning and a new experiment; one it does not find is created with that key (the job that
    saved the checkpoint was killed before its experiment reached the server). Offline nothing
    can be asked: ``comet upload`` appends the new archive to the experiment, or creates it
    with that key when it never reached the server (an offline job killed before ``end()``
    leaves no data, only an empty archive: Comet writes its archive at the end). Comet cannot
    forget
    the points logged after the checkpoint, so the experiment records where it was resumed
    (``log_other("accelkit/resumed_at_step", <checkpoint's step>)``).

    Checkpoint events: their numbers are logged with ``log_metrics`` at the event's step, and
    ``log_other`` keeps the last saved checkpoint's path (``checkpoint/latest``) and the one
    the experiment resumed from (``checkpoint/resumed_from``).

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
        self._resume: tuple[str, int] | None = None
        self._key: str | None = None  # the key a new experiment gets (see name_run)
        self._logged = False  # values were logged through this tracker (see discard_run)

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
        resume, self._resume = self._resume, None
        if resume is not None and self._start_continued(comet_ml, config, kwargs, *resume):
            return
        if resume is None and self._key is not None and not _own_choice(kwargs):
            kwargs.update(experiment_key=self._key, mode="create")
        self.experiment = comet_ml.start(
            project_name=self.run_name, experiment_config=config, **kwargs
        )
        self._logged = False

    def _start_continued(
        self, comet_ml: Any, config: Any, kwargs: dict[str, Any], key: str, step: int
    ) -> bool:
        """Continue experiment ``key``; ``False`` (and a warning) when it cannot be."""
        online = kwargs.get("online") is not False
        try:  # get_or_create: a key the server never saw is the checkpoint's, created now
            if online:
                workspace = kwargs.get("workspace") or comet_ml.get_config().get_string(
                    None, "comet.workspace"
                )
                api = comet_ml.API(api_key=kwargs.get("api_key"))
                refused = _experiment_elsewhere(api, key, workspace, self.run_name)
                if refused is not None:
                    _warn(f"{refused}; logging to a new experiment")
                    return False
            self.experiment = comet_ml.start(
                project_name=self.run_name,
                experiment_config=config,
                experiment_key=key,
                mode="get_or_create",
                **kwargs,
            )
        except Exception as error:
            _warn(
                f"could not continue Comet experiment {key!r} ({type(error).__name__}: "
                f"{error}); logging to a new experiment"
            )
            return False
        self.experiment.log_other(RESUMED_AT_STEP, step)
        return True

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.experiment.log_parameters(to_plain(values))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._logged = True
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
        self._logged = True
        for key, image in values.items():
            self.experiment.log_image(image, name=key, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.experiment is not None:
            self.experiment.end()

    @override
    def discard_run(self) -> bool:
        """Delete the offline archive of the experiment :meth:`start` created, given up for a
        checkpoint's run, when no value was logged to it (through this tracker or its
        ``experiment``'s metrics: its parameters only), and forget the experiment.

        An online experiment is kept (deleting it needs Comet's API and key): accelkit names
        it in a warning.

        Returns:
            ``True`` if the archive was deleted; ``False`` if the experiment is kept.
        """
        experiment, self.experiment = self.experiment, None
        if experiment is None:
            return True
        folder = getattr(experiment, "offline_directory", None)
        if self._logged or getattr(experiment, "metrics", None) or not folder:
            return False
        archive = os.path.join(folder, f"{experiment.get_key()}.zip")
        if not os.path.isfile(archive):
            return False
        os.remove(archive)
        return True

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """A new experiment's key is ``key`` (an ``experiment_key`` in ``init_kwargs`` wins);
        ``None`` when ``init_kwargs`` has a ``mode`` of its own.

        Args:
            key: the run key (32 letters and digits: a valid Comet experiment key).
        """
        self._key = None
        if "mode" in self.init_kwargs:
            return None
        chosen = self.init_kwargs.get("experiment_key") or key
        if not isinstance(chosen, str) or not _EXPERIMENT_KEY.fullmatch(chosen):
            return None
        self._key = key
        return {"experiment_key": chosen, "project": self.run_name}

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"experiment_key", "project"}`` of the experiment."""
        if self.experiment is None:
            return None
        return {"experiment_key": self.experiment.get_key(), "project": self.run_name}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` continue the checkpoint's experiment, in this project.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step, recorded as ``accelkit/resumed_at_step``.
        """
        self._resume = None
        if reference is None or _own_choice(self.init_kwargs):
            return
        key = continuable_id(
            "comet_ml",
            reference,
            id_key="experiment_key",
            id_name="an experiment key",
            pattern=_EXPERIMENT_KEY,
            expected="32-50 letters and digits",
            project=reference.get("project"),
            own_project=self.run_name,
            new="experiment",
        )
        if key is None:
            self._key = None  # refused: a new experiment, with a key of Comet's own
            return
        self._resume = (key, int(step))

    @override
    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """Log the event's numbers at its step and keep the checkpoint's path."""
        if self.experiment is None:
            return
        self._logged = True
        if event.values:
            self.experiment.log_metrics(dict(event.values), step=event.step)
        key = _PATH_KEYS[event.kind]
        self.experiment.log_other(key, event.path)


def _experiment_elsewhere(api: Any, key: str, workspace: str | None, project: str) -> str | None:
    """Why the Comet server's experiment ``key`` may not be continued here (``None``: it may).

    A Comet key names an experiment in any workspace the API key can reach, so a key read from
    a checkpoint is only followed when the server puts it in this run's workspace and project.

    Args:
        api: a ``comet_ml.API`` (``get_experiment_by_key``, ``get_default_workspace``).
        key: the checkpoint's experiment key.
        workspace: the workspace this run logs to (``None``: the API key's default one).
        project: the project this run logs to.

    Returns:
        The reason, or ``None`` when the experiment is in this workspace and project, or is
        not on the server (it is created there with this key: the checkpoint named it before
        its job's experiment reached the server).
    """
    found = api.get_experiment_by_key(key)
    if found is None:
        return None
    workspace = workspace or api.get_default_workspace()
    if found.workspace != workspace or (found.project_name or "").lower() != project.lower():
        return (
            f"Comet experiment {key!r} is in {found.workspace}/{found.project_name}, not in "
            f"this run's {workspace}/{project}"
        )
    return None


def _own_choice(kwargs: dict[str, Any]) -> bool:
    """Whether ``init_kwargs`` already say which experiment to open."""
    return any(key in kwargs for key in _OWN_EXPERIMENT_CHOICE)


def _warn(what: str) -> None:
    warnings.warn(f"Tracker 'comet_ml': {what}.", UserWarning, stacklevel=3)


def _has_api_key(comet_ml: Any, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("api_key") or os.environ.get("COMET_API_KEY"):
        return True
    try:
        return bool(comet_ml.get_config().get_string(None, "comet.api_key"))
    except Exception:
        # An unreadable Comet config means no usable key; offline is the safe choice.
        return False
