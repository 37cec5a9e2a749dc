"""``accelkit ckpt export CKPT OUT --format hf``: a checkpoint's model as Hugging Face files.

Registered by :func:`accelkit.cli.ckpt.register` through :func:`register`; the work is
:func:`accelkit.checkpointing.interop.hf_export.export_hf`. Exit codes as the other ``ckpt``
actions: 0 exported, 1 CKPT is not a committed accelkit checkpoint or a file of it is damaged
(nothing is left in OUT), 2 bad usage (CKPT missing, OUT not empty without ``--force``, a bad
``--model``, ``--dtype`` or ``--max-shard-size``).
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
    size_type,
    usage,
    whole_number,
)
from accelkit.cli._table import format_size

__all__ = ["register"]

_DESCRIPTION = (
    "Write the model weights of a committed accelkit checkpoint into OUT as Hugging Face's "
    "safetensors files (model.safetensors, or model-0000i-of-0000N.safetensors shards and "
    "model.safetensors.index.json), as transformers' save_pretrained lays them out. Each file "
    "of CKPT is read once and checked against its manifest checksum; one tensor is in memory "
    "at a time. OUT is written into a hidden folder beside it and renamed when complete: a "
    "failed export leaves nothing. An FSDP2 checkpoint (the model as sharded state in sharded/) "
    "exports the same way, in one process: each tensor is planned from DCP's index and each "
    "chunk read from its byte range of the .distcp files, one chunk at a time. Tied weights "
    "(one tensor under two names) are written under each name. OUT gets weights only: copy "
    "the model's config.json (and tokenizer) in for from_pretrained. A project or checkpoints "
    "folder stands for its newest committed checkpoint. Exits 0 when exported, 1 if CKPT is "
    "not a committed accelkit checkpoint or is damaged, 2 on bad usage (CKPT missing, OUT not "
    "empty without --force)."
)


def register(actions: Any) -> None:
    """Add the ``export`` action to ``accelkit ckpt``'s sub-parsers."""

    parser = actions.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors files (from_pretrained)",
        description=_DESCRIPTION,
    )
    add_common(parser, "CKPT: a committed checkpoint (local path or fsspec URL)")
    parser.add_argument("out", metavar="OUT", help="the local folder to write (absent or empty)")
    parser.add_argument(
        "--format", choices=["hf"], default="hf", help="hf: Hugging Face safetensors (default)"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="cast floating-point tensors to this dtype (default: keep the stored dtypes)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=size_type("--max-shard-size"),
        default="5GB",
        metavar="SIZE",
        help="largest output file, e.g. 5GB (default), 500MB, 2GiB",
    )
    parser.add_argument(
        "--model",
        type=whole_number(0),
        default=0,
        metavar="N",
        help="which model of the checkpoint, in prepare() order (default: 0)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty OUT once the export is complete"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=command("export", _run_export))


def _run_export(args: argparse.Namespace) -> int:
    open_storage(args)  # CKPT must exist (usage error otherwise)
    # Imported here: it needs torch, and `accelkit --help` must not pay for it.
    from accelkit.checkpointing.interop.hf_export import export_hf

    try:
        result = export_hf(
            args.path,
            args.out,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            model=args.model,
            force=args.force,
            storage_options=dict(args.storage_options),
        )
    except CheckpointError as exc:  # before ValueError: a bad CKPT path is both
        raise Fail(str(exc), 1) from None
    except (FileExistsError, ValueError) as exc:
        raise usage(str(exc)) from None
    if args.json:
        say_json(
            {
                "source": result.source,
                "out": result.out,
                "model": result.model,
                "files": result.files,
                "tensors": result.tensors,
                "size_bytes": result.total_size,
                "tied": result.tied,
            }
        )
        return 0
    say(
        f"Exported model {result.model} of {result.source} -> {result.out}: {result.tensors} "
        f"tensors, {format_size(result.total_size)} in {len(result.files)} file(s)."
    )
    if result.tied:
        pairs = ", ".join(f"{a} = {n}" for a, n in sorted(result.tied.items()))
        say(f"Tied weights written under each name: {pairs}.")
    return 0
