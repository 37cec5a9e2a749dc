"""``accelerate.tracking``'s public names, for scripts ported by changing their imports.

The tracker classes (``TensorBoardTracker``, ``WandBTracker``, ``CometMLTracker``,
``MLflowTracker``, ``AimTracker``, ``TrackioTracker``, ``SwanLabTracker``, ``ClearMLTracker``,
``DVCLiveTracker``, ``GeneralTracker``), ``on_main_process``, ``register_tracker_class``,
``filter_trackers`` and ``get_available_trackers`` keep Accelerate's signatures: every tracker
Accelerate ships is built in.

accelkit's own API for the same things is :mod:`accelkit.trackers` (``register_tracker``,
``installed_trackers``, ``TrackerHub``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from accelkit.errors import ConfigurationError
from accelkit.trackers.backends.aim import AimTracker
from accelkit.trackers.backends.clearml import ClearMLTracker
from accelkit.trackers.backends.comet_ml import CometMLTracker
from accelkit.trackers.backends.dvclive import DVCLiveTracker
from accelkit.trackers.backends.jsonl import JSONLTracker
from accelkit.trackers.backends.mlflow import MLflowTracker
from accelkit.trackers.backends.swanlab import SwanLabTracker
from accelkit.trackers.backends.tensorboard import TensorBoardTracker
from accelkit.trackers.backends.trackio import TrackioTracker
from accelkit.trackers.backends.wandb import WandBTracker
from accelkit.trackers.base import GeneralTracker, on_main_process
from accelkit.trackers.registry import (
    TRACKER_CLASSES,
    LoggerType,
    installed_trackers,
    register_tracker,
    resolve_log_with,
)

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "LoggerType",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker",
    "register_tracker_class",
]


LOGGER_TYPE_TO_CLASS = TRACKER_CLASSES
"""Tracker name -> class, as Accelerate's table of the same name: built-ins and registered
classes (a live view of the registry that :func:`register_tracker_class` fills). It behaves as
Accelerate's dict: ``copy()`` gives a plain dict, and ``clear()``, ``update()``, item assignment
and ``del`` change what ``log_with=<name>`` and ``"all"`` find (see
:class:`~accelkit.trackers.registry.TrackerClassTable`)."""


def _as_logger_type(name: str) -> LoggerType | str:
    return LoggerType(name) if name in LoggerType else name


def get_available_trackers() -> list[LoggerType | str]:
    """The trackers ``log_with="all"`` would use: built-ins whose package is installed, and
    registered trackers (as ``LoggerType`` members where one exists, else their names)."""
    return [_as_logger_type(name) for name in installed_trackers()]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Register a `GeneralTracker` subclass under its ``name``, as Accelerate's function does.

    As in Accelerate, a name already taken (a built-in included) is replaced with a warning;
    :func:`accelkit.register_tracker` refuses that unless ``overwrite=True``.

    Args:
        tracker_class: the tracker class, with a non-empty ``name``.

    Raises:
        ValueError: ``tracker_class`` is not a `GeneralTracker` subclass, has no ``name``, or
            does not set ``requires_logging_directory`` itself (Accelerate's base class has no
            default for it).
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ConfigurationError(
            f"register_tracker_class() takes a subclass of accelkit.tracking.GeneralTracker, "
            f"got {tracker_class!r}. Subclass GeneralTracker and set its `name`."
        )
    name = getattr(tracker_class, "name", "")
    if not name:
        raise ConfigurationError(
            f"Tracker class {tracker_class.__qualname__} has no `name`; set a class attribute "
            'such as `name = "my_tracker"` before registering it.'
        )
    # accelkit's GeneralTracker gives requires_logging_directory a default (False); Accelerate's
    # does not, and refuses a class that does not set it. A class that relies on the default
    # would run here and fail on Accelerate, so it is refused here too.
    own = [klass for klass in tracker_class.__mro__ if klass is not GeneralTracker]
    if not any("requires_logging_directory" in vars(klass) for klass in own):
        raise ConfigurationError(
            f"Tracker class {tracker_class.__qualname__} does not set "
            "`requires_logging_directory`; set the class attribute to True if the tracker "
            "needs a logging directory, or False otherwise."
        )
    # As Accelerate: replacing any known tracker (installed or not) is said.
    if name in LOGGER_TYPE_TO_CLASS and LOGGER_TYPE_TO_CLASS[name] is not tracker_class:
        warnings.warn(
            f"A tracker named {name!r} already exists and is replaced by {tracker_class!r}.",
            UserWarning,
            stacklevel=2,
        )
    register_tracker(tracker_class, overwrite=True)


def filter_trackers(
    log_with: Any, logging_dir: str | os.PathLike[str] | None = None
) -> list[LoggerType | str | GeneralTracker]:
    """Check ``log_with`` as ``Accelerator(log_with=...)`` does and list what it selects.

    Args:
        log_with: a name, a `LoggerType`, a `GeneralTracker` instance, ``"all"``, or a list.
        logging_dir: the logging directory, or ``None``.

    Returns:
        `LoggerType` members (names for registered trackers without one) and the given
        instances, without repeats.

    Raises:
        ValueError: an unknown name, or a tracker that needs a logging directory without one.
        ImportError: a tracker whose package is not installed (with the pip command).
    """
    directory = None if logging_dir is None else os.fspath(logging_dir)
    return [
        item if isinstance(item, GeneralTracker) else _as_logger_type(item.name)
        for item in resolve_log_with(log_with, directory)
    ]
