"""Starting processes: ``accelkit launch`` and ``notebook_launcher``.

``accelkit.launch`` is a public path: its names are those of :mod:`.launcher`. The room's
modules: :mod:`.launcher` (the command and its torchrun arguments), :mod:`.flags` (every
``accelerate launch`` flag, accepted or refused), :mod:`.config` (Accelerate's config files),
:mod:`.signals` (stopping a launched job), :mod:`._failure` (the failed worker's error, for
the launcher's last line), :mod:`._torchrun` (torchrun as the launcher's child),
:mod:`.notebook` (``notebook_launcher``) and :mod:`.debug` (``debug_launcher``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

__all__ = [
    "LaunchConfig",
    "add_launch_arguments",
    "config_from_args",
    "launch_command",
    "notebook_launcher",
    "torchrun_args",
]

# Resolved on first use: importing one module of this room (``accelkit.launch.<module>``) runs
# this file, and must not import what the room's heavier modules need (torch, for the
# command line's cheap commands).
__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "accelkit.launch.launcher"))

if TYPE_CHECKING:
    from accelkit.launch.launcher import (
        LaunchConfig,
        add_launch_arguments,
        config_from_args,
        launch_command,
        notebook_launcher,
        torchrun_args,
    )
