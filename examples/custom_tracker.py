"""A custom tracker, registered by name, logging next to every installed tracker (``"all"``).

    accelkit launch --cpu --num_processes 2 examples/custom_tracker.py
    accelkit launch --cpu --num_processes 2 examples/custom_tracker.py --broken

``CSVTracker`` subclasses ``GeneralTracker`` and is registered with ``register_tracker``, so its
name ``"csv"`` works in ``log_with`` and ``log_with="all"`` picks it up with the built-in trackers
whose packages are installed (the reference leaves registered trackers out of ``"all"``).

With ``--broken`` a tracker that raises on every ``log()`` joins the run: training goes on, the
other trackers still get every value, the failure is reported once, with the tracker's name, and
the broken tracker's values wait in its journal for ``accelkit track sync``.
"""

from __future__ import annotations

import argparse
import csv
import os
from typing import IO, Any

import torch
from typing_extensions import override

from accelkit import Accelerator, GeneralTracker, register_tracker

# "all" starts every installed tracker. This demo keeps the hosted services local (W&B offline;
# Comet runs offline by itself without an API key); delete these lines to log online.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
os.environ.setdefault("COMET_AUTO_LOG_ENV_DETAILS", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_STUDIO_OFFLINE", "true")


@register_tracker
class CSVTracker(GeneralTracker):
    """Append ``step,name,value`` rows to ``<logging_dir>/<run_name>/metrics.csv``."""

    name = "csv"
    requires_logging_directory = True
    main_process_only = True  # constructed on the main process only; log() elsewhere is a no-op

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.path = os.path.join(self.logging_dir or ".", run_name, "metrics.csv")
        self._file: IO[str] | None = None

    @property
    @override
    def tracker(self) -> IO[str] | None:
        """The open CSV file (what ``get_tracker("csv", unwrap=True)`` returns)."""
        return self._file

    @override
    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        if self._file.tell() == 0:
            csv.writer(self._file).writerow(["step", "name", "value"])

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.log({f"config/{key}": value for key, value in values.items()}, step=0)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        assert self._file is not None, "log() before start()"
        writer = csv.writer(self._file)
        for key, value in values.items():
            writer.writerow([step, key, float(value) if torch.is_tensor(value) else value])
        self._file.flush()

    @override
    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class BrokenTracker(GeneralTracker):
    """A tracker whose service is down: every ``log()`` raises."""

    name = "broken"
    requires_logging_directory = False

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        raise ConnectionError("tracking server unreachable")


def main(args: argparse.Namespace) -> None:
    log_with: list[Any] = ["all"]
    if args.broken:
        log_with.append(BrokenTracker())
    accelerator = Accelerator(log_with=log_with, project_dir=args.project_dir)
    accelerator.init_trackers("custom_tracker", config={"lr": args.lr, "steps": args.steps})
    accelerator.print("trackers:", ", ".join(t.name for t in accelerator.trackers))

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 8, device=accelerator.device)
        loss = torch.nn.functional.mse_loss(model(x), x @ target.to(accelerator.device))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach(), "lr": args.lr}, step=step)

    accelerator.end_training()  # flushes every tracker
    if accelerator.is_main_process:
        path = os.path.join(args.project_dir, "custom_tracker", "metrics.csv")
        with open(path, encoding="utf-8") as file:
            rows = sum(1 for row in csv.DictReader(file) if row["name"] == "loss")
        print(f"csv tracker wrote {rows} loss rows to {path}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--project_dir", default="runs/custom_tracker")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--broken", action="store_true", help="add a tracker that always fails")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
