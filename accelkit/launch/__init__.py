"""Starting processes: ``accelkit launch`` and ``notebook_launcher``.

``accelkit.launch`` is a public path: its names are those of :mod:`.launcher`. The room's
modules: :mod:`.launcher` (the command and its torchrun arguments), :mod:`.flags` (every
``accelerate launch`` flag, accepted or refused), :mod:`.config` (Accelerate's config files),
:mod:`.signals` (stopping a launched job), :mod:`._torchrun` (torchrun as the launcher's child),
:mod:`.notebook` (``notebook_launcher``) and :mod:`.debug` (``debug_launcher``).
"""

from accelkit.launch.launcher import (
    LaunchConfig,
    add_launch_arguments,
    config_from_args,
    launch_command,
    notebook_launcher,
    torchrun_args,
)

__all__ = [
    "LaunchConfig",
    "add_launch_arguments",
    "config_from_args",
    "launch_command",
    "notebook_launcher",
    "torchrun_args",
]
