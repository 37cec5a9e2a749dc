"""Durable save and load of model + AdamW state: accelkit against accelerate and the disk.

Save, side by side in one process, alternating, medians (seconds, GB/s, peak extra memory):

- ``accelkit``: ``accelkit.Accelerator.save_state`` (durable by itself: every file is fsync-ed
  and the manifest committed last).
- ``accelerate+fsync``: Hugging Face ``accelerate.Accelerator.save_state`` then an ``fsync`` of
  every file and folder it wrote (the same guarantee, paid for the same way).
- ``accelerate+os.sync``: the same followed by ``os.sync()`` instead (flushes every process's
  dirty pages on this shared machine, so it is noisier; shown for completeness).
- ``raw write+fsync``: the state's tensor bytes written back to back into one file and fsync-ed,
  with no serialisation: the disk's limit for these bytes.
- ``torch.save+fsync`` and ``safetensors+fsync``: the two serialisers users reach for.

Load: ``accelkit`` ``load_state`` against ``accelerate`` ``load_state`` and a raw read of the same
bytes, with a warm page cache and a cold one (``os.sync()`` + ``drop_caches``, needs root).

Both accelerators live in this one process: they are created once, on the CPU, with their own
process state (accelerate's ``AcceleratorState`` singleton and accelkit's ``PartialState`` read
the same environment and do not write it), and prepare the same model and optimizer objects, so
both save exactly the same tensors.
"""

from __future__ import annotations

import cProfile
import inspect
import os
import pstats
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    Target,
    alternate,
    drop_page_cache,
    fsync_tree,
    gb,
    median,
    print_table,
    raw_write_fsync,
    rmtree,
    scratch_dir,
    section,
    summarise,
    tree_bytes,
    write_result,
)

MB = 1_000_000
WIDTH = 1024


def build_state(total_bytes: int, seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """A stack of ``Linear`` layers and an AdamW that has taken one step.

    Parameters plus AdamW's two moments take about ``total_bytes`` (3 x 4 bytes per parameter).
    """
    torch.manual_seed(seed)
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3
    layers = max(1, round(total_bytes / per_layer))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint of this state holds: parameters, then optimizer moments."""
    out = [t.detach() for t in model.state_dict().values()]
    for per_param in optimizer.state.values():
        out.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return out


def _views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [t.contiguous().reshape(-1).numpy().data.cast("B") for t in tensors]


def split_views(views: list[memoryview], sizes: list[int]) -> list[list[memoryview]]:
    """Cut the byte stream ``views`` into consecutive groups of ``sizes`` bytes (one per file).

    Bytes beyond the stream (a file larger than the state left) come from a zero buffer.
    """
    groups: list[list[memoryview]] = []
    queue = list(views)
    for size in sizes:
        group: list[memoryview] = []
        while size > 0:
            if not queue:
                group.append(memoryview(bytearray(size)))
                break
            head = queue.pop(0)
            take = min(size, head.nbytes)
            group.append(head[:take])
            if take < head.nbytes:
                queue.insert(0, head[take:])
            size -= take
        groups.append(group)
    return groups


def write_files(folder: Path, groups: list[list[memoryview]], fsync_each: bool) -> None:
    """Write one file per group into ``folder``; fsync each right after it, or all at the end."""
    files = []
    for i, group in enumerate(groups):
        path = folder / f"f{i}.bin"
        with open(path, "wb", buffering=0) as f:
            for view in group:
                while view.nbytes:
                    n = f.write(view) or 0
                    view = view[n:]
            if fsync_each:
                os.fsync(f.fileno())
        files.append(path)
    if not fsync_each:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def accelkit_save_signature() -> inspect.Signature | None:
    """``accelkit.Accelerator.save_state``'s signature, or None while it does not exist."""
    import accelkit

    method = getattr(accelkit.Accelerator, "save_state", None)
    return inspect.signature(method) if method is not None else None


def make_accelerators(
    model: nn.Module, optimizer: torch.optim.Optimizer, project_dir: Path
) -> tuple[Any, Any, list[str]]:
    """Fresh ``accelerate.Accelerator`` and ``accelkit.Accelerator`` preparing the same objects.

    Returns:
        ``(accelerate_accelerator, accelkit_accelerator or None, notes)``.
    """
    import accelerate

    import accelkit

    notes: list[str] = []
    env_before = {k: v for k, v in os.environ.items() if "ACCEL" in k}
    hf = accelerate.Accelerator(cpu=True, project_dir=str(project_dir / "hf"))
    hf.prepare(model, optimizer)
    kit = None
    if accelkit_save_signature() is None or not hasattr(accelkit.Accelerator, "prepare"):
        notes.append("accelkit.Accelerator.save_state/prepare not available: accelkit side skipped")
    else:
        kit = accelkit.Accelerator(cpu=True, project_dir=str(project_dir / "kit"))
        kit.prepare(model, optimizer)
    env_after = {k: v for k, v in os.environ.items() if "ACCEL" in k}
    if env_before != env_after:
        notes.append(f"environment changed by the accelerators: {env_before} -> {env_after}")
    else:
        notes.append(
            "accelerate and accelkit Accelerators created in the same process: no ACCEL* "
            "environment variable was changed by either"
        )
    return hf, kit, notes


def profile_call(fn: Any, top: int = 12) -> dict[str, Any]:
    """Run ``fn()`` once under cProfile: total seconds and the functions of highest own time.

    Only the calling thread is profiled: time spent waiting for accelkit's background threads
    shows up as ``acquire`` of a lock.
    """
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(filename).name}:{line}" if line else filename
        rows.append(
            {
                "function": f"{func} ({where})",
                "calls": ncalls,
                "tottime": tottime,
                "cumtime": cumtime,
            }
        )
    rows.sort(key=lambda r: r["tottime"], reverse=True)
    return {"seconds": total, "top_by_own_time": rows[:top]}


