"""Offline stand-in for ``timm.create_model``: a tiny CNN with ``get_classifier``/``default_cfg``.

``pretrained=True`` loads a fixed-seed backbone (the same weights every time, without touching
the global generator); the classifier for ``num_classes`` is initialised from the global
generator, as a new timm head is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["create_model"]


class _TinyNet(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=8, stride=8),
            nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(16, num_classes)
        self.default_cfg: dict[str, Any] = {
            "mean": (0.485, 0.456, 0.406),
            "std": (0.229, 0.224, 0.225),
        }

    def get_classifier(self) -> nn.Module:
        return self.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def create_model(
    name: str, pretrained: bool = False, num_classes: int = 1000, **_: Any
) -> nn.Module:
    """The stand-in model (whatever ``name``: the examples ask for resnet50d)."""
    model = _TinyNet(num_classes)
    if pretrained:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.features.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model
