"""Kwargs handlers: extra arguments for objects the ``Accelerator`` creates for you.

Pass instances in ``Accelerator(kwargs_handlers=[...])``, as with the reference::

    Accelerator(
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=1024), DistributedDataParallelKwargs(
            find_unused_parameters=True)],
    )

Only the fields you change are passed on, so PyTorch's own defaults apply to the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AutocastKwargs", "DistributedDataParallelKwargs", "GradScalerKwargs", "KwargsHandler"]


class KwargsHandler:
    """Base of the kwargs handlers: :meth:`to_kwargs` returns the fields that differ from the
    defaults."""

    def to_kwargs(self) -> dict[str, Any]:
        """The fields set to something other than their default."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of the fp16 ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``torch.nn.parallel.DistributedDataParallel``."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of ``torch.autocast`` for :meth:`Accelerator.autocast`."""

    enabled: bool = True
    cache_enabled: bool | None = None


def collect(handlers: list[Any], kind: type[KwargsHandler]) -> dict[str, Any]:
    """The merged ``to_kwargs()`` of every handler of type ``kind`` in ``handlers``."""
    out: dict[str, Any] = {}
    for handler in handlers:
        if isinstance(handler, kind):
            out.update(handler.to_kwargs())
    return out