def _short_profile(prof: dict[str, Any], n: int = 3) -> str:
    return ", ".join(
        f"{r['function'].split(' (')[0]} {r['tottime']:.3f}s x{r['calls']}"
        for r in prof["top_by_own_time"][:n]
    )


def explain_load(result: dict[str, Any], cache: str) -> str:
    """One line comparing where accelkit's and accelerate's loads spend their time."""
    diagnosis = result["diagnosis"]
    parts = []
    for side in ("accelkit", "accelerate"):
        prof = diagnosis.get(f"{side}_load_profile_warm")
        if prof:
            parts.append(f"{side} ({prof['seconds']:.3f}s warm, cProfile): {_short_profile(prof)}")
    table = result["load"].get(cache, {})
    raw = table.get("raw read", {}).get("seconds")
    kit = table.get("accelkit", {}).get("seconds")
    if raw and kit:
        parts.append(f"reading the bytes alone takes {100 * raw / kit:.0f}% of accelkit's load")
    hf = table.get("accelerate", {}).get("seconds")
    if cache == "cold" and raw and hf:
        # No load can beat a read of the same bytes: Accelerate's cold load over the raw read is
        # the most any load could gain on it on this disk.
        parts.append(
            f"accelerate's cold load is {hf / raw:.2f}x the raw read, so no load of these bytes "
            f"can be more than {hf / raw:.2f}x faster than it here"
        )
    return "; ".join(parts)


