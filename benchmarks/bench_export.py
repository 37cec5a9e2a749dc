"""Export and diff of a checkpoint, side by side with reading its bytes (#42's targets).

One process saves two accelkit checkpoints of the same model (``A``, then ``B`` with one layer
changed; SGD, so the model's weights are nearly all the bytes), then times, in alternating
order:

- ``read model``: the model's safetensors files of ``A`` read with 8 MiB ``readinto`` calls
  (what any export has to read);
- ``copy model``: the same files read and written to new files, made durable with ``fsync``
  (what any export has to read and write: its honest lower bound where the disk writes slower
  than it reads);
- ``export``: :func:`accelkit.checkpointing.interop.hf_export.export_hf` of ``A`` into a fresh
  folder (read, checksums verified, Hugging Face safetensors written and made durable), with the
  peak memory it adds;
- ``read both``: every file of ``A`` and ``B``;
- ``diff``: :func:`accelkit.checkpointing.catalog.diff.diff_checkpoints` of ``A`` and ``B``.

Cold reads (the page cache dropped before each timed call) where this process may drop it
(root), warm otherwise; the result says which. Targets (issue #42): export at >= 0.8x the read
rate of the same bytes, its peak memory <= the largest tensor + 200 MB; diff <= 1.2x the time to
read both checkpoints. The export is also given beside the copy of its bytes, without a target
of its own.

Usage::

    python -m benchmarks.bench_export [--quick]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Target,
    alternate,
    drop_page_cache,
    print_table,
    rmtree,
    scratch_dir,
    section,
    summarise,
    write_result,
)

MB = 2**20
_BUFFER = 8 * MB


def _save_pair(root: Path, total_bytes: int, layers: int) -> tuple[Path, Path, int]:
    """Checkpoints ``A`` and ``B`` (one layer changed) of a model of about ``total_bytes``;
    their paths and the largest tensor's size in bytes."""
    from accelkit import Accelerator, ProjectConfiguration

    width = int((total_bytes / layers / 4) ** 0.5)
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    a = Path(accelerator.save_state())
    with torch.no_grad():
        model[layers // 2].weight.add_(1.0)
    b = Path(accelerator.save_state())
    accelerator.end_training()
    return a, b, width * width * 4


def _read(paths: list[Path]) -> int:
    """Read every file in ``paths`` to its end; the bytes read."""
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def _copy(paths: list[Path], into: Path) -> int:
    """Read every file in ``paths`` and write its bytes to a new file in ``into``, each made
    durable (``fsync``, then the folder's); the bytes copied."""
    into.mkdir()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    total = 0
    for number, path in enumerate(paths):
        with open(path, "rb", buffering=0) as f, open(into / str(number), "wb", buffering=0) as g:
            while n := f.readinto(view):
                g.write(view[:n])
                total += n
            os.fsync(g.fileno())
    folder = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return total


def _files(folder: Path, suffix: str = "") -> list[Path]:
    return sorted(p for p in folder.rglob(f"*{suffix}") if p.is_file())


def main(quick: bool = False) -> dict[str, Any]:
    """Measure, print a table, and write ``benchmarks/results/export.json``."""
    from accelkit.checkpointing.catalog.diff import diff_checkpoints
    from accelkit.checkpointing.interop.hf_export import export_hf
    from accelkit.checkpointing.storage import get_storage

    size, layers, repeats = (64 * MB, 8, 3) if quick else (1024 * MB, 16, 5)
    scratch = scratch_dir("export")
    cold, how = drop_page_cache()
    try:
        with section(f"two checkpoints of a {size // MB} MiB model ({layers} layers)"):
            a, b, largest = _save_pair(scratch / "project", size, layers)
        model_files = _files(a, ".safetensors")
        model_bytes = sum(p.stat().st_size for p in model_files)
        both = _files(a) + _files(b)
        both_bytes = sum(p.stat().st_size for p in both)
        out, copied = scratch / "exported", scratch / "copied"
        storage = get_storage(str(a))

        def before(name: str) -> None:
            rmtree(out)
            rmtree(copied)
            if cold:
                drop_page_cache()

        cases = {
            "read model": lambda: _read(model_files),
            "copy model": lambda: _copy(model_files, copied),
            "export": lambda: export_hf(str(a), str(out)),
            "read both": lambda: _read(both),
            "diff": lambda: diff_checkpoints(storage, str(a), storage, str(b)),
        }
        with section(f"{repeats} rounds, {'cold' if cold else 'warm'} page cache"):
            samples = alternate(cases, repeats, before=before, warmup=not cold)
        diff = diff_checkpoints(storage, str(a), storage, str(b))
        assert not diff.equal, "B differs from A by one layer"
    finally:
        rmtree(scratch)

    summary = {
        name: summarise(runs, both_bytes if name in ("read both", "diff") else model_bytes)
        for name, runs in samples.items()
    }
    export_ratio = summary["read model"]["seconds"] / summary["export"]["seconds"]
    copy_ratio = summary["copy model"]["seconds"] / summary["export"]["seconds"]
    diff_ratio = summary["diff"]["seconds"] / summary["read both"]["seconds"]
    extra = summary["export"]["peak_extra_memory_bytes"]
    targets = [
        Target("export speed vs reading the same bytes", round(export_ratio, 3), 0.8, "x"),
        Target(
            "export peak memory over the largest tensor",
            round((extra - largest) / MB, 1),
            200.0,
            "MB",
            higher_is_better=False,
        ),
        Target(
            "diff time vs reading both checkpoints",
            round(diff_ratio, 3),
            1.2,
            "x",
            higher_is_better=False,
        ),
    ]
    rows = [
        [name, f"{s['seconds']:.3f} s", f"{s['gb_per_s']:.2f} GB/s", f"{s['bytes'] / MB:.0f} MiB"]
        for name, s in summary.items()
    ]
    print_table(rows, ["case", "median", "rate", "bytes"])
    print(f"export speed vs copying the same bytes: {copy_ratio:.3f} x")
    for target in targets:
        status = "ok" if target.passed else "MISSED"
        print(f"{target.name}: {target.value} {target.unit} (target {target.threshold}) {status}")
    results = {
        "model_bytes": model_bytes,
        "both_bytes": both_bytes,
        "largest_tensor_bytes": largest,
        "page_cache": "cold" if cold else "warm",
        "export_vs_copy": round(copy_ratio, 3),
        "cases": summary,
    }
    notes = [how if cold else f"warm page cache: {how}"]
    notes.append(
        "export writes the same bytes it reads and makes them durable (fsync); reading is the "
        "lower bound it is compared with, as the issue states the target"
    )
    write_result(
        "export",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Export and diff vs reading the bytes",
    )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 rounds")
    main(parser.parse_args().quick)
