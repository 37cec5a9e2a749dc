"""A tiny regression problem: ``y = a * x + b`` plus noise, learned by two scalars."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from accelkit.errors import ConfigurationError

__all__ = ["RegressionDataset", "RegressionModel"]


class RegressionDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """``length`` samples ``{"x": x, "y": a * x + b + noise}`` (float32, noise std 0.1).

    Args:
        a: the slope.
        b: the intercept.
        length: the number of samples.
        seed: seeds NumPy's generator, so that every process builds the same data.
    """

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with two trainable scalars.

    Args:
        a: the initial slope.
        b: the initial intercept.
        double_output: return the output twice (a tuple), to test nested outputs.
    """

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.double_output = double_output

    def forward(self, x: torch.Tensor | None = None) -> Any:
        if x is None:
            raise ConfigurationError("RegressionModel needs an input tensor x.")
        out = x * self.a + self.b
        return (out, out) if self.double_output else out
