"""A training script that survives preemption: it saves when `should_save()` says so and stops
cleanly when `preemption_requested` turns True, then resumes where it stopped when started again.

    accelkit launch --num_processes 8 examples/slurm/train_preemptible.py --project_dir runs/a

Run it again with the same --project_dir after a preemption (SLURM: `preemptible.sbatch`
requeues the job) and it continues from the newest committed checkpoint, bitwise as if it had
never stopped. See docs/guides/preemption.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from accelkit import Accelerator, ProjectConfiguration


class Progress:
    """The loop's own step count, saved and restored with every checkpoint."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save_every_steps", type=int, default=500)
    parser.add_argument("--save_every_seconds", type=float, default=1800.0)
    parser.add_argument("--step_sleep", type=float, default=0.0, help="slow each step (demos)")
    args = parser.parse_args()

    config = ProjectConfiguration(
        project_dir=args.project_dir,
        automatic_checkpoint_naming=True,
        total_limit=3,
        save_every_steps=args.save_every_steps,
        save_every_seconds=args.save_every_seconds,
        # SLURM's --signal, Kubernetes and spot VMs send these; the handler only sets a flag.
        preemption_signals=("SIGTERM", "SIGUSR1"),
    )
    accelerator = Accelerator(project_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if os.path.isdir(os.path.join(args.project_dir, "checkpoints")):
        accelerator.load_state()  # the newest committed checkpoint (the loader resumes too)
        accelerator.print(f"resumed at step {progress.step}")

    while progress.step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            time.sleep(args.step_sleep)
            # Every process asks at the same point; the answer is the same on all of them.
            if accelerator.should_save():
                accelerator.save_state()
            if accelerator.preemption_requested:
                accelerator.print(f"preempted at step {progress.step}: checkpoint saved")
                accelerator.end_training()
                return config.preemption_exit_code  # 75: "requeue me"
            if progress.step >= args.steps:
                break
    accelerator.save_state()
    accelerator.print(f"done: {progress.step} steps, loss {loss.item():.4f}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
