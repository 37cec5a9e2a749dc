"""A training job for the experiment-continuity tests: log every step, save, die, resume.

Run it as a script (one process) or under ``torch.distributed.run`` (several)::

    python -m tests.trackers.resume_job --project P --log-with jsonl,tensorboard \
        --steps 200 --save-every 100 --kill-at 150          # first attempt: SIGKILL at 150
    python -m tests.trackers.resume_job --project P --log-with jsonl,tensorboard \
        --steps 200 --save-every 100 --resume --attempt 1   # resumes from checkpoint_<n>

Each step logs ``loss = step + 1000 * attempt`` at ``step``, so a reader tells which attempt
wrote a point. The step counter is registered for checkpointing, so a resumed attempt continues
after the checkpoint's step. Before the kill, the job waits for its checkpoints and flushes the
trackers (values logged after the checkpoint are on disk and must be purged by the resume).
``--order`` says whether ``init_trackers`` comes before ``load_state`` (Accelerate's examples)
or after; ``--fork PATH`` forks that checkpoint (``load_state(PATH, fork=True)``). The main
process prints one JSON line ``RESULT {...}`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch

from accelkit import Accelerator, ProjectConfiguration


class StepCounter:
    """The job's position, saved with every checkpoint."""

    def __init__(self) -> None:
        self.step = -1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--log-with", default="jsonl")
    parser.add_argument("--run-name", default="run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--fork", default=None, help="load_state(FORK, fork=True)")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--order", choices=["init-first", "load-first"], default="init-first")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--no-continue", action="store_true")
    parser.add_argument("--init-kwargs", default="{}", help="JSON: tracker name -> kwargs")
    return parser.parse_args()


def _flush_to_disk(accelerator: Accelerator) -> None:
    """Make what was logged so far reach the backends' files (as a long run would have)."""
    accelerator.wait_for_checkpoints()
    for tracker in accelerator.trackers:
        accelerator.get_tracker(tracker.name)  # waits until its queue is drained
        backend = tracker.tracker
        if tracker.name in ("tensorboard", "jsonl") and backend is not None:
            backend.flush()  # a SummaryWriter, an open file
        elif tracker.name == "trackio" and backend is not None:
            backend._flush_queues_inline()  # its sender thread writes the database in batches
        elif tracker.name == "clearml" and backend is not None:
            backend.flush(wait_for_uploads=True)  # its reporter thread writes metrics.jsonl


def main() -> None:
    args = _arguments()
    config = ProjectConfiguration(
        project_dir=args.project,
        automatic_checkpoint_naming=True,
        async_save=args.async_save,
        continue_tracker_runs=not args.no_continue,
    )
    log_with = [name for name in args.log_with.split(",") if name]
    accelerator = Accelerator(log_with=log_with, project_config=config)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    init_kwargs = json.loads(args.init_kwargs)

    def init() -> None:
        accelerator.init_trackers(args.run_name, config={"lr": 0.1}, init_kwargs=init_kwargs)

    if args.order == "init-first":
        init()
    loaded = accelerator.load_state() if args.resume else None
    if args.fork is not None:
        loaded = accelerator.load_state(args.fork, fork=True)
    if args.order == "load-first":
        init()

    for step in range(counter.step + 1, args.steps):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        counter.step = step
        accelerator.log({"loss": float(step + 1000 * args.attempt)}, step=step)
        if step > 0 and step % args.save_every == 0:
            accelerator.save_state()
        if args.kill_at is not None and step == args.kill_at:
            _flush_to_disk(accelerator)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                os.kill(os.getpid(), signal.SIGKILL)
            accelerator.wait_for_everyone()  # the others die when the launcher sees it

    references = {}
    if accelerator.is_main_process:
        for tracker in accelerator.trackers:
            references[tracker.name] = tracker.run_reference()
    accelerator.end_training()
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"loaded": loaded, "runs": references}), flush=True)


if __name__ == "__main__":
    main()
