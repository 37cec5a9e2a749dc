"""Weights & Biases tracker: the run's files go under ``<logging_dir>/wandb``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import to_plain

__all__ = ["WandBTracker"]


class WandBTracker(GeneralTracker):
    """Log to Weights & Biases (online, or offline with ``WANDB_MODE=offline``).

    Unlike the reference tracker, which lets wandb write to ``./wandb`` whatever the project
    directory, the run's files go to ``<logging_dir>/wandb`` when a logging directory is set
    (``dir=`` in ``init_kwargs`` overrides it). The configuration is converted to plain data
    (tensors to numbers or lists, paths to text) so wandb can serialise it. wandb stores numbers,
    strings, arrays and its media objects itself; any other value is logged as its text with one
    warning per key.

    Args:
        run_name: the wandb project.
        logging_dir: the run's logging directory.
        **kwargs: passed to ``wandb.init`` (``name``, ``entity``, ``tags``, ``mode``, ...).
    """

    name = "wandb"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run: Any = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``wandb.Run``."""
        return self.run

    @override
    def start(self) -> None:
        import wandb

        kwargs = dict(self.init_kwargs)
        if self.logging_dir is not None:
            kwargs.setdefault("dir", self.logging_dir)
        if kwargs.get("dir") is not None:
            os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(project=self.run_name, **kwargs)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(to_plain(values), allow_val_change=True)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from wandb.sdk.data_types.base_types.wb_value import WBValue

        for key, value in values.items():
            if not _storable(value, WBValue):
                self.warn_skipped(key, value, "logged to wandb as its text")
                values[key] = str(value)
        self.run.log(values, step=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: each value is an image (or list of images) ``wandb.Image`` accepts."""
        import wandb

        images = {
            key: [wandb.Image(v) for v in value] if isinstance(value, list) else wandb.Image(value)
            for key, value in values.items()
        }
        self.run.log(images, step=step, **kwargs)

    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Log a ``wandb.Table`` from ``columns`` and ``data`` rows, or from a ``dataframe``.

        Args:
            table_name: the key the table is logged under.
            columns: the column names.
            data: the rows (any values ``wandb.Table`` accepts: text, numbers, media).
            dataframe: a pandas ``DataFrame`` instead of ``columns``/``data``.
            step: the training step.
            **kwargs: passed to ``Run.log``.
        """
        import wandb

        if self.run is None:
            raise RuntimeError(
                "WandBTracker.log_table() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )
        names: list[str | int] | None = None if columns is None else list(columns)
        table = wandb.Table(columns=names, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def _storable(value: Any, media: type) -> bool:
    """Whether wandb can serialise ``value`` itself (JSON data, arrays, its media objects)."""
    if isinstance(value, (int, float, str, type(None), torch.Tensor, np.ndarray, media)):
        return True
    if isinstance(value, dict):
        return all(_storable(v, media) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_storable(v, media) for v in value)
    return False
