"""How checkpoint costs grow: with the number of tensors, and with the number of checkpoints.

1. Tensors (10 to 10,000 parameters of 64 floats each, plus AdamW's moments): ``save_state``,
   reading the manifest, listing every tensor (the ``accelkit ckpt inspect`` path: safetensors
   headers only) and ``load_state``; Hugging Face accelerate's durable ``save_state`` beside it.
2. Checkpoints in one folder (10 to 1,000, made by ``save_state`` with automatic naming): the
   next ``save_state``, ``list_checkpoints``, ``latest_checkpoint`` and ``load_state()`` with no
   argument (which finds the newest committed one).

"Linear or better" is checked by the least-squares log-log slope of time against N over every
size but the smallest: a slope above 1.2 is reported as a miss. Plots go to
``benchmarks/results/scaling_tensors.png`` and ``scaling_checkpoints.png``.

Growth with the number of *processes* (issue #29: collective rounds and bytes per save and load
at 2 to 16 gloo processes) is ``bench_world.py`` (``results/world.json``, ``world.png``).
"""

from __future__ import annotations

import cProfile
import math
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    Target,
    fsync_tree,
    median,
    print_table,
    results_dir,
    rmtree,
    scratch_dir,
    section,
    write_result,
)

SLOPE_LIMIT = 1.2


class ManyTensors(nn.Module):
    """A model of ``n`` separate small parameters (the worst case for per-tensor overhead)."""

    def __init__(self, n: int, numel: int = 64) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(n))

    def forward(self) -> torch.Tensor:
        return torch.stack([p.sum() for p in self.params]).sum()


