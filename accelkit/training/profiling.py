"""Profiling a block of a training loop with ``torch.profiler``.

:class:`ProfileKwargs` configures it (pass it in ``Accelerator(kwargs_handlers=[...])``, or
straight to :meth:`Accelerator.profile`); :func:`profile` is the context manager behind
``with accelerator.profile() as prof:``. With ``output_trace_dir`` set, every process writes its
Chrome trace to ``<output_trace_dir>/profile_<process index>.json`` when the block ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.profiler

from accelkit.errors import ConfigurationError
from accelkit.training.kwargs_handlers import KwargsHandler

__all__ = ["PROFILE_PATTERN_NAME", "ProfileKwargs", "profile"]

#: File name of each process's Chrome trace in ``output_trace_dir`` (``suffix`` = process index).
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

_ACTIVITIES = {
    "cpu": "CPU",
    "cuda": "CUDA",
    "xpu": "XPU",
    "mtia": "MTIA",
    "hpu": "HPU",
}
_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of ``torch.profiler.profile`` for :meth:`Accelerator.profile`.

    Args:
        activities: devices to profile, among ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"mtia"``,
            ``"hpu"`` (default: the CPU, plus CUDA when it is available).
        schedule_option: ``torch.profiler.schedule`` arguments (``wait``, ``warmup``,
            ``active``, ``repeat``, ``skip_first``); call ``prof.step()`` once per iteration.
        on_trace_ready: called with the profiler when a scheduled cycle ends.
        record_shapes: record operator input shapes.
        profile_memory: track tensor memory allocation.
        with_stack: record source locations.
        with_flops: estimate FLOPs of matrix multiplications and convolutions.
        with_modules: record the module hierarchy.
        output_trace_dir: folder where each process writes ``profile_<index>.json``.

    Example:
        >>> handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1})
        >>> accelerator = Accelerator(kwargs_handlers=[handler])
        >>> with accelerator.profile() as prof:
        ...     for _ in range(5):
        ...         train_step()
        ...         prof.step()
    """

    activities: list[Literal["cpu", "xpu", "mtia", "cuda", "hpu"]] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def _activities(self) -> list[torch.profiler.ProfilerActivity]:
        names = self.activities
        if names is None:
            names = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        out = []
        for name in names:
            member = _ACTIVITIES.get(name)
            activity = getattr(torch.profiler.ProfilerActivity, member or "", None)
            if activity is None:
                raise ConfigurationError(
                    f"Unknown or unavailable profiler activity {name!r}; expected some of "
                    f"{sorted(_ACTIVITIES)} that this PyTorch build supports."
                )
            out.append(activity)
        return out

    def _schedule(self) -> Callable[[int], Any] | None:
        if self.schedule_option is None:
            return None
        unknown = set(self.schedule_option) - set(_SCHEDULE_KEYS)
        if unknown:
            raise ConfigurationError(
                f"Unknown schedule_option key(s) {sorted(unknown)}; expected some of "
                f"{list(_SCHEDULE_KEYS)} (torch.profiler.schedule arguments)."
            )
        options = {"wait": 0, "warmup": 0, "active": 1, **self.schedule_option}
        return torch.profiler.schedule(**options)

    def build(self) -> torch.profiler.profile:
        """A ``torch.profiler.profile`` configured from these settings (not started)."""
        return torch.profiler.profile(
            activities=self._activities(),
            schedule=self._schedule(),
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@contextlib.contextmanager
def profile(handler: ProfileKwargs | None, process_index: int) -> Iterator[torch.profiler.profile]:
    """Profile the block; yields the running ``torch.profiler.profile``.

    Args:
        handler: the settings (default: :class:`ProfileKwargs` defaults).
        process_index: names this process's trace file when ``output_trace_dir`` is set.
    """
    handler = handler or ProfileKwargs()
    with handler.build() as prof:
        yield prof
    if handler.output_trace_dir:
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        prof.export_chrome_trace(
            os.path.join(
                handler.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=process_index)
            )
        )
