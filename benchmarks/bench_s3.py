"""Checkpoints on S3: accelkit against a raw ``s3fs`` transfer of the same bytes.

The server is a local SeaweedFS (``weed mini`` on 127.0.0.1, started with the launcher of the
test fixture ``tests/fixtures/s3.py``), so the figures measure the client and this machine, not
a network. Side by side, alternating, medians:

- save: ``accelkit`` ``save_state(output_dir="s3://...")`` vs ``s3fs pipe`` of the same files
  (the checkpoint's own files, same names and sizes, from in-memory buffers, all at once, each
  multipart in ``chunksize`` parts uploaded ``max_concurrency`` at a time: the client's limit),
  vs ``s3fs pipe_file`` of the same bytes as one object, and vs ``s3fs open("wb").write``
  (streamed, the way a file-like writer uploads).
- load: ``accelkit`` ``load_state("s3://...")`` (checksums verified, tensors restored into the
  model and optimizer) vs ``s3fs cat`` of the same files (all at once, each in concurrent
  ranges) and ``s3fs cat_file`` of the one object.

Each fraction is the fastest raw case's median over accelkit's median, and the median of the
per-round ratios beside it (the machine is shared: a round's cases run back to back).

Hugging Face accelerate has no S3 support (``save_state`` takes a local path), so it is absent.
"""

from __future__ import annotations

import uuid
from statistics import median
from typing import Any

from benchmarks.bench_save_load import build_state, make_accelerators, state_tensors
from benchmarks.common import (
    Target,
    alternate,
    print_table,
    rmtree,
    scratch_dir,
    section,
    start_seaweedfs,
    summarise,
    write_result,
)

MB = 1_000_000
PIPE_CHUNK = 50 * 2**20
PIPE_CONCURRENCY = 10


def _fractions(samples: dict[str, list[Any]], nbytes: int) -> dict[str, dict[str, Any]]:
    """Rows of ``samples`` with ``fraction_of_s3fs``: the fastest raw s3fs case's median over
    the row's, and ``paired_fraction``: the median over rounds of that round's ratio."""
    rows = {name: summarise(s, nbytes) for name, s in samples.items()}
    raw = [n for n in rows if n.startswith("s3fs")]
    best = min(raw, key=lambda n: rows[n]["seconds"])
    for name, row in rows.items():
        row["fraction_of_s3fs"] = rows[best]["seconds"] / row["seconds"]
        row["paired_fraction"] = median(
            a.seconds / b.seconds for a, b in zip(samples[best], samples[name])
        )
        row["against"] = best
    return rows