def _stepped(n: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = ManyTensors(n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _time(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    secs = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - start)
    return median(secs)


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares log-log slope over every point but the smallest (1.0 = linear).

    The smallest size is left out because fixed costs dominate it (it would flatter the slope).
    """
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y == y and y > 0][1:]
    if len(pts) < 2:
        return float("nan")
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var


def top_own_time(fn: Callable[[], Any], top: int = 5) -> dict[str, Any]:
    """Run ``fn`` once under cProfile; the total and the functions of highest own time."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(
        (
            (tottime, f"{func} ({Path(file).name}:{line})" if line else func)
            for (file, line, func), (_cc, _n, tottime, _cum, _callers) in stats.items()
        ),
        reverse=True,
    )[:top]
    return {"seconds": total, "top": [{"function": f, "tottime": t} for t, f in rows]}


def explain(profile: dict[str, Any] | None) -> str:
    """A one-line reason from :func:`top_own_time`'s result."""
    if not profile:
        return ""
    parts = [f"{r['function']} {r['tottime']:.2f}s" for r in profile["top"][:3]]
    return f"at the largest size, {profile['seconds']:.2f}s under cProfile, most in: " + ", ".join(
        parts
    )


class _Ops:
    """The timed operations of one size, bound to its accelerators and folders."""

    def __init__(self, kit: Any, hf: Any, storage: Any, kit_dir: str, hf_dir: str) -> None:
        self.kit, self.hf, self.storage = kit, hf, storage
        self.kit_dir, self.hf_dir = kit_dir, hf_dir

    def kit_save(self) -> None:
        self.kit.save_state(self.kit_dir)

    def kit_load(self) -> None:
        self.kit.load_state(self.kit_dir)

    def hf_save(self) -> None:
        self.hf.save_state(self.hf_dir)
        fsync_tree(self.hf_dir)

    def hf_load(self) -> None:
        self.hf.load_state(self.hf_dir)

    def clear_kit(self) -> None:
        rmtree(self.kit_dir)

    def clear_hf(self) -> None:
        rmtree(self.hf_dir)

    def read_manifest(self) -> None:
        from accelkit.checkpointing.formats.manifest import read_manifest

        read_manifest(self.storage, self.kit_dir)

    def list_tensors(self) -> int:
        from accelkit.checkpointing.catalog.inspect import (
            read_safetensors_header,
            safetensors_files,
        )

        return sum(
            len(read_safetensors_header(self.storage, url).tensors)
            for _name, url in safetensors_files(self.storage, self.kit_dir)
        )


def scale_tensors(counts: list[int], repeats: int) -> dict[str, Any]:
    """Costs against the number of parameters."""
    import accelerate

    import accelkit
    from accelkit.checkpointing.storage import get_storage

    rows: dict[str, list[float]] = {
        "accelkit save_state": [],
        "accelerate save_state+fsync": [],
        "accelkit read manifest": [],
        "accelkit list tensors": [],
        "accelkit load_state": [],
        "accelerate load_state": [],
    }
    state_tensors: list[int] = []
    profiles: dict[str, dict[str, Any]] = {}
    root = scratch_dir("scale-tensors")
    hf = accelerate.Accelerator(cpu=True)
    for n in counts:
        model, optimizer = _stepped(n)
        state_tensors.append(len(model.state_dict()) + 3 * n)
        kit = accelkit.Accelerator(cpu=True)
        kit.prepare(model, optimizer)
        # accelerate keeps every model it prepared; a fresh list keeps its save to this model.
        hf._models.clear()
        hf._optimizers.clear()
        hf.prepare(model, optimizer)
        kit_dir, hf_dir = str(root / f"kit-{n}"), str(root / f"hf-{n}")
        storage = get_storage(kit_dir)
        ops = _Ops(kit, hf, storage, kit_dir, hf_dir)
        rows["accelkit save_state"].append(_time(ops.kit_save, repeats, ops.clear_kit))
        rows["accelerate save_state+fsync"].append(_time(ops.hf_save, repeats, ops.clear_hf))
        rows["accelkit read manifest"].append(_time(ops.read_manifest, repeats))
        rows["accelkit list tensors"].append(_time(ops.list_tensors, repeats))
        rows["accelkit load_state"].append(_time(ops.kit_load, repeats))
        ops.hf_save()
        rows["accelerate load_state"].append(_time(ops.hf_load, repeats))
        if n == counts[-1]:
            # Where the time goes at the largest size: the reason for a missed slope.
            profiles["accelkit load_state"] = top_own_time(ops.kit_load)
            profiles["accelkit list tensors"] = top_own_time(ops.list_tensors)
            ops.clear_kit()
            profiles["accelkit save_state"] = top_own_time(ops.kit_save)
        rmtree(kit_dir)
        rmtree(hf_dir)
        print(f"   {n} parameters: " + ", ".join(f"{k} {v[-1]:.4f}s" for k, v in rows.items()))
    rmtree(root)
    return {
        "parameters": counts,
        "state_tensors": state_tensors,
        "seconds": rows,
        "profiles_at_largest": profiles,
    }


def scale_checkpoints(points: list[int], repeats: int) -> dict[str, Any]:
    """Costs against the number of committed checkpoints in one folder."""
    import accelkit
    from accelkit.checkpointing.catalog.listing import latest_checkpoint, list_checkpoints
    from accelkit.checkpointing.storage import get_storage, join

    root = scratch_dir("scale-ckpts")
    project = str(root / "project")
    kit = accelkit.Accelerator(
        cpu=True,
        project_config=accelkit.ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True
        ),
    )
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    kit.prepare(model, optimizer)
    storage = get_storage(project)
    ckpts = join(project, "checkpoints")
    rows: dict[str, list[float]] = {
        "save_state (next)": [],
        "list_checkpoints": [],
        "latest_checkpoint": [],
        "load_state()": [],
    }
    made = 0
    fill_seconds = 0.0
    for k in points:
        start = time.perf_counter()
        while made < k:
            kit.save_state()
            made += 1
        fill_seconds += time.perf_counter() - start
        rows["list_checkpoints"].append(
            _time(lambda: list_checkpoints(storage, ckpts), repeats + 2, storage.invalidate)
        )
        rows["latest_checkpoint"].append(
            _time(lambda: latest_checkpoint(storage, ckpts), repeats + 2, storage.invalidate)
        )
        rows["load_state()"].append(_time(kit.load_state, repeats))
        # Three more saves, timed; the next point counts them.
        secs = []
        for _ in range(3):
            start = time.perf_counter()
            kit.save_state()
            secs.append(time.perf_counter() - start)
        rows["save_state (next)"].append(median(secs))
        made += 3
        print(f"   {k} checkpoints: " + ", ".join(f"{n} {v[-1]:.4f}s" for n, v in rows.items()))
    rmtree(root)
    return {"checkpoints": points, "seconds": rows, "fill_seconds": fill_seconds}


