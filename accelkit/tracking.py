"""Compatibility module: ``accelkit.tracking.GeneralTracker`` as in ``accelerate.tracking``."""

from accelkit.trackers import GeneralTracker, LoggerType, register_tracker

__all__ = ["GeneralTracker", "LoggerType", "register_tracker"]
