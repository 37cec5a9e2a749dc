"""Acceptance soak for issue #26 (not collected by pytest; run by hand, results recorded).

``python -m tests.reliability.soak_replication [--saves 20] [--mb 256] [--outage 30]``

20 saves of a >= 256 MB state (a model and its AdamW moments) into a local project replicated
to SeaweedFS behind the fault-injecting proxy (``tests/helpers/faultproxy.py``), which resets
30% of new connections throughout and is fully down for 30 s in the middle of the run. The same
state is saved into a local-only project in the same rounds, alternating, so the blocking times
compare on the same machine at the same moment. Checked:

- training never raises (every ``save_state`` returns);
- median blocking per save with replication <= 1.1x the local-only median;
- after the outage, every checkpoint the remote retention keeps is committed remotely;
- ``accelkit ckpt verify`` passes each remote checkpoint.

Writes ``tests/reliability/soak_replication.json``; exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--outage", type=float, default=30.0)
    parser.add_argument("--drop", type=float, default=0.3)
    parser.add_argument("--step-seconds", type=float, default=2.0, help="training between saves")
    parser.add_argument("--keep", type=int, default=4, help="replicate_keep")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args(argv)

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import torch

    import accelkit
    from accelkit.checkpointing.catalog.listing import list_checkpoints
    from accelkit.checkpointing.storage import get_storage, join
    from accelkit.cli.main import main as cli
    from benchmarks.bench_save_load import build_state
    from tests.fixtures.s3 import start_s3_server
    from tests.helpers.faultproxy import FaultProxy

    server = start_s3_server()
    proxy = FaultProxy(("127.0.0.1", server.port), seed=26).start()
    scratch = Path(tempfile.mkdtemp(prefix="accelkit-soak-"))
    remote = server.new_prefix()
    options = {
        **server.storage_options,
        "endpoint_url": proxy.endpoint_url,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 20},
    }
    report: dict[str, Any] = {"settings": vars(args), "remote": remote}
    try:
        model, optimizer = build_state(args.mb * 1_000_000)
        nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())

        def accelerator(project: Path, remote_url: str | None) -> Any:
            config = accelkit.ProjectConfiguration(
                project_dir=str(project),
                automatic_checkpoint_naming=True,
                total_limit=2,
                replicate_to=remote_url,
                replicate_keep=args.keep,
                replicate_deadline_seconds=900,
                storage_options=options,
            )
            acc = accelkit.Accelerator(cpu=True, project_config=config)
            acc.prepare(model, optimizer)
            return acc

        plain = accelerator(scratch / "plain", None)
        replicated = accelerator(scratch / "replicated", remote)
        proxy.drop_fraction = args.drop
        blocking: dict[str, list[float]] = {"local only": [], "with replicate_to": []}
        raised: list[str] = []
        outage_at = args.saves // 2
        started = time.monotonic()
        for i in range(args.saves):
            if i == outage_at:
                proxy.down_for(args.outage)
                report["outage_started_s"] = round(time.monotonic() - started, 1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            order = [("local only", plain), ("with replicate_to", replicated)]
            for name, acc in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                try:
                    acc.save_state()
                except Exception as exc:  # the acceptance says this never happens
                    raised.append(f"save {i} ({name}): {type(exc).__name__}: {exc}")
                blocking[name].append(time.perf_counter() - t0)
            time.sleep(args.step_seconds)
        proxy.up()
        proxy.drop_fraction = args.drop  # drops go on while the queue drains
        t0 = time.perf_counter()
        drained = replicated._checkpoints.wait_replicated(900)
        report["drain_seconds_after_loop"] = round(time.perf_counter() - t0, 1)
        left = replicated._checkpoints.close_replication(0)
        plain.end_training()
        replicated.end_training()

        clean = {k: v for k, v in server.storage_options.items()}
        root = join(remote, "checkpoints")
        infos = list_checkpoints(get_storage(root, clean), root)
        committed = sorted(
            (i.name for i in infos if i.state == "committed"),
            key=lambda n: int(n.rsplit("_", 1)[1]),
        )
        expected = [f"checkpoint_{n}" for n in range(args.saves - args.keep, args.saves)]
        flags: list[str] = []
        for key, value in clean.items():
            flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        verified = {
            name: cli(["ckpt", "verify", join(root, name), *flags]) == 0 for name in committed
        }
        medians = {k: statistics.median(v) for k, v in blocking.items()}
        ratio = medians["with replicate_to"] / medians["local only"]
        report.update(
            {
                "state_bytes": nbytes,
                "saves": args.saves,
                "raised": raised,
                "blocking_seconds": {k: [round(x, 4) for x in v] for k, v in blocking.items()},
                "median_blocking_seconds": medians,
                "blocking_ratio": ratio,
                "drained": drained,
                "left_behind": left,
                "remote_committed": committed,
                "remote_expected_by_policy": expected,
                "verified": verified,
                "proxy": {
                    "connections": proxy.connections,
                    "reset_at_accept": proxy.dropped,
                    "cut_mid_stream": proxy.cut,
                },
            }
        )
        checks = {
            "training never raised": not raised,
            "median blocking <= 1.1x local only": ratio <= 1.1,
            "every kept checkpoint committed remotely": set(expected) <= set(committed),
            "ckpt verify passes each": bool(verified) and all(verified.values()),
        }
        report["checks"] = checks
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report.get("checks", {}), indent=2))
    print(f"-> {args.out}")
    return 0 if report.get("checks") and all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