def explain_save(result: dict[str, Any]) -> str:
    """One line saying where accelkit's save spent its time (for a missed target).

    Built from what this run measured: accelkit's file layout written raw (no serialisation, no
    checksum) against the single raw file, the checksum's cost alone, and a cProfile of one save.
    """
    save, diagnosis = result["save"], result["diagnosis"]
    parts: list[str] = []
    raw = save.get("raw write+fsync", {}).get("seconds")
    each = save.get("raw, accelkit's files, fsync each", {}).get("seconds")
    end = save.get("raw, accelkit's files, fsync at end", {}).get("seconds")
    if raw and each:
        parts.append(
            f"accelkit's {diagnosis.get('files', '?')} files written raw with an fsync each "
            f"reach {100 * raw / each:.0f}% of one raw file"
            + (f" ({100 * raw / end:.0f}% with the fsyncs at the end)" if end else "")
        )
    chk = diagnosis.get("checksum") or {}
    if chk and raw:
        parts.append(
            f"{chk['algorithm']} of the state alone takes {chk['seconds']:.3f}s "
            f"(= {100 * chk['seconds'] / raw:.0f}% of the raw write's time; it runs inline, "
            "while earlier chunks are being written)"
        )
    prof = diagnosis.get("accelkit_save_profile")
    if prof:
        parts.append(f"cProfile of one save ({prof['seconds']:.3f}s): {_short_profile(prof)}")
    return "; ".join(parts)


