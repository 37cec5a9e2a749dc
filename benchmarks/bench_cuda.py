"""GPU saves: the blocking part of an async save against the device-to-host copy, side by side.

On a CUDA machine the floor of an async save's blocking part is one device-to-host copy of the
state's tensors into page-locked (pinned) host memory: nothing can leave the GPU faster. This
benchmark builds a model + AdamW state on the GPU and measures, alternating each round:

- ``d2h pinned``: every state tensor copied into reused pinned host buffers (``copy_`` with
  ``non_blocking=True``, then one ``torch.cuda.synchronize()``): the limit;
- ``d2h pageable``: the same into ordinary host memory (what a plain ``.cpu()`` costs);
- ``accelkit async (call returns)``: ``save_state(async_save=True)`` until it returns;
- ``accelkit async (GPU free)``: the same until the GPU has finished the copies (the training
  stream waits for them, so this is what the next step pays), with the default writer
  (``async_writer="auto"``), then with each writer named (``"thread"``: the snapshot in the
  training process's pinned memory; ``"process"``: in page-locked shared memory that the writer
  process hashes and writes);
- ``accelkit sync``: a durable ``save_state``;
- ``accelerate+fsync``: Hugging Face accelerate's ``save_state`` of the same objects, then an
  fsync of every file it wrote (accelkit's saves are durable; accelerate has no async save).

and then training throughput with no saves against an async save every few steps, with each
writer. Target (issue #29): blocking part of an async save <= 1.2x the pinned device-to-host
copy.

Skips (and records why) without a CUDA device.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    Target,
    alternate,
    fsync_tree,
    median,
    rmtree,
    scratch_dir,
    section,
    summarise,
    write_result,
)

MB = 1024 * 1024
TITLE = "GPU saves (device-to-host copy as the limit)"


def _state(param_bytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, param_bytes // (width * width * 4))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.is_cuda)
    return out


def _copier(tensors: list[torch.Tensor], pinned: bool) -> Any:
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

    def copy() -> None:
        for dst, src in zip(buffers, tensors):
            dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()

    return copy


def _throughput(kit: Any, model: nn.Module, optimizer: Any, steps: int, every: int) -> float:
    """Optimizer steps per second, saving asynchronously every ``every`` steps (0: never)."""
    width = model[0].in_features  # type: ignore[index]
    x = torch.randn(256, width, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        kit.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if every and step % every == 0:
            kit.save_state(async_save=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    kit.wait_for_checkpoints()
    return steps / elapsed


def main(quick: bool = False) -> dict[str, Any]:
    """Run the GPU save benchmark (or record why it was skipped) in ``results/cuda.json``."""
    if not torch.cuda.is_available():
        why = "no CUDA device on this machine"
        print(f"   GPU benchmark skipped: {why}")
        return {"skipped": why}

    from accelkit import Accelerator, ProjectConfiguration

    param_bytes = (64 if quick else 1024) * MB
    repeats = 3 if quick else 5
    root = scratch_dir("cuda")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    notes: list[str] = []
    try:
        model, optimizer = _state(param_bytes)
        tensors = _tensors(model, optimizer)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        config = ProjectConfiguration(
            str(root / "kit"), automatic_checkpoint_naming=True, total_limit=2
        )
        kit = Accelerator(project_config=config)
        model, optimizer = kit.prepare(model, optimizer)
        hf = None
        try:
            import accelerate

            hf = accelerate.Accelerator()
            hf.prepare(model, optimizer)
        except ImportError:
            notes.append("accelerate is not installed: its column is missing")

        def kit_async() -> None:
            kit.save_state(async_save=True)

        def kit_async_gpu() -> None:
            # The copies run on a side stream that the training stream then waits for: the call
            # returns at once, and the GPU is free for the next step once they are done.
            kit.save_state(async_save=True)
            torch.cuda.synchronize()

        def with_writer(writer: str) -> Any:
            def save() -> None:
                kit._checkpoints.config.async_writer = writer
                try:
                    kit_async_gpu()
                finally:
                    kit._checkpoints.config.async_writer = "auto"

            return save

        def kit_sync() -> None:
            kit.save_state()

        def accelerate_save() -> None:
            assert hf is not None
            hf.save_state(str(root / "hf"))
            fsync_tree(root / "hf")  # durable, as accelkit's save is

        cases = {
            "d2h pinned": _copier(tensors, pinned=True),
            "d2h pageable": _copier(tensors, pinned=False),
            "accelkit async (call returns)": kit_async,
            "accelkit async (GPU free)": kit_async_gpu,
            "accelkit async, thread writer (GPU free)": with_writer("thread"),
            "accelkit async, process writer (GPU free)": with_writer("process"),
            "accelkit sync": kit_sync,
        }
        if hf is not None:
            cases["accelerate+fsync"] = accelerate_save

        def before(name: str) -> None:
            kit.wait_for_checkpoints()
            torch.cuda.synchronize()
            rmtree(root / "hf")

        with section(f"GPU save, {nbytes // MB} MB of model + AdamW state, {repeats} rounds"):
            samples = alternate(cases, repeats, before=before, warmup=True, measure_memory=False)
            kit.wait_for_checkpoints()
            figures = {name: summarise(s, nbytes) for name, s in samples.items()}
            results["state_bytes"] = nbytes
            results["cases"] = figures
            for name, fig in figures.items():
                print(f"   {name:28s} {fig['seconds']:.4f} s  {fig['gb_per_s']:.2f} GB/s")
        floor = figures["d2h pinned"]["seconds"]
        blocking = figures["accelkit async (GPU free)"]["seconds"]
        targets = [
            Target(
                "async save, GPU busy vs pinned device-to-host copy",
                blocking / floor,
                1.2,
                higher_is_better=False,
            )
        ]
        if hf is not None:
            results["sync_vs_accelerate"] = (
                figures["accelerate+fsync"]["seconds"] / figures["accelkit sync"]["seconds"]
            )

        # Saves further apart than one background write takes (about 4.5 s for 3 GB on the
        # lent H100's disk), so the figure is the writer's cost to the step, not the disk's
        # queue: a save waits for the one before it.
        steps, every = (40, 20) if quick else (1050, 350)
        with section(f"throughput, async save every {every} of {steps} steps"):
            writers = {"none": None, "async": "auto", "async, process writer": "process"}
            rounds: dict[str, list[float]] = {name: [] for name in writers}
            for r in range(3):
                order = list(writers) if r % 2 == 0 else list(reversed(writers))
                for name in order:
                    writer = writers[name]
                    kit._checkpoints.config.async_writer = writer or "auto"
                    interval = every if writer else 0
                    rounds[name].append(_throughput(kit, model, optimizer, steps, interval))
            kit._checkpoints.config.async_writer = "auto"
            plain, saving = median(rounds["none"]), median(rounds["async"])
            lost = 100 * (1 - saving / plain)
            lost_process = 100 * (1 - median(rounds["async, process writer"]) / plain)
            # The blocking part is paid on the training thread by design; what the background
            # writer costs the step is the rest.
            blocking_share = 100 * blocking / (every / plain + blocking)
            results["throughput_steps_per_s"] = rounds
            results["save_every_steps"] = every
            results["throughput_lost_percent"] = lost
            results["throughput_lost_beyond_blocking_percent"] = lost - blocking_share
            results["throughput_lost_percent_process_writer"] = lost_process
            print(
                f"   throughput lost with async saves: {lost:.1f}% "
                f"({lost - blocking_share:.1f}% beyond the blocking part); "
                f"process writer: {lost_process:.1f}%"
            )
    finally:
        rmtree(root)
    path = write_result("cuda", results, quick=quick, targets=targets, notes=notes, title=TITLE)
    print(f"   -> {path}")
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
