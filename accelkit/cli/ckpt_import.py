"""``accelkit ckpt import SRC [DST]``: an Accelerate checkpoint folder to an accelkit one.

Registered by :func:`accelkit.cli.ckpt.register` through :func:`register`. Exit codes as the
other ``ckpt`` actions: 0 imported and verified, 1 SRC is not an Accelerate checkpoint or one
of its files is refused (or the project's save lock stayed held), 2 bad usage (SRC missing, DST
exists, DST is SRC or inside it or holds it). The import holds the save lock of DST's project,
so it is safe beside a training run saving there (each waits for the other's save).
"""

from __future__ import annotations

import argparse
from typing import Any

from accelkit.checkpointing.errors import CheckpointError
from accelkit.cli._ckpt_common import (
    Fail,
    add_common,
    command,
    open_storage,
    say,
    say_json,
    usage,
)
from accelkit.cli._table import format_size

__all__ = ["register"]

_DESCRIPTION = (
    "Convert a checkpoint folder written by Hugging Face accelerate's save_state "
    "(checkpoints/checkpoint_<n>/ with model.safetensors or pytorch_model.bin, optimizer.bin, "
    "scheduler.bin, scaler.pt, random_states_<rank>.pkl, custom_checkpoint_<i>.pkl) into a "
    "committed, verified accelkit checkpoint. SRC is only read. Its pickles are read with "
    "torch.load(weights_only=True) and an exact allow-list of what accelerate writes; a file "
    "that wants anything else is refused, naming the file and the global. DST defaults to "
    "checkpoint_<n> beside SRC, n the next free number. Exits 0 when imported and verified, "
    "1 if SRC is not an accelerate checkpoint or a file is refused, 2 on bad usage (SRC "
    "missing, DST exists, DST overlaps SRC). Safe beside a run saving into the same project: "
    "the import takes the project's save lock, and the run's next save moves past the "
    "imported folder."
)


def register(actions: Any) -> None:
    """Add the ``import`` action to ``accelkit ckpt``'s sub-parsers."""
    parser = actions.add_parser(
        "import",
        help="convert a Hugging Face accelerate checkpoint folder into an accelkit checkpoint",
        description=_DESCRIPTION,
    )
    add_common(parser, "SRC: the accelerate checkpoint folder (local path or fsspec URL)")
    parser.add_argument(
        "destination",
        metavar="DST",
        nargs="?",
        help="the new checkpoint folder (must not exist); default: the next free "
        "checkpoint_<n> beside SRC",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=command("import", _run_import))


def _run_import(args: argparse.Namespace) -> int:
    open_storage(args)  # SRC must exist (usage error otherwise)
    try:
        # Imported here: it needs torch, and `accelkit --help` must not pay for it.
        from accelkit.checkpointing.interop.accelerate_import import import_accelerate

        result = import_accelerate(args.path, args.destination, dict(args.storage_options))
    except FileExistsError as exc:
        raise usage(str(exc)) from None
    except FileNotFoundError as exc:
        raise usage(str(exc)) from None
    except CheckpointError as exc:
        raise Fail(str(exc), 1) from None
    except ValueError as exc:  # DST is SRC, inside it or holds it: nothing was written
        raise usage(str(exc)) from None
    manifest = result.manifest
    if args.json:
        doc = {
            "source": result.source,
            "destination": result.destination,
            "iteration": manifest.iteration,
            "step": manifest.step,
            "world_size": manifest.world_size,
            "files": len(manifest.files),
            "size_bytes": manifest.total_size,
            "state": "committed",
            "verified": True,
        }
        say_json(doc)
    else:
        say(
            f"Imported {result.source} -> {result.destination}: {len(manifest.files)} files, "
            f"{format_size(manifest.total_size)}, {manifest.world_size} process(es), step "
            f"{manifest.step}; committed and verified."
        )
    return 0
