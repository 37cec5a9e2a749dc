"""``accelkit env``: versions and hardware, to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from typing import Any

_PACKAGES = (
    "accelkit",
    "torch",
    "safetensors",
    "fsspec",
    "numpy",
    "tqdm",
    "s3fs",
    "tensorboard",
    "wandb",
    "comet_ml",
    "mlflow",
    "torchdata",
)


def register(subparsers: Any) -> None:
    """Add the ``env`` subcommand."""
    parser = subparsers.add_parser("env", help="print versions and hardware for bug reports")
    parser.set_defaults(func=_run)


def environment_report() -> dict[str, str]:
    """Versions of accelkit, Python, torch and the optional backends, and the hardware."""
    import torch

    info: dict[str, str] = {
        "Python": sys.version.split()[0],
        "Platform": platform.platform(),
        "CPU cores": str(os.cpu_count()),
    }
    for name in _PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    info["CUDA available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        info["CUDA version"] = str(torch.version.cuda)
        info["GPUs"] = ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        )
    info["torch.distributed backends"] = ", ".join(
        b
        for b, ok in (
            ("gloo", torch.distributed.is_gloo_available()),
            ("nccl", torch.distributed.is_nccl_available()),
        )
        if ok
    )
    return info


def _run(args: argparse.Namespace) -> int:
    info = environment_report()
    width = max(len(k) for k in info)
    print("Copy-and-paste the text below in your bug report.\n")
    for key, value in info.items():
        print(f"- {key.ljust(width)} : {value}")
    return 0
