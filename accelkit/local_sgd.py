"""``accelerate.local_sgd``'s public name, for scripts ported by changing their imports.

:class:`LocalSGD` lives in :mod:`accelkit.training.local_sgd`.
"""

from __future__ import annotations

from accelkit.training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
