"""Stand-in ``torchvision.transforms``: Compose, RandomResizedCrop, Resize, ToTensor.

The random crop draws from torch's global generator, as torchvision's does, so a script's seed
(and each DataLoader worker's seed) decides it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["Compose", "RandomResizedCrop", "Resize", "ToTensor"]


def _size(size: int | Sequence[int]) -> tuple[int, int]:
    """(height, width)."""
    if isinstance(size, int):
        return size, size
    return int(size[0]), int(size[1])


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for t in self.transforms:
            image = t(image)
        return image


class Resize:
    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _size(size)

    def __call__(self, image: Image.Image) -> Image.Image:
        h, w = self.size
        return image.resize((w, h), Image.Resampling.BILINEAR)


class RandomResizedCrop:
    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.size = _size(size)
        self.scale = scale
        self.ratio = ratio

    def __call__(self, image: Image.Image) -> Image.Image:
        width, height = image.size
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        box = (0, 0, width, height)
        for _ in range(10):
            target = area * torch.empty(1).uniform_(*self.scale).item()
            aspect = math.exp(torch.empty(1).uniform_(*log_ratio).item())
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                box = (left, top, left + w, top + h)
                break
        out_h, out_w = self.size
        return image.crop(box).resize((out_w, out_h), Image.Resampling.BILINEAR)


class ToTensor:
    def __call__(self, image: Image.Image) -> torch.Tensor:
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
