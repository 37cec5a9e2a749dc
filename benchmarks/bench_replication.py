"""Replication to a remote tier (issue #26): what it costs the training loop, and how fast it is.

The remote tier is a local SeaweedFS (``weed mini`` on 127.0.0.1, the test fixture's launcher),
so the figures measure the client and this machine, not a network. Side by side, alternating,
medians:

- blocking: ``save_state()`` of the same state into a local project without replication and into
  one with ``replicate_to`` (the save returns once committed locally; the copy runs in the
  background, and is waited for, untimed, before the next round so that both cases meet the
  same idle machine). Target: replicated / local-only <= 1.1.
- upload: the replicator's copy of one committed checkpoint
  (:func:`~accelkit.checkpointing.replication.replicate_checkpoint`: files read and verified
  against the manifest, streamed up, the manifest last) against ``s3fs`` ``put_file`` of the
  same files, one after another. Target: replicator >= 90% of s3fs's throughput.
- memory: the peak resident memory the replicator's copy adds (the kernel's high-water mark).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from benchmarks.bench_save_load import build_state
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

_MEMORY_PROBE = """
import json, os, sys
from accelkit.checkpointing.replication import replicate_checkpoint
from accelkit.checkpointing.replication.replicator import FOREVER, remote_options
from accelkit.checkpointing.storage import get_storage

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

source, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
remote = get_storage(url, remote_options(url, options))
remote.exists(url)  # the client and its event loop exist before the measure
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
done = replicate_checkpoint(get_storage(source), source, remote, url + "/ckpt", FOREVER)
print(json.dumps({"peak_extra_bytes": status("VmHWM") - before, "bytes": done.bytes}))
"""


def _memory_in_fresh_process(source: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The peak resident memory one replication adds, in a process of its own."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, source, url, json.dumps(options)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(quick: bool = False) -> dict[str, Any]:
    """Run the replication benchmark and write ``results/replication.json``."""
    try:
        import s3fs
    except ImportError:
        print("   s3fs is not installed: pip install 'accelkit[s3]'; benchmark skipped")
        return {}
    import accelkit
    from accelkit.checkpointing.replication import replicate_checkpoint
    from accelkit.checkpointing.replication.copy import READ_CHUNK, UPLOAD_PARTS_IN_FLIGHT
    from accelkit.checkpointing.replication.replicator import FOREVER, remote_options
    from accelkit.checkpointing.storage import get_storage

    size = 16 * MB if quick else 256 * MB
    repeats = 3 if quick else 5
    notes = [
        "SeaweedFS `weed mini` on 127.0.0.1 (same machine, same disk): the server, the client "
        "and the training process share this machine's 2 cores with other processes.",
        "Blocking: each round waits (untimed) for the background copy to finish before the next "
        "save, so the two cases are measured on the same idle machine.",
    ]
    results: dict[str, Any] = {}
    targets: list[Target] = []
    with section(f"replication, {size // MB} MB of model + AdamW state, {repeats} rounds"):
        try:
            server = start_seaweedfs()
        except (OSError, RuntimeError) as exc:
            print(f"   cannot start SeaweedFS ({exc}); replication benchmark skipped")
            return {}
        scratch = scratch_dir("replication")
        try:
            options = server.storage_options
            fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
            model, optimizer = build_state(size)
            prefix = f"{server.bucket}/bench-{uuid.uuid4().hex[:8]}"

            def accelerator(project: str, remote: str | None) -> Any:
                config = accelkit.ProjectConfiguration(
                    project_dir=project,
                    automatic_checkpoint_naming=True,
                    total_limit=1,
                    replicate_to=remote,
                    replicate_keep=1,
                    storage_options=options,
                )
                acc = accelkit.Accelerator(cpu=True, project_config=config)
                acc.prepare(model, optimizer)
                return acc

            plain = accelerator(str(scratch / "plain"), None)
            replicated = accelerator(str(scratch / "replicated"), f"s3://{prefix}/tier")

            def settle(_name: str) -> None:
                # untimed: the copy of the previous round is done and every dirty page (the
                # server's too: same disk) written, so both cases start from the same state
                replicated._checkpoints.wait_replicated(600)
                os.sync()

            blocking_samples = alternate(
                {"local only": plain.save_state, "with replicate_to": replicated.save_state},
                2 * repeats - 1,
                before=settle,
                warmup=True,
                measure_memory=False,
            )
            settle("")
            blocking = {n: summarise(s) for n, s in blocking_samples.items()}
            ratio = blocking["with replicate_to"]["seconds"] / blocking["local only"]["seconds"]
            print_table(
                [
                    [n, r["seconds"], r["seconds_min"], r["seconds_max"]]
                    for n, r in blocking.items()
                ],
                ["save_state blocks", "median s", "min s", "max s"],
            )
            targets.append(
                Target("blocking save with replication / local only", ratio, 1.1, "x", False)
            )

            # ---------------------------------------------------------------- upload
            committed = plain.save_state()
            local = get_storage(committed)
            files = local.walk_files(committed)
            nbytes = sum(size for name, size in files.items() if name != ".accelkit-save.json")
            remote = get_storage(f"s3://{prefix}", remote_options(f"s3://{prefix}", options))

            def replicator() -> dict[str, Any]:
                target = f"s3://{prefix}/upload/kit"
                done = replicate_checkpoint(local, committed, remote, target, FOREVER)
                return {"bytes": done.bytes}

            def put() -> None:
                for name in files:
                    fs.put_file(os.path.join(committed, name), f"{prefix}/upload/raw/{name}")

            def clear(_name: str) -> None:
                if fs.exists(f"{prefix}/upload"):
                    fs.rm(f"{prefix}/upload", recursive=True)
                fs.invalidate_cache()

            upload_samples = alternate(
                {"replicator": replicator, "s3fs put_file": put},
                repeats,
                before=clear,
                warmup=True,
            )
            upload = {n: summarise(s, nbytes) for n, s in upload_samples.items()}
            fraction = upload["s3fs put_file"]["seconds"] / upload["replicator"]["seconds"]
            for row in upload.values():
                row["fraction_of_s3fs"] = upload["s3fs put_file"]["seconds"] / row["seconds"]
            print_table(
                [
                    [
                        n,
                        r["seconds"],
                        r["gb_per_s"],
                        r["fraction_of_s3fs"],
                        r["peak_extra_memory_bytes"] / MB,
                    ]
                    for n, r in upload.items()
                ],
                ["upload", "s", "GB/s", "of s3fs", "extra MB"],
            )
            targets.append(Target("replicator upload vs s3fs put_file", 100 * fraction, 90.0, "%"))
            memory = _memory_in_fresh_process(committed, f"s3://{prefix}/memory", options)
            targets.append(
                Target(
                    "replicator extra memory (fresh process)",
                    memory["peak_extra_bytes"] / MB,
                    64.0 + READ_CHUNK / MB,
                    "MB",
                    False,
                )
            )
            notes.append(
                "The 'extra MB' column of the upload table is measured in this process, after "
                "the other case ran: memory freed by one case is reused by the next, so it "
                "understates. The memory target is measured in a fresh process instead "
                "(the kernel's high-water mark minus the resident set before the copy)."
            )
            notes.append(
                f"Memory target: 64 MB plus one file's read buffer (READ_CHUNK, 8 MiB: one file "
                f"in flight). An S3 upload is read straight into its 16 MiB part buffers, "
                f"{UPLOAD_PARTS_IN_FLIGHT} in flight plus the one being filled, each sent "
                "without a copy (io.BytesIO bodies)."
            )
            results = {
                "state_bytes": nbytes,
                "blocking": blocking,
                "blocking_ratio": ratio,
                "upload": upload,
                "files": len(files),
                "memory_fresh_process": memory,
                "upload_parts_in_flight": UPLOAD_PARTS_IN_FLIGHT,
            }
            plain.end_training()
            replicated.end_training()
        finally:
            server.stop()
            rmtree(scratch)
    path = write_result(
        "replication",
        results,
        quick=quick,
        targets=targets,
        notes=notes,
        title="Replication to a remote tier (local SeaweedFS)",
    )
    print(f"   -> {path}")
    return results


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
