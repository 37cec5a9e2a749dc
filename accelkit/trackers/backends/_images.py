"""Images as the backends that take arrays want them: HWC ``uint8``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["as_numpy", "hwc_uint8"]


def as_numpy(value: Any) -> Any:
    """A tensor as a NumPy array (on the CPU); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def hwc_uint8(image: Any) -> Any:
    """A CHW or HWC tensor or array as an HWC ``uint8`` array (floats are read as 0-1, as
    TensorBoard reads them); anything else (a path, a PIL image) as it is."""
    image = as_numpy(image)
    if not isinstance(image, np.ndarray):
        return image
    if image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[-1] not in (1, 3, 4):
        image = np.moveaxis(image, 0, -1)
    if image.dtype.kind == "f":
        image = (np.clip(image, 0.0, 1.0) * 255).round()
    return image.astype(np.uint8)
