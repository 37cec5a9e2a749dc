"""Experiment tracking: `GeneralTracker`, the tracker registry and `TrackerHub`.

Importing this package imports no tracking SDK; each backend imports its SDK when a run starts.
"""

from accelkit.trackers.base import GeneralTracker, on_main_process
from accelkit.trackers.delivery.hub import TrackerError, TrackerFailure, TrackerHub, TrackerWarning
from accelkit.trackers.delivery.options import TrackerOptions
from accelkit.trackers.events import CheckpointEvent
from accelkit.trackers.registry import (
    LoggerType,
    available_trackers,
    get_tracker_class,
    installed_trackers,
    register_tracker,
    registered_trackers,
    unregister_tracker,
)

__all__ = [
    "CheckpointEvent",
    "GeneralTracker",
    "LoggerType",
    "TrackerError",
    "TrackerFailure",
    "TrackerHub",
    "TrackerOptions",
    "TrackerWarning",
    "available_trackers",
    "get_tracker_class",
    "installed_trackers",
    "on_main_process",
    "register_tracker",
    "registered_trackers",
    "unregister_tracker",
]
