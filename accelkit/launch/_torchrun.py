"""``python -m accelkit.launch._torchrun ARGS``: torchrun (``torch.distributed.run``) as the
child of ``accelkit launch``.

This runs torchrun's own ``main`` unchanged, with one difference: when a signal stops the job,
torchrun's agent stops the workers and then re-raises ``SignalException``, which would print some
twenty lines of traceback. Here that one exception ends the process with ``128 + signal``, and
``accelkit launch`` reports the stop in one line (see :mod:`accelkit.launch.signals`).

Before anything else, torchrun arms its death signal (it dies with the launcher, even a SIGKILLed
one) and announces its own pid to the workers, which arm theirs against it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv``; return its exit status (``128 + signal`` when stopped)."""
    from accelkit.launch.signals import ENV_PARENT_PID, die_with_parent

    die_with_parent()
    os.environ[ENV_PARENT_PID] = str(os.getpid())  # the workers' parent: torchrun's agent
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(list(argv))
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
