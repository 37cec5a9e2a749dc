"""``accelerate.utils.random``'s names, for scripts that import from that module path.

``from accelerate.utils.random import set_seed`` ports as
``from accelkit.utils.random import set_seed``. The objects are
:mod:`accelkit.runtime.random`'s, re-exported (the same ones :mod:`accelkit.utils` exports).
"""

from __future__ import annotations

from accelkit.runtime.random import (
    RNGType,
    set_seed,
    synchronize_rng_state,
    synchronize_rng_states,
)

__all__ = ["RNGType", "set_seed", "synchronize_rng_state", "synchronize_rng_states"]
