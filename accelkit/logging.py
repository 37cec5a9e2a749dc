"""``get_logger``: a standard-library logger that logs once across processes by default."""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["MultiProcessAdapter", "get_logger"]


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg,unused-ignore]
    """A logger whose calls accept ``main_process_only`` (default True) and ``in_order``.

    ``main_process_only=True`` logs on process 0 only; ``False`` logs on every process with
    the rank prefixed; ``in_order=True`` makes the processes log one after another.
    """

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` at ``level`` according to ``main_process_only`` / ``in_order``."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        rank = _rank()
        if main_process_only:
            if rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        prefixed = f"[RANK {rank}] {msg}"
        if not in_order:
            self.logger.log(level, prefixed, *args, **kwargs)
            return
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for turn in range(world):
            if turn == rank:
                self.logger.log(level, prefixed, *args, **kwargs)
            if world > 1:
                dist.barrier()


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger for ``name`` whose calls log on the main process only unless told otherwise.

    Args:
        name: the logger's name, usually ``__name__``.
        log_level: a level name or number; default ``ACCELKIT_LOG_LEVEL`` if set.

    Example:
        >>> logger = get_logger(__name__)
        >>> logger.info("once", main_process_only=True)
        >>> logger.info("on every process", main_process_only=False)
    """
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("ACCELKIT_LOG_LEVEL")
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
        logger.root.setLevel(level.upper() if isinstance(level, str) else level)
    return MultiProcessAdapter(logger, {})
