"""The training boilerplate of the Accelerate guide, runnable with accelkit.

    accelkit launch --cpu --num_processes 2 examples/boilerplate/train.py \\
        hydra.run.dir=outputs/demo num_epochs=2 checkpoint_steps=20
    # resume mid-epoch from one of its checkpoints:
    accelkit launch --cpu --num_processes 2 examples/boilerplate/train.py \\
        hydra.run.dir=outputs/demo-resumed num_epochs=2 \\
        resume_from_checkpoint=outputs/demo/step_20

What changed from the guide's version (``from accelerate`` -> ``from accelkit`` aside):

* Every stub is filled: a synthetic classification dataset, an MLP, a cross-entropy loss,
  accuracy metrics and a validation loop, so the script runs as it is.
* The dataloader is prepared by accelkit instead of wrapped in a ``DistributedSampler`` by
  hand: accelkit shards it across processes and, with ``use_stateful_dataloader=True``,
  ``save_state``/``load_state`` save and restore its position. The guide's version loaded a
  ``loader_state.pt`` that it never saved; here nothing extra is needed to resume mid-epoch.
* ``num_warmup_steps: null`` (the default) no longer crashes (``None * num_processes``), and the
  total number of scheduler steps is scaled by the number of processes like the warm-up is
  (a prepared scheduler advances once per process per optimizer step).
* The resume arithmetic counts batches and optimizer steps in the checkpointed
  ``CheckpointTracker``; the guide's version added the step twice and restarted the epoch's
  step counter at 0 on a resumed, shortened epoch.
* ``report_to`` defaults to ``jsonl`` (works offline); validation runs whether or not a
  tracker is set; ``hydra.run.dir`` has a default without a timestamp so that every process
  of a run agrees on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import transformers
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, OmegaConf
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from accelkit import Accelerator
from accelkit.logging import get_logger
from accelkit.utils import DataLoaderConfiguration, set_seed

try:
    import datasets
except ImportError:
    datasets = None

try:
    import diffusers
except ImportError:
    diffusers = None

logger = get_logger(__name__)
torch.backends.cuda.matmul.allow_tf32 = True


# ────────────────────────────────────────────────────────────────────────── ✣ ─
# Configuration Classes
# ────────────────────────────────────────────────────────────────────────── ✣ ─


@dataclass
class ModelConfig:
    in_features: int = 32
    hidden_size: int = 128
    num_layers: int = 2
    num_classes: int = 4
    dropout: float = 0.1


@dataclass
class DataConfig:
    num_train_samples: int = 4096
    num_val_samples: int = 512
    data_seed: int = 1234
    batch_size: int = MISSING
    num_workers: int = 0
    pin_memory: bool = False
    drop_last: bool = True


@dataclass
class SchedulerConfig:
    name: str = "constant"  # cosine, linear, constant
    num_warmup_steps: int | None = None


@dataclass
class OptimizerConfig:
    learning_rate: float = 0.001
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 0.01
    adam_epsilon: float = 1e-08


@dataclass
class TrainingConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    # Project settings
    project_name: str = MISSING
    exp_name: str = MISSING

    # Training settings
    num_epochs: int = MISSING
    seed: int = 42
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "no"  # no, fp16, bf16
    cpu: bool = False

    # Checkpointing
    resume_from_checkpoint: str | None = None
    checkpoint_steps: int | None = None  # save every N optimizer steps ("steps" strategy)
    save_strategy: str = "steps"  # "epoch", "steps"

    # Gradient clipping
    max_grad_norm: float | None = None
    clip_value: float | None = None

    # Logging and evaluation
    report_to: str | None = "jsonl"
    eval_steps: int | None = None


cs: ConfigStore = ConfigStore.instance()
cs.store(name="training_config", node=TrainingConfig)


# ────────────────────────────────────────────────────────────────────────── ✣ ─
# Model, Data, Optimizer, Scheduler, Loss, Metrics, Validation
# ────────────────────────────────────────────────────────────────────────── ✣ ─


class SyntheticClassification(Dataset):
    """Points labelled by a fixed random linear "teacher": learnable, and the same everywhere."""

    def __init__(self, num_samples: int, cfg: ModelConfig, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        teacher = torch.randn(
            cfg.in_features, cfg.num_classes, generator=torch.Generator().manual_seed(0)
        )
        self.inputs = torch.randn(num_samples, cfg.in_features, generator=generator)
        self.labels = (self.inputs @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def get_model(cfg: ModelConfig) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = cfg.in_features
    for _ in range(cfg.num_layers):
        layers += [
            torch.nn.Linear(width, cfg.hidden_size),
            torch.nn.GELU(),
            torch.nn.Dropout(cfg.dropout),
        ]
        width = cfg.hidden_size
    layers.append(torch.nn.Linear(width, cfg.num_classes))
    return torch.nn.Sequential(*layers)


def set_requires_grad(model: torch.nn.Module, flag: bool = True) -> None:
    for p in model.parameters():
        p.requires_grad = flag


def get_dataloader(
    cfg: DataConfig, model_cfg: ModelConfig
) -> tuple[StatefulDataLoader, StatefulDataLoader]:
    # No DistributedSampler: accelerator.prepare() shards the loader across processes, keeps
    # shuffling in step on every process and makes its position part of save_state().
    train_dataset = SyntheticClassification(cfg.num_train_samples, model_cfg, seed=cfg.data_seed)
    val_dataset = SyntheticClassification(cfg.num_val_samples, model_cfg, seed=cfg.data_seed + 1)
    train_dataloader = StatefulDataLoader(
        train_dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        drop_last=cfg.drop_last,
    )
    val_dataloader = StatefulDataLoader(val_dataset, batch_size=cfg.batch_size, shuffle=False)
    return train_dataloader, val_dataloader


def get_optimizer(
    model: torch.nn.Module,
    cfg: OptimizerConfig,
) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay,
        eps=cfg.adam_epsilon,
    )


def get_loss(cfg: ModelConfig) -> Any:
    criterion = torch.nn.CrossEntropyLoss(reduction="none")

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return criterion(model(batch["inputs"]), batch["labels"])

    return loss_fn


def compute_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    predictions = outputs.argmax(dim=-1)
    return {
        "accuracy": (predictions == targets).float().mean().item(),
        "loss": torch.nn.functional.cross_entropy(outputs.float(), targets).item(),
    }


def validate_model(
    model: torch.nn.Module,
    accelerator: Accelerator,
    val_dataloader: Any,
) -> dict[str, float]:
    model.eval()
    all_outputs, all_targets = [], []
    with torch.no_grad():
        for batch in val_dataloader:
            outputs = model(batch["inputs"])
            # gather_for_metrics drops the samples repeated to even out the last batch.
            outputs, targets = accelerator.gather_for_metrics((outputs, batch["labels"]))
            all_outputs.append(outputs)
            all_targets.append(targets)
    metrics = compute_metrics(torch.cat(all_outputs), torch.cat(all_targets))
    return {f"val/{name}": value for name, value in metrics.items()}


# ────────────────────────────────────────────────────────────────────────── ✣ ─
# Utility Functions
# ────────────────────────────────────────────────────────────────────────── ✣ ─


class CheckpointTracker:
    """Keeps track of how far training got; saved and restored with every checkpoint.

    ``step`` counts the batches this process consumed over all epochs (so the epoch and the
    position inside it follow from it), ``updates`` the optimizer steps.
    """

    def __init__(self, epoch: int = 1, step: int = 0, updates: int = 0) -> None:
        self.epoch: int = epoch
        self.step: int = step
        self.updates: int = updates

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "updates": self.updates}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self.step = state["step"]
        self.updates = state["updates"]


def log_model_info(model: torch.nn.Module) -> None:
    total_params = sum(p.numel() for p in model.parameters())
    trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    logger.info(f"Total parameters: {total_params:,}")
    logger.info(f"Trainable parameters: {trainable_params:,}")
    logger.info(f"Non-trainable parameters: {total_params - trainable_params:,}")


# ────────────────────────────────────────────────────────────────────────── ✣ ─
# Training Loop
# ────────────────────────────────────────────────────────────────────────── ✣ ─


def train(cfg: TrainingConfig) -> None:
    output_root = Path(HydraConfig.get().runtime.output_dir)
    dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(
        cpu=cfg.cpu,
        log_with=cfg.report_to if cfg.report_to else None,
        project_dir=str(output_root),  # trackers write under the run's folder
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        dataloader_config=dataloader_config,
    )
    tracker: CheckpointTracker = CheckpointTracker()
    accelerator.register_for_checkpointing(tracker)
    logger.info(accelerator.state, main_process_only=False)

    if accelerator.is_local_main_process:
        if datasets is not None:
            datasets.utils.logging.set_verbosity_warning()
        if diffusers is not None:
            diffusers.utils.logging.set_verbosity_info()
        transformers.utils.logging.set_verbosity_info()
    else:
        if datasets is not None:
            datasets.utils.logging.set_verbosity_error()
        if diffusers is not None:
            diffusers.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()

    set_seed(cfg.seed)

    # ────────────────────────────────────────────────────────────────────────── ✣ ─
    # Model, Loss, Data, Optimizer, Scheduler
    # ────────────────────────────────────────────────────────────────────────── ✣ ─

    model = get_model(cfg.model)
    set_requires_grad(model, True)

    loss_fn = get_loss(cfg.model)

    log_model_info(model)

    # Prepared first so that len(train_dataloader) is this process's number of batches.
    train_dataloader, val_dataloader = accelerator.prepare(*get_dataloader(cfg.data, cfg.model))
    steps_per_epoch = len(train_dataloader)

    # Calculate total training steps for scheduler
    num_training_steps = (
        math.ceil(steps_per_epoch / cfg.gradient_accumulation_steps) * cfg.num_epochs
    )

    optimizer = get_optimizer(model, cfg.optimizer)
    # A prepared scheduler advances once per process at every optimizer step, so both counts
    # are scaled by the number of processes.
    scheduler = get_scheduler(
        cfg.scheduler.name,
        optimizer,
        num_warmup_steps=(cfg.scheduler.num_warmup_steps or 0) * accelerator.num_processes,
        num_training_steps=num_training_steps * accelerator.num_processes,
    )

    (
        model,
        optimizer,
        scheduler,
    ) = accelerator.prepare(model, optimizer, scheduler)

    # ────────────────────────────────────────────────────────────────────────── ✣ ─
    # Checkpointing, Logging
    # ────────────────────────────────────────────────────────────────────────── ✣ ─

    if cfg.resume_from_checkpoint:
        # Restores the model, optimizer, scheduler, random states, the CheckpointTracker and
        # the dataloader's position (shuffling epoch and batches already seen).
        accelerator.load_state(cfg.resume_from_checkpoint)
        logger.info(f"Resumed from checkpoint: {cfg.resume_from_checkpoint}")
        logger.info(f"Resuming from epoch {tracker.epoch}, step {tracker.updates}")

    if cfg.report_to:
        accelerator.init_trackers(
            project_name=cfg.project_name,
            config=OmegaConf.to_container(cfg, resolve=True),
            init_kwargs={"wandb": {"name": cfg.exp_name}} if cfg.report_to == "wandb" else None,
        )

    # Main progress bar for total training steps
    total_progress = tqdm(
        range(num_training_steps),
        initial=tracker.updates,
        desc="Training",
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )

    # ────────────────────────────────────────────────────────────────────────── ✣ ─
    # Training Loop
    # ────────────────────────────────────────────────────────────────────────── ✣ ─

    start_epoch = tracker.step // steps_per_epoch + 1
    for epoch in range(start_epoch, cfg.num_epochs + 1):
        model.train()
        tracker.epoch = epoch
        # After a resume, the restored dataloader yields only the rest of this epoch.
        first_batch = tracker.step - (epoch - 1) * steps_per_epoch

        # Epoch progress bar
        epoch_progress = tqdm(
            train_dataloader,
            initial=first_batch,
            total=steps_per_epoch,
            desc=f"Epoch {epoch}/{cfg.num_epochs}",
            disable=not accelerator.is_local_main_process,
            dynamic_ncols=True,
            leave=False,
        )

        for batch in epoch_progress:
            tracker.step += 1
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                loss_mean = loss.mean()
                accelerator.backward(loss_mean)

                grad_norm = None
                if accelerator.sync_gradients:
                    if cfg.clip_value is not None:
                        accelerator.clip_grad_value_(model.parameters(), cfg.clip_value)
                    if cfg.max_grad_norm is not None:
                        grad_norm = accelerator.clip_grad_norm_(
                            model.parameters(), cfg.max_grad_norm
                        )

                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            if accelerator.sync_gradients:
                tracker.updates += 1
                global_step = tracker.updates
                # Log training state
                log_metrics = {
                    "loss": accelerator.gather(loss_mean).mean().detach().item(),
                    "learning_rate": scheduler.get_last_lr()[0],
                    "epoch": epoch,
                }
                if grad_norm is not None:
                    log_metrics["grad_norm"] = accelerator.gather(grad_norm).mean().detach().item()

                if torch.cuda.is_available():
                    memory_used = torch.cuda.memory_reserved() / 1024**3
                    log_metrics["memory_gb"] = memory_used

                if cfg.report_to:
                    accelerator.log(log_metrics, step=global_step)

                total_progress.update(1)

                display_metrics = {
                    "loss": f"{log_metrics['loss']:.4f}",
                    "lr": f"{log_metrics['learning_rate']:.2e}",
                }
                if "memory_gb" in log_metrics:
                    display_metrics["mem"] = f"{log_metrics['memory_gb']:.1f}GB"
                if grad_norm is not None:
                    display_metrics["grad"] = f"{log_metrics['grad_norm']:.3f}"

                total_progress.set_postfix(display_metrics)
                epoch_progress.set_postfix(display_metrics)

                if (
                    cfg.save_strategy == "steps"
                    and cfg.checkpoint_steps
                    and global_step % cfg.checkpoint_steps == 0
                ):
                    output_dir = output_root / f"step_{global_step}"
                    accelerator.save_state(str(output_dir))
                    logger.info(f"Saved {output_dir} checkpoint")

                # Run validation if specified
                if cfg.eval_steps is not None and global_step % cfg.eval_steps == 0:
                    metrics = validate_model(model, accelerator, val_dataloader)
                    logger.info(f"Step {global_step}: {metrics}")
                    if cfg.report_to:
                        accelerator.log(metrics, step=global_step)
                    model.train()  # Switch back to training mode

        # Close epoch progress bar
        epoch_progress.close()

        if cfg.save_strategy == "epoch":
            output_dir = output_root / f"epoch_{epoch}"
            accelerator.save_state(str(output_dir))
            logger.info(f"Saved {output_dir} checkpoint")

    metrics = validate_model(model, accelerator, val_dataloader)
    logger.info(f"Final validation: {metrics}")
    if cfg.report_to:
        accelerator.log(metrics, step=tracker.updates)

    accelerator.wait_for_everyone()
    total_progress.close()
    accelerator.save_model(model, str(output_root / "model"))
    accelerator.end_training()


# ────────────────────────────────────────────────────────────────────────── ✣ ─
# Main
# ────────────────────────────────────────────────────────────────────────── ✣ ─


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: TrainingConfig) -> None:
    OmegaConf.to_container(cfg, throw_on_missing=True)
    train(cfg)


if __name__ == "__main__":
    main()