def main(quick: bool = False) -> dict[str, Any]:
    """Run the S3 benchmark and write ``results/s3.json``."""
    try:
        import s3fs
    except ImportError:
        print("   s3fs is not installed: pip install 'accelkit[s3]'; S3 benchmark skipped")
        return {}
    import accelkit
    from accelkit.checkpointing.storage._s3io import MAX_PARTS_IN_FLIGHT, PART_SIZE

    size = 16 * MB if quick else 256 * MB
    repeats = 3 if quick else 7
    notes = [
        "SeaweedFS `weed mini` on 127.0.0.1 (same machine, same disk): the limit is the client "
        "and this 2-core machine, shared with other processes.",
        "Hugging Face accelerate cannot save to S3: no accelerate column.",
    ]
    results: dict[str, Any] = {}
    targets: list[Target] = []
    with section(f"S3 save/load, {size // MB} MB of model + AdamW state, {repeats} rounds"):
        try:
            server = start_seaweedfs()
        except (OSError, RuntimeError) as exc:
            print(f"   cannot start SeaweedFS ({exc}); S3 benchmark skipped")
            return {}
        local = scratch_dir("s3")
        try:
            model, optimizer = build_state(size)
            tensors = state_tensors(model, optimizer)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            payload = b"".join(t.contiguous().reshape(-1).numpy().data.cast("B") for t in tensors)
            options = server.storage_options
            fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
            prefix = f"{server.bucket}/bench-{uuid.uuid4().hex[:8]}"
            _hf, kit, acc_notes = make_accelerators(model, optimizer, local)
            notes.extend(n for n in acc_notes if "skipped" in n)
            kit_s3 = None
            if kit is not None:
                kit_s3 = accelkit.Accelerator(
                    cpu=True,
                    project_config=accelkit.ProjectConfiguration(
                        project_dir=f"s3://{prefix}/kit", storage_options=options
                    ),
                )
                kit_s3.prepare(model, optimizer)

            files: dict[str, bytes] = {}
            if kit_s3 is not None:  # the checkpoint's own files, read once, untimed
                kit_s3.save_state(f"s3://{prefix}/kit/ckpt")
                found = fs.find(f"{prefix}/kit/ckpt")
                files = {p.replace("/kit/ckpt/", "/raw/files/"): fs.cat_file(p) for p in found}
                fs.rm(f"{prefix}/kit/ckpt", recursive=True)

            def pipe_files() -> None:
                fs.pipe(files, chunksize=PIPE_CHUNK, max_concurrency=PIPE_CONCURRENCY)

            def pipe() -> None:
                fs.pipe_file(
                    f"{prefix}/raw/pipe.bin",
                    payload,
                    chunksize=PIPE_CHUNK,
                    max_concurrency=PIPE_CONCURRENCY,
                )

            def stream() -> None:
                with fs.open(f"{prefix}/raw/stream.bin", "wb") as f:
                    for t in tensors:
                        f.write(t.contiguous().reshape(-1).numpy().data.cast("B"))

            save_cases: dict[str, Any] = {}
            if kit_s3 is not None:
                save_cases["accelkit save_state"] = lambda: kit_s3.save_state(
                    f"s3://{prefix}/kit/ckpt"
                )
            if files:
                save_cases["s3fs pipe (same files)"] = pipe_files
            save_cases["s3fs pipe_file"] = pipe
            save_cases["s3fs open().write"] = stream

            def before_save(name: str) -> None:
                target = {
                    "accelkit save_state": f"{prefix}/kit/ckpt",
                    "s3fs pipe (same files)": f"{prefix}/raw/files",
                    "s3fs pipe_file": f"{prefix}/raw/pipe.bin",
                    "s3fs open().write": f"{prefix}/raw/stream.bin",
                }[name]
                if fs.exists(target):
                    fs.rm(target, recursive=True)
                fs.invalidate_cache()

            save_samples = alternate(save_cases, repeats, before=before_save, warmup=True)
            save = _fractions(save_samples, nbytes)

            def get() -> None:
                fs.cat_file(f"{prefix}/raw/pipe.bin")

            def get_files() -> None:
                fs.cat(list(files), batch_size=len(files))

            if files:  # the files of the raw save's last round are there
                pipe_files()

            load_cases: dict[str, Any] = {}
            if kit_s3 is not None:
                load_cases["accelkit load_state"] = lambda: kit_s3.load_state(
                    f"s3://{prefix}/kit/ckpt"
                )
            if files:
                load_cases["s3fs cat (same files)"] = get_files
            load_cases["s3fs cat_file"] = get
            load_samples = alternate(
                load_cases, repeats, before=lambda _n: fs.invalidate_cache(), warmup=True
            )
            load = _fractions(load_samples, nbytes)

            print_table(
                [
                    [n, r["seconds"], r["gb_per_s"], r["fraction_of_s3fs"], r["paired_fraction"]]
                    for n, r in save.items()
                ],
                ["save", "s", "GB/s", "of s3fs", "paired"],
            )
            print_table(
                [
                    [n, r["seconds"], r["gb_per_s"], r["fraction_of_s3fs"], r["paired_fraction"]]
                    for n, r in load.items()
                ],
                ["load", "s", "GB/s", "of s3fs", "paired"],
            )
            if kit_s3 is not None:
                targets.append(
                    Target(
                        "S3 save vs raw s3fs",
                        100 * save["accelkit save_state"]["fraction_of_s3fs"],
                        90.0,
                        unit="%",
                    )
                )
                targets.append(
                    Target(
                        "S3 load vs raw s3fs",
                        100 * load["accelkit load_state"]["fraction_of_s3fs"],
                        90.0,
                        unit="%",
                    )
                )
            else:
                notes.append("accelkit save_state not available yet: only the s3fs side ran")
            results = {
                "state_bytes": nbytes,
                "save": save,
                "load": load,
                "settings": {
                    "s3fs pipe (same files)": {
                        "files": {p.rsplit("/", 1)[-1]: len(b) for p, b in files.items()},
                        "chunksize": PIPE_CHUNK,
                        "max_concurrency": PIPE_CONCURRENCY,
                        "note": "every file at once",
                    },
                    "s3fs cat (same files)": {"note": "every file at once, ranges of 50 MiB"},
                    "s3fs pipe_file": {
                        "chunksize": PIPE_CHUNK,
                        "max_concurrency": PIPE_CONCURRENCY,
                    },
                    "s3fs open().write": {
                        "block_size": fs.default_block_size,
                        "note": "parts uploaded as each block fills",
                    },
                    "s3fs cat_file": {"chunksize": None, "note": "one GET"},
                    "accelkit": {
                        "storage_options": {k: v for k, v in options.items() if k != "secret"},
                        "part_size": PART_SIZE,
                        "max_parts_in_flight": MAX_PARTS_IN_FLIGHT,
                        "note": "accelkit's defaults (no tuning)",
                    },
                    "server": "SeaweedFS weed mini, -master.volumeSizeLimitMB=64",
                },
            }
        finally:
            server.stop()
            rmtree(local)
    path = write_result(
        "s3", results, quick=quick, targets=targets, notes=notes, title="S3 (local SeaweedFS)"
    )
    print(f"   -> {path}")
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
