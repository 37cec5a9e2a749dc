"""Accelerate's trackers that accelkit does not build in, under their Accelerate names.

``from accelkit.tracking import AimTracker`` works, so a script written for Accelerate imports
without change; creating one (or selecting ``LoggerType.AIM`` in ``log_with``) fails with a
:class:`~accelkit.trackers.registry.TrackerNotBuiltInError` that says how to add the backend as
a `GeneralTracker`. A tracker registered under the same name is used instead.
"""

from __future__ import annotations

from typing import Any

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.registry import TrackerNotBuiltInError, not_built_in_message

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "DVCLiveTracker",
    "SwanLabTracker",
    "TrackioTracker",
]


class _NotBuiltIn(GeneralTracker):
    """A stand-in class whose construction explains what to do instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TrackerNotBuiltInError(not_built_in_message(self.name))


class AimTracker(_NotBuiltIn):
    """Not built in (Accelerate's ``AimTracker``); creating one raises and says what to do."""

    name = "aim"
    requires_logging_directory = True


class ClearMLTracker(_NotBuiltIn):
    """Not built in (Accelerate's ``ClearMLTracker``); creating one raises and says what to do."""

    name = "clearml"


class DVCLiveTracker(_NotBuiltIn):
    """Not built in (Accelerate's ``DVCLiveTracker``); creating one raises and says what to do."""

    name = "dvclive"


class SwanLabTracker(_NotBuiltIn):
    """Not built in (Accelerate's ``SwanLabTracker``); creating one raises and says what to do."""

    name = "swanlab"


class TrackioTracker(_NotBuiltIn):
    """Not built in (Accelerate's ``TrackioTracker``); creating one raises and says what to do."""

    name = "trackio"
