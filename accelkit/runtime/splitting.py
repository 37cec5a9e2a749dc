"""How :meth:`~accelkit.runtime.state.PartialState.split_between_processes` shares inputs out: a
pure function of the inputs, the process count and the process index."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from accelkit.errors import ConfigurationError, WrongTypeError

__all__ = ["split_for_process"]


def _share(length: int, num_processes: int, index: int) -> tuple[int, int]:
    per, extra = divmod(length, num_processes)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    return start, end


def split_for_process(inputs: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    """Pure splitting rule behind :meth:`PartialState.split_between_processes`."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigurationError(
                "split_between_processes needs every value of the dict to have the same length; "
                f"got lengths {lengths}."
            )
        return cast(Any, type(inputs))(
            {
                k: split_for_process(v, num_processes, index, apply_padding)
                for k, v in inputs.items()
            }
        )
    if isinstance(inputs, torch.Tensor):
        length = inputs.shape[0]
    elif isinstance(inputs, (list, tuple)):
        length = len(inputs)
    elif callable(getattr(inputs, "select", None)) and hasattr(inputs, "__len__"):
        return _split_selectable(inputs, num_processes, index, apply_padding)
    else:
        raise WrongTypeError(
            f"split_between_processes takes a list, tuple, dict, tensor or a Hugging Face "
            f"datasets.Dataset, not {type(inputs).__name__}."
        )
    start, end = _share(length, num_processes, index)
    part = inputs[start:end]
    if apply_padding:
        target = -(-length // num_processes)
        missing = target - (end - start)
        if missing > 0 and length > 0:
            filler = part[-1:] if end > start else inputs[-1:]
            if isinstance(inputs, torch.Tensor):
                part = torch.cat([part, *([filler] * missing)])
            else:
                part = part + type(part)(filler) * missing
    return part


def _split_selectable(inputs: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    # A Hugging Face datasets.Dataset (anything with len() and select(indices)): slicing it
    # returns a dict of columns, so rows are picked with select(), which keeps the type.
    length = len(inputs)
    start, end = _share(length, num_processes, index)
    rows = list(range(start, end))
    if apply_padding and length > 0:
        target = -(-length // num_processes)
        rows += [rows[-1] if rows else length - 1] * (target - len(rows))
    return inputs.select(rows)