def _checksum_cost(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Seconds to hash the state's bytes with accelkit's default checksum (for the diagnosis)."""
    try:
        from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM, new_hasher
    except ImportError:
        return {}
    views = _views(tensors)
    start = time.perf_counter()
    hasher = new_hasher(DEFAULT_ALGORITHM)
    for v in views:
        hasher.update(v)
    hasher.hexdigest()
    seconds = time.perf_counter() - start
    nbytes = sum(v.nbytes for v in views)
    return {"algorithm": DEFAULT_ALGORITHM, "seconds": seconds, "gb_per_s": gb(nbytes) / seconds}


def run_size(total_bytes: int, repeats: int, cold: bool, notes: list[str]) -> dict[str, Any]:
    """Save and load one state of about ``total_bytes``; return the figures for that size."""
    import safetensors.torch

    model, optimizer = build_state(total_bytes)
    tensors = state_tensors(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = scratch_dir("save")
    try:
        hf, kit, acc_notes = make_accelerators(model, optimizer, root)
        for n in acc_notes:
            if n not in notes:
                notes.append(n)
        out = {
            name: root / name
            for name in (
                "accelkit",
                "accelerate",
                "accelerate_sync",
                "raw",
                "torch",
                "safetensors",
                "layout_each",
                "layout_end",
            )
        }

        def save_torch() -> None:
            path = out["torch"] / "state.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            fsync_tree(out["torch"])

        def save_safetensors() -> None:
            flat = {f"model.{k}": v for k, v in model.state_dict().items()}
            for i, per_param in enumerate(optimizer.state.values()):
                for k, v in per_param.items():
                    if isinstance(v, torch.Tensor):
                        flat[f"optimizer.{i}.{k}"] = v
            safetensors.torch.save_file(flat, out["safetensors"] / "state.safetensors")
            fsync_tree(out["safetensors"])

        def save_hf() -> None:
            hf.save_state(str(out["accelerate"]))
            fsync_tree(out["accelerate"])

        def save_hf_sync() -> None:
            hf.save_state(str(out["accelerate_sync"]))
            os.sync()

        cases: dict[str, Any] = {}
        layout: list[int] = []
        layout_names: list[str] = []
        if kit is not None:
            cases["accelkit"] = lambda: kit.save_state(str(out["accelkit"]))
            # accelkit's file layout (sizes, in the order written), for the diagnosis cases below.
            kit.save_state(str(out["accelkit"]))
            files = sorted(out["accelkit"].iterdir(), key=lambda p: p.stat().st_mtime_ns)
            layout = [p.stat().st_size for p in files]
            layout_names = [p.name for p in files]
            rmtree(out["accelkit"])
        cases["accelerate+fsync"] = save_hf
        cases["accelerate+os.sync"] = save_hf_sync
        cases["raw write+fsync"] = lambda: raw_write_fsync(
            out["raw"] / "state.bin", _views(tensors)
        )
        cases["torch.save+fsync"] = save_torch
        cases["safetensors+fsync"] = save_safetensors
        if layout:
            # Same bytes, accelkit's files, no serialisation or checksum: how much of the gap to
            # the raw limit is the file layout and its fsyncs, and how much accelkit's own code.
            groups = split_views(_views(tensors), layout)
            cases["raw, accelkit's files, fsync each"] = lambda: write_files(
                out["layout_each"], groups, fsync_each=True
            )
            cases["raw, accelkit's files, fsync at end"] = lambda: write_files(
                out["layout_end"], groups, fsync_each=False
            )
        folder_of = {
            "raw, accelkit's files, fsync each": out["layout_each"],
            "raw, accelkit's files, fsync at end": out["layout_end"],
            "accelkit": out["accelkit"],
            "accelerate+fsync": out["accelerate"],
            "accelerate+os.sync": out["accelerate_sync"],
            "raw write+fsync": out["raw"],
            "torch.save+fsync": out["torch"],
            "safetensors+fsync": out["safetensors"],
        }

        def before_save(name: str) -> None:
            folder = folder_of[name]
            rmtree(folder)
            # accelkit and accelerate create their folder; the baselines need it to exist.
            if name not in ("accelkit", "accelerate+fsync", "accelerate+os.sync"):
                folder.mkdir(parents=True)
            os.sync()  # start every case with no dirty pages of an earlier case pending

        samples = alternate(cases, repeats, before=before_save, warmup=True)
        save: dict[str, Any] = {}
        for name, s in samples.items():
            save[name] = summarise(s, nbytes)
            save[name]["bytes_on_disk"] = tree_bytes(folder_of[name])
        hf_best = min(save["accelerate+fsync"]["seconds"], save["accelerate+os.sync"]["seconds"])
        raw_s = save["raw write+fsync"]["seconds"]
        for row in save.values():
            row["ratio_to_accelerate"] = hf_best / row["seconds"]
            row["fraction_of_raw"] = raw_s / row["seconds"]
            row["peak_extra_memory_fraction"] = row["peak_extra_memory_bytes"] / nbytes

        # ------------------------------------------------------------------------------ load
        load: dict[str, Any] = {}
        raw_file = out["raw"] / "state.bin"
        raw_buf = bytearray(nbytes)

        def read_raw() -> None:
            with open(raw_file, "rb", buffering=0) as f:
                view = memoryview(raw_buf)
                while view.nbytes:
                    n = f.readinto(view)
                    if not n:
                        break
                    view = view[n:]

        load_cases: dict[str, Any] = {}
        if kit is not None:
            load_cases["accelkit"] = lambda: kit.load_state(str(out["accelkit"]))
        load_cases["accelerate"] = lambda: hf.load_state(str(out["accelerate"]))
        load_cases["raw read"] = read_raw
        for cache in ("warm", "cold"):
            if cache == "cold":
                if not cold:
                    continue
                ok, how = drop_page_cache()
                if not ok:
                    notes.append(how)
                    continue
                if how not in notes:
                    notes.append(f"cold loads: {how}")

            def before_load(name: str, cache: str = cache) -> None:
                if cache == "cold":
                    drop_page_cache()

            lsamples = alternate(load_cases, repeats, before=before_load, warmup=cache == "warm")
            load[cache] = {name: summarise(s, nbytes) for name, s in lsamples.items()}
            hf_load = load[cache]["accelerate"]["seconds"]
            raw_read = load[cache]["raw read"]["seconds"]
            for row in load[cache].values():
                row["ratio_to_accelerate"] = hf_load / row["seconds"]
                row["fraction_of_raw"] = raw_read / row["seconds"]

        diagnosis: dict[str, Any] = {
            "checksum": _checksum_cost(tensors),
            "files": len(layout),
            "accelkit_files": dict(zip(layout_names, layout)),
        }
        if kit is not None:
            target = root / "profile"
            rmtree(target)
            os.sync()
            diagnosis["accelkit_save_profile"] = profile_call(lambda: kit.save_state(str(target)))
            rmtree(target)
            diagnosis["accelkit_load_profile_warm"] = profile_call(
                lambda: kit.load_state(str(out["accelkit"]))
            )
        diagnosis["accelerate_load_profile_warm"] = profile_call(
            lambda: hf.load_state(str(out["accelerate"]))
        )
    finally:
        rmtree(root)
    return {
        "state_bytes": nbytes,
        "tensors": len(tensors),
        "layers": len(model),
        "save": save,
        "load": load,
        "diagnosis": diagnosis,
    }


def _label(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def main(quick: bool = False) -> dict[str, Any]:
    """Run the save/load benchmark and write ``results/save_load.json``."""
    sizes = [64 * MB] if quick else [256 * MB, 1050 * MB]
    repeats = 3 if quick else 5
    notes = [
        "Disk shared with other processes of this machine: figures are medians of alternating "
        "runs; compare ratios, not absolute seconds.",
        "GB/s counts the state's tensor bytes (parameters + AdamW moments); each format adds "
        "its own headers and small files.",
        "peak extra memory = kernel high-water mark of the process's RSS during the call minus "
        "its RSS at the start (page cache not counted).",
    ]
    results: dict[str, Any] = {"sizes": {}}
    targets: list[Target] = []
    for size in sizes:
        with section(f"save/load, {_label(size)} of model + AdamW state, {repeats} rounds"):
            r = run_size(size, repeats, cold=True, notes=notes)
            label = _label(r["state_bytes"])
            results["sizes"][label] = r
            rows = [
                [
                    name,
                    row["seconds"],
                    row["gb_per_s"],
                    row["ratio_to_accelerate"],
                    row["fraction_of_raw"],
                    row["peak_extra_memory_bytes"] / 1e6,
                ]
                for name, row in r["save"].items()
            ]
            print_table(rows, ["save", "s", "GB/s", "x accelerate", "of raw", "peak MB"])
            for cache, table in r["load"].items():
                print_table(
                    [
                        [name, row["seconds"], row["gb_per_s"], row["ratio_to_accelerate"]]
                        for name, row in table.items()
                    ],
                    [f"load ({cache})", "s", "GB/s", "x accelerate"],
                )
            if "accelkit" in r["save"]:
                kit = r["save"]["accelkit"]
                targets.append(
                    Target(
                        f"save vs accelerate ({label})",
                        kit["ratio_to_accelerate"],
                        1.0,
                        reason=explain_save(r),
                    )
                )
                targets.append(
                    Target(
                        f"save vs raw write+fsync ({label})",
                        100 * kit["fraction_of_raw"],
                        80.0,
                        unit="%",
                        reason=explain_save(r),
                    )
                )
                targets.append(
                    Target(
                        f"save peak extra memory ({label})",
                        100 * kit["peak_extra_memory_fraction"],
                        10.0,
                        unit="% of state",
                        higher_is_better=False,
                    )
                )
                for cache, table in r["load"].items():
                    targets.append(
                        Target(
                            f"load vs accelerate, {cache} cache ({label})",
                            table["accelkit"]["ratio_to_accelerate"],
                            # Issue #29: a cold load (what a resumed job pays) 1.5x faster than
                            # Accelerate's; warm, at least as fast.
                            1.5 if cache == "cold" else 1.0,
                            reason=explain_load(r, cache),
                        )
                    )
                if "cold" in r["load"]:
                    cold = r["load"]["cold"]
                    targets.append(
                        Target(
                            f"cold load vs raw read of the same bytes ({label})",
                            cold["accelkit"]["seconds"] / cold["raw read"]["seconds"],
                            1.3,
                            higher_is_better=False,
                            reason=explain_load(r, "cold"),
                        )
                    )
    if not any(t.name.startswith("save vs accelerate") for t in targets):
        notes.append("accelkit save_state not available yet: no accelkit targets measured")
    results["median_raw_write_gb_per_s"] = median(
        [r["save"]["raw write+fsync"]["gb_per_s"] for r in results["sizes"].values()]
    )
    path = write_result(
        "save_load",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Durable save and load (model + AdamW)",
    )
    print(f"   -> {path}")
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
