"""``accelkit ckpt diff A B [--json]``: what differs between two checkpoints.

Registered by :func:`accelkit.cli.ckpt.register` through :func:`register`; the comparison is
:func:`accelkit.checkpointing.catalog.diff.diff_checkpoints`. Exit codes as ``diff``'s: 0 the
checkpoints are equal, 1 they differ, 2 an error (a path that is not a committed checkpoint,
a damaged file, a refused sharded checkpoint).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from accelkit._text import short
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.storage import get_storage
from accelkit.cli._ckpt_common import Fail, add_common, command, say, say_json, usage
from accelkit.cli._table import format_size, render_table

__all__ = ["register"]

_DESCRIPTION = (
    "Compare two committed accelkit checkpoints A and B (local paths or fsspec URLs). Tensors "
    "(model weights, optimizer moments, RNG and registered objects' tensors) are matched by "
    "name and reported as added, removed, changed in shape or dtype, or changed in values, "
    "with the largest absolute difference |a-b| and relative difference |a-b|/|a| (relative "
    "to A; 'inf' where A is 0 or a NaN appears on one side only). The optimizer's param "
    "groups (hyperparameters), the scheduler, scaler, dataloader positions, registered "
    "objects, the Python/NumPy generator states and the manifest's iteration, step, "
    "world_size, metadata and metrics are compared value by value. Each file is read once, "
    "in pieces, A and B side by side ahead of the comparison, and checked against its "
    "manifest checksum. FSDP2 sharded checkpoints "
    "are refused. Exits 0 when equal, 1 when they differ, 2 on error."
)
_MAX_VALUES = 50  # value rows in the table (--json gives them all)


def register(actions: Any) -> None:
    """Add the ``diff`` action to ``accelkit ckpt``'s sub-parsers."""
    parser = actions.add_parser(
        "diff",
        help="compare two checkpoints: tensors (max abs/rel difference), optimizer, RNG, step",
        description=_DESCRIPTION,
    )
    add_common(parser, "A: a checkpoint folder (holding accelkit.json)")
    parser.add_argument("other", metavar="B", help="B: the checkpoint folder to compare with A")
    parser.add_argument("--json", action="store_true", help="print the diff as JSON")
    parser.set_defaults(func=command("diff", _run_diff))


def _number(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _pair(a: Any, b: Any) -> str:
    return str(a) if a == b else f"{a}->{b}"


def _shape(shape: Any) -> str:
    return "-" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def _value(v: Any) -> str:
    return short(v, 40)


def _run_diff(args: argparse.Namespace) -> int:
    from accelkit.checkpointing.catalog.diff import diff_checkpoints  # needs torch

    options = dict(args.storage_options)
    try:
        storage_a, storage_b = (get_storage(p, options) for p in (args.path, args.other))
    except ValueError as exc:  # an unknown protocol, a bad option
        raise usage(str(exc)) from None
    try:
        diff = diff_checkpoints(storage_a, args.path, storage_b, args.other)
    except CheckpointError as exc:  # a refused path or a damaged file
        raise Fail(str(exc), 2) from None
    if args.json:
        say_json(diff.to_json())
        return 0 if diff.equal else 1
    say(f"A: {diff.a}", f"B: {diff.b}")
    if diff.tensors:
        rows = [
            [
                t.change,
                t.name,
                _pair(t.dtype_a or "-", t.dtype_b or "-"),
                _pair(_shape(t.shape_a), _shape(t.shape_b)),
                _number(t.max_abs),
                _number(t.max_rel),
                "-" if t.changed is None else str(t.changed),
            ]
            for t in diff.tensors
        ]
        print(
            render_table(
                ["CHANGE", "TENSOR", "DTYPE", "SHAPE", "MAX ABS", "MAX REL", "ELEMENTS"],
                rows,
                right=["MAX ABS", "MAX REL", "ELEMENTS"],
            )
        )
    if diff.values:
        rows = [
            [v.name, *("(absent)" if v.missing == side else _value(x) for side, x in sides)]
            for v in diff.values[:_MAX_VALUES]
            for sides in [(("a", v.a), ("b", v.b))]
        ]
        print(render_table(["VALUE", "A", "B"], rows))
        if len(diff.values) > _MAX_VALUES:
            say(f"(+{len(diff.values) - _MAX_VALUES} more values: --json)")
    read = f"{format_size(diff.bytes_read)} read and verified"
    if diff.equal:
        say(f"Equal: {diff.tensors_compared} tensors and every value match ({read}).")
        return 0
    say(
        f"Different: {len(diff.tensors)} tensor(s) and {len(diff.values)} value(s) differ "
        f"({diff.tensors_compared} tensors on both sides; {read})."
    )
    return 1
