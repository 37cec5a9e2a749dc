"""TensorBoard tracker: event files under ``<logging_dir>/<run_name>``."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import flatten, is_number, scalar_or_text, to_plain

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(GeneralTracker):
    """Write scalars, text, histograms and hyperparameters to TensorBoard event files.

    Numbers become scalars, strings text, dicts of numbers ``add_scalars`` groups and
    multi-element tensors/arrays histograms; anything else is skipped with one warning per key.
    The configuration is written as TensorBoard hparams in the run's own folder (not in an extra
    timestamped sub-run as ``SummaryWriter.add_hparams`` does) and as ``config.json``; lists and
    ``None`` become their text, nested dicts ``outer/inner`` keys.

    Args:
        run_name: the sub-folder of ``logging_dir`` the events go to.
        logging_dir: the run's logging directory.
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.log_dir = os.path.join(self.logging_dir or ".", run_name)
        self.writer: Any = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    @override
    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.log_dir, **self.init_kwargs)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {key: scalar_or_text(value) for key, value in flatten(values).items()}
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "config.json"), "w", encoding="utf-8") as file:
            json.dump(to_plain(values), file, indent=2, default=str)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if is_number(value):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict) and all(is_number(v) for v in value.values()):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            elif _is_array(value):
                self.writer.add_histogram(key, value, global_step=step, **kwargs)
            else:
                self.warn_skipped(key, value, "skipped by TensorBoard")

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Write images: each value is a CHW tensor/array or an NCHW batch."""
        for key, images in values.items():
            if getattr(images, "ndim", 0) == 4:
                self.writer.add_images(key, images, global_step=step, **kwargs)
            else:
                self.writer.add_image(key, images, global_step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _is_array(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return isinstance(value, np.ndarray) and value.size > 0 and value.dtype.kind in "biuf"
