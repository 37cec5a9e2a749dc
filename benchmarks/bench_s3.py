"""Checkpoints on S3: accelkit against a raw ``s3fs`` transfer of the same bytes.

The server is a local SeaweedFS (``weed mini`` on 127.0.0.1, started with the launcher of the
test fixture ``tests/fixtures/s3.py``), so the figures measure the client and this machine, not
a network. Side by side, alternating, medians:

- save: ``accelkit`` ``save_state(output_dir="s3://...")`` vs ``s3fs pipe_file`` (one object
  from one in-memory buffer, multipart in ``chunksize`` parts uploaded ``max_concurrency`` at a
  time: the client's limit) and vs ``s3fs open("wb").write`` (streamed, the way a file-like
  writer uploads).
- load: ``accelkit`` ``load_state("s3://...")`` vs ``s3fs cat_file`` of the raw object.

Hugging Face accelerate has no S3 support (``save_state`` takes a local path), so it is absent.
"""

from __future__ import annotations

import uuid
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


def main(quick: bool = False) -> dict[str, Any]:
    """Run the S3 benchmark and write ``results/s3.json``."""
    try:
        import s3fs
    except ImportError:
        print("   s3fs is not installed: pip install 'accelkit[s3]'; S3 benchmark skipped")
        return {}
    import accelkit

    size = 16 * MB if quick else 256 * MB
    repeats = 3 if quick else 5
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
            save_cases["s3fs pipe_file"] = pipe
            save_cases["s3fs open().write"] = stream

            def before_save(name: str) -> None:
                target = {
                    "accelkit save_state": f"{prefix}/kit/ckpt",
                    "s3fs pipe_file": f"{prefix}/raw/pipe.bin",
                    "s3fs open().write": f"{prefix}/raw/stream.bin",
                }[name]
                if fs.exists(target):
                    fs.rm(target, recursive=True)
                fs.invalidate_cache()

            save_samples = alternate(save_cases, repeats, before=before_save, warmup=True)
            save = {name: summarise(s, nbytes) for name, s in save_samples.items()}
            limit = min(save["s3fs pipe_file"]["seconds"], save["s3fs open().write"]["seconds"])
            for row in save.values():
                row["fraction_of_s3fs"] = limit / row["seconds"]

            def get() -> None:
                fs.cat_file(f"{prefix}/raw/pipe.bin")

            load_cases: dict[str, Any] = {}
            if kit_s3 is not None:
                load_cases["accelkit load_state"] = lambda: kit_s3.load_state(
                    f"s3://{prefix}/kit/ckpt"
                )
            load_cases["s3fs cat_file"] = get
            load_samples = alternate(load_cases, repeats, before=lambda _n: fs.invalidate_cache())
            load = {name: summarise(s, nbytes) for name, s in load_samples.items()}
            get_s = load["s3fs cat_file"]["seconds"]
            for row in load.values():
                row["fraction_of_s3fs"] = get_s / row["seconds"]

            print_table(
                [[n, r["seconds"], r["gb_per_s"], r["fraction_of_s3fs"]] for n, r in save.items()],
                ["save", "s", "GB/s", "of s3fs"],
            )
            print_table(
                [[n, r["seconds"], r["gb_per_s"], r["fraction_of_s3fs"]] for n, r in load.items()],
                ["load", "s", "GB/s", "of s3fs"],
            )
            if kit_s3 is not None:
                targets.append(
                    Target(
                        "S3 save vs raw s3fs",
                        100 * save["accelkit save_state"]["fraction_of_s3fs"],
                        80.0,
                        unit="%",
                    )
                )
                targets.append(
                    Target(
                        "S3 load vs raw s3fs",
                        100 * load["accelkit load_state"]["fraction_of_s3fs"],
                        80.0,
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
