"""Write a small deterministic pet-images folder like the one Accelerate's CV examples read.

``python standin_images.py FOLDER`` writes ``FOLDER/<label>_<n>.jpg``: 3 labels, 24 images
each, 64x64 pixels, each label a different dominant colour with seeded noise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

LABELS = ("abyssinian", "beagle", "persian")


def build(folder: Path, per_label: int = 24, size: int = 64) -> Path:
    """Write the images; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k, label in enumerate(LABELS):
        for n in range(per_label):
            pixels = rng.integers(0, 200, size=(size, size, 3))
            pixels[..., k] += 12  # a weak signal: the accuracy moves between epochs
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{label}_{n}.jpg", quality=95)
    return folder


if __name__ == "__main__":
    build(Path(sys.argv[1]))