def _plot(
    xs: list[int],
    rows: dict[str, list[float]],
    xlabel: str,
    title: str,
    name: str,
    quick: bool,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in rows.items():
        ax.plot(xs[: len(ys)], ys, marker="o", label=label)
    # A linear reference through the first point of the first series.
    first = next(iter(rows.values()))
    if first:
        ax.plot(
            xs,
            [first[0] * x / xs[0] for x in xs],
            linestyle=":",
            color="gray",
            label="linear (reference)",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds (median)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = results_dir(quick) / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def main(quick: bool = False) -> dict[str, Any]:
    """Run both scaling benchmarks, plot them and write ``results/scaling.json``."""
    import accelkit

    if not hasattr(accelkit.Accelerator, "save_state"):
        print("   accelkit.Accelerator.save_state does not exist yet: scaling benchmark skipped")
        return {}
    counts = [10, 100, 1000] if quick else [10, 100, 1000, 10_000]
    points = [10, 30, 100] if quick else [10, 30, 100, 300, 1000]
    repeats = 3
    targets: list[Target] = []
    results: dict[str, Any] = {}
    with section(f"scaling with the number of tensors ({counts[0]}..{counts[-1]})"):
        tens = scale_tensors(counts, repeats)
        tens["plot"] = _plot(
            counts,
            tens["seconds"],
            "parameters (each with 2 AdamW moments)",
            "Checkpoint cost vs number of tensors",
            "scaling_tensors",
            quick,
        )
        tens["slope"] = {k: slope(counts, v) for k, v in tens["seconds"].items()}
        results["tensors"] = tens
    with section(f"scaling with the number of checkpoints ({points[0]}..{points[-1]})"):
        ck = scale_checkpoints(points, repeats)
        ck["plot"] = _plot(
            points,
            ck["seconds"],
            "committed checkpoints in the folder",
            "Cost vs number of checkpoints in one folder",
            "scaling_checkpoints",
            quick,
        )
        ck["slope"] = {k: slope(points, v) for k, v in ck["seconds"].items()}
        results["checkpoints"] = ck
    for what, block, xs in (
        ("tensors", results["tensors"], counts),
        ("checkpoints", results["checkpoints"], points),
    ):
        print_table(
            [[name, *vals, block["slope"][name]] for name, vals in block["seconds"].items()],
            [f"seconds vs {what}", *map(str, xs), "slope"],
        )
        for name, s in block["slope"].items():
            if name.startswith("accelerate"):
                continue
            targets.append(
                Target(
                    f"{name}: growth with {what} ({xs[1]}..{xs[-1]})",
                    s,
                    SLOPE_LIMIT,
                    unit="log-log slope",
                    higher_is_better=False,
                    reason=explain(block.get("profiles_at_largest", {}).get(name)),
                )
            )
    notes = [
        f"'linear or better' = least-squares log-log slope <= {SLOPE_LIMIT} over every size but "
        "the smallest (1.0 is linear; the smallest size is dominated by fixed costs).",
        "Each point is the median of 3 runs (listing: of 5).",
    ]
    path = write_result(
        "scaling",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Scaling (tensors, checkpoints per folder)",
    )
    print(f"   -> {path}")
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
