"""``accelkit env``: versions and hardware, to paste into a bug report.

It answers in a fraction of a second because it does not import torch (that takes seconds):
package versions come from their installed metadata, the CUDA/ROCm version torch was built for
from torch's ``version.py`` read as text, and the NVIDIA driver and GPUs from the driver's own
files under ``/sys`` and ``/proc``. ``accelkit env --torch`` also imports torch and reports what
it sees at run time (``torch.cuda.is_available()``, its GPUs, the distributed backends).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["environment_report", "nvidia_driver", "register", "torch_build"]

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
    "trackio",
    "swanlab",
    "clearml",
    "torchdata",
)

# The accelerator fields of torch/version.py: what the installed build was compiled for.
_BUILD_FIELDS = {"cuda": "CUDA", "hip": "ROCm (HIP)", "xpu": "XPU"}


def register(subparsers: Any) -> None:
    """Add the ``env`` subcommand."""
    parser = subparsers.add_parser(
        "env",
        help="print versions and hardware for bug reports",
        description=(
            "Print the versions of accelkit, Python, torch and the optional packages, the "
            "accelerator torch was built for, and the NVIDIA driver and GPUs. Fast: torch is "
            "not imported unless --torch is given."
        ),
    )
    parser.add_argument(
        "--torch",
        action="store_true",
        help=(
            "also import torch and report what it sees at run time: CUDA available, its GPUs, "
            "the torch.distributed backends (takes seconds)"
        ),
    )
    parser.set_defaults(func=_run)


def torch_build() -> dict[str, str | None] | None:
    """What the installed torch was built for, read from ``torch/version.py`` without importing it.

    Returns:
        ``{"version": ..., "cuda": ..., "hip": ..., "xpu": ...}`` (a field is ``None`` when the
        build lacks that accelerator), or ``None`` when torch is not installed or its
        ``version.py`` cannot be read.
    """
    try:
        spec = importlib.util.find_spec("torch")  # locates the package; runs none of its code
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        values: dict[str, str | None] = {}
        for node in tree.body:
            target, value = _assignment(node)
            if target is not None and (value is None or isinstance(value, str)):
                values[target] = value
        values.setdefault("version", values.get("__version__"))
        return {key: values.get(key) for key in ("version", *_BUILD_FIELDS)}
    return None


def _assignment(node: ast.stmt) -> tuple[str | None, object]:
    """``(name, constant)`` of ``name = <constant>`` / ``name: T = <constant>``, else ``None``."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, value = node.targets[0], node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        target, value = node.target, node.value
    else:
        return None, None
    if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
        return target.id, value.value
    return None, None


def nvidia_driver(sys_root: str = "/sys", proc_root: str = "/proc") -> tuple[str | None, list[str]]:
    """The loaded NVIDIA kernel driver's version and the GPUs it drives, from its own files.

    Reads ``<sys_root>/module/nvidia/version`` (else the ``NVRM version`` line of
    ``<proc_root>/driver/nvidia/version``) and the ``Model:`` line of each
    ``<proc_root>/driver/nvidia/gpus/*/information``. No process is started and no library
    loaded, so it is fast and safe on any machine.

    Returns:
        ``(version, gpu_names)``; ``(None, [])`` where no NVIDIA driver is loaded.
    """
    version = _read(Path(sys_root) / "module" / "nvidia" / "version").strip() or None
    if version is None:
        nvrm = _read(Path(proc_root) / "driver" / "nvidia" / "version")
        match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", nvrm)
        version = match.group(1) if match else None
    gpus = []
    gpus_dir = Path(proc_root) / "driver" / "nvidia" / "gpus"
    try:
        buses = sorted(gpus_dir.iterdir())
    except OSError:
        buses = []
    for bus in buses:
        match = re.search(r"^Model:\s*(.+?)\s*$", _read(bus / "information"), re.M)
        if match:
            gpus.append(match.group(1))
    return version, gpus


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def environment_report(check_torch: bool = False) -> dict[str, str]:
    """Versions of accelkit, Python, torch and the optional backends, and the hardware.

    Args:
        check_torch: also import torch and add what it sees at run time (seconds slower).

    Returns:
        Ordered label -> value lines.
    """
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
    build = torch_build()
    accelerators = [
        f"{label} {build[field]}"
        for field, label in _BUILD_FIELDS.items()
        if build and build[field]
    ]
    if build is None:
        info["torch built for"] = "unknown (torch not installed, or its version.py unreadable)"
    else:
        info["torch built for"] = ", ".join(accelerators) or "CPU only"
    driver, gpus = nvidia_driver()
    info["NVIDIA driver"] = driver or "not loaded"
    if gpus:
        info["NVIDIA GPUs"] = f"{len(gpus)}: " + ", ".join(gpus)
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        info["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    if check_torch:
        info.update(_torch_runtime())
    elif build is not None and not accelerators:
        info["CUDA available"] = "False (CPU-only torch build)"
    else:
        info["CUDA available"] = "not checked: `accelkit env --torch` asks torch (takes seconds)"
    return info


def _torch_runtime() -> dict[str, str]:
    """What an imported torch sees: CUDA, its devices, the distributed backends."""
    import torch
    import torch.distributed as dist

    info = {"CUDA available": str(torch.cuda.is_available())}
    if torch.cuda.is_available():
        info["torch GPUs"] = ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        )
    if not dist.is_available():
        info["torch.distributed backends"] = "none (torch built without distributed)"
        return info
    checks = (
        ("gloo", dist.is_gloo_available),
        ("nccl", dist.is_nccl_available),
        ("mpi", dist.is_mpi_available),
    )
    info["torch.distributed backends"] = ", ".join(b for b, ok in checks if ok()) or "none"
    return info


def _run(args: argparse.Namespace) -> int:
    info = environment_report(check_torch=args.torch)
    width = max(len(k) for k in info)
    print("Copy-and-paste the text below in your bug report.\n")
    for key, value in info.items():
        print(f"- {key.ljust(width)} : {value}")
    return 0
