"""Accelerate's pickles, read as data: never as a program, never as an amplifier.

Accelerate saves optimizer, scheduler, scaler, dataloader, random and custom states with
``torch.save``. Every one of them is read by :func:`load_pickle`. Before torch sees a file,
:mod:`~accelkit.checkpointing.formats._torch_pickle` checks its zip (stored records only, each
name once, nothing around them; the legacy non-zip format refused) and runs its pickle on
stand-ins: only exact ``(module, name)`` pairs (torch's tensor rebuild, typed storages and
plain-data helpers, and what NumPy's generator state pickles to, :data:`ALLOWED_GLOBALS`), each
called only with the arguments torch or NumPy give it; tensors inside their storage without
stride-0 or overlapping expansion; NumPy arrays only of uint32, completed by their ``BUILD``
with exactly their bytes; the value, counting shared objects where they occur, within a few
times the file's size. Then ``torch.load(weights_only=True)`` with the same allow-list reads
it, and the objects it built are walked once more. Any refusal is a ``CorruptCheckpointError``
naming the file and what was wrong (:func:`refused`).

What the values *mean* (random states, dataloader positions, the folder's layout) is
:mod:`~accelkit.checkpointing.interop.accelerate_format`'s business; this module only makes
sure that what comes out of a file is plain data of a bounded size.

Public API: :data:`ALLOWED_GLOBALS`, :func:`load_pickle(storage, url) <load_pickle>`,
:func:`refused(url, why) <refused>`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats._torch_pickle import (
    Rules,
    is_node,
    node,
    read_archive,
    scan_pickle,
    tensor_extent,
    torch_rules,
)
from accelkit.checkpointing.storage import Storage
from accelkit.checkpointing.storage.verified import open_checkpoint_file

__all__ = ["ALLOWED_GLOBALS", "load_pickle", "refused"]


def _numpy_reconstruct() -> Any:
    core = getattr(np, "_core", None) or np.core  # NumPy 2, else NumPy 1
    return core.multiarray._reconstruct


#: The globals, beyond torch's weights-only set, that an Accelerate pickle may name: exactly
#: what NumPy's ``get_state()`` tuple pickles to (under NumPy 2 and NumPy 1 module names).
ALLOWED_GLOBALS: dict[str, Any] = {
    "numpy.ndarray": np.ndarray,
    "numpy.dtype": np.dtype,
    # What numpy.dtype("u4") is an instance of (NumPy >= 1.25): the pickle's BUILD of the
    # dtype needs it. Only uint32: the generator's key words.
    "numpy.dtypes.UInt32DType": np.dtypes.UInt32DType,
    "numpy._core.multiarray._reconstruct": _numpy_reconstruct(),
    "numpy.core.multiarray._reconstruct": _numpy_reconstruct(),
}

# How NumPy pickles the generator's key: dtype('u4', False, True) completed by BUILD with this
# state (little-endian, no fields), and _reconstruct(ndarray, (0,), b'b') (an empty array, so
# nothing uninitialised) completed by BUILD with (1, shape, dtype, is_fortran, data).
_UINT32_STATE = (3, "<", None, None, None, -1, -1, 0)


def _dtype_rule(args: tuple[Any, ...], scan: Any) -> Any:
    if args != ("u4", False, True):
        raise ValueError(
            f"only dtype('u4', False, True) (the generator's uint32 words), not {args!r:.80}"
        )

    def complete(state: Any) -> int:
        if not is_node(state, "tuple") or state.items != _UINT32_STATE:
            raise ValueError("the dtype's state is not little-endian uint32's")
        return 1

    return node("dtype", info={"build": complete})


def _array_rule(args: tuple[Any, ...], scan: Any) -> Any:
    kind: Any
    shape: Any
    kind, shape, code = args if len(args) == 3 else (None, None, None)
    if not (
        is_node(kind, "global")
        and kind.info == ("numpy", "ndarray")
        and is_node(shape, "tuple")
        and shape.items == (0,)
        and code == b"b"
    ):
        raise ValueError("only _reconstruct(numpy.ndarray, (0,), b'b'), how NumPy pickles one")

    def complete(state: Any) -> int:
        items: tuple[Any, ...] = state.items if is_node(state, "tuple") else ()
        if len(items) != 5 or items[0] != 1:
            raise ValueError("its state is not (1, shape, dtype, is_fortran, data)")
        _, dims, dtype, fortran, data = items
        if not (
            is_node(dims, "tuple")
            and len(dims.items) == 1
            and type(dims.items[0]) is int
            and dims.items[0] >= 0
        ):
            raise ValueError("its shape is not one whole number (a 1-D array)")
        if not is_node(dtype, "dtype") or type(fortran) is not bool:
            raise ValueError("its dtype is not the uint32 dtype")
        if not isinstance(data, bytes) or len(data) != 4 * dims.items[0]:
            raise ValueError(
                f"its data is not exactly {4 * dims.items[0]} bytes (uint32 x {dims.items[0]})"
            )
        return max(1, len(data))

    return node("array", info={"build": complete})


def _accelerate_rules() -> Rules:
    rules = torch_rules()
    calls = dict(rules.calls)
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        calls[(module, "_reconstruct")] = _array_rule
    calls[("numpy", "dtype")] = _dtype_rule
    return Rules(storages=rules.storages, calls=calls, names=rules.names | {("numpy", "ndarray")})


_RULES = _accelerate_rules()


def refused(url: str, why: str) -> CorruptCheckpointError:
    """The error for a pickle this module will not read: the file, why, and what to do if the
    file is trusted."""
    return CorruptCheckpointError(
        f"{url}: {why}. accelkit reads Accelerate's pickles only with "
        "torch.load(weights_only=True) and an exact allow-list of what Accelerate writes; "
        "nothing else is unpickled. If you trust this file, re-save it from a state_dict of "
        "tensors, numbers, strings, lists and dicts."
    )


def load_pickle(storage: Storage, url: str) -> Any:
    """Read one of Accelerate's ``torch.save`` pickles as data: no code runs, nothing grows.

    Three fences, in order:

    1. :func:`~accelkit.checkpointing.formats._torch_pickle.read_archive`: the zip as
       ``torch.save`` writes it (stored records, each name once, nothing hidden between
       records); the legacy non-zip format is refused (Accelerate's ``save_state`` writes
       torch's zip format on every torch it runs on).
    2. :func:`~accelkit.checkpointing.formats._torch_pickle.scan_pickle` with Accelerate's
       rules: only the globals of :data:`ALLOWED_GLOBALS` and torch's tensor rebuild, each
       with the arguments torch or NumPy give it; tensors inside their storage (no stride 0,
       no overlap), storages of exactly their record's size, NumPy arrays completed by their
       ``BUILD``, and the value (shared objects counted where they occur) within a few times
       the file's size.
    3. ``torch.load(weights_only=True)`` with the exact allow-list, then a walk of the value
       (only plain data, dense CPU tensors inside their storage, uint32 NumPy arrays).

    Memory stays within a small multiple of the file's size: nothing is inflated and no
    tensor is expanded.

    Args:
        storage: a confined view of the checkpoint folder.
        url: the file.

    Returns:
        The unpickled value (tensors on the CPU).

    Raises:
        CorruptCheckpointError: naming the file and what was wrong: missing, not a
            ``torch.save`` archive (or the legacy format), a compressed or duplicated record, a
            global outside :data:`ALLOWED_GLOBALS` and torch's tensor rebuild (named as
            ``'module.name'``), hostile arguments, a tensor outside its storage, an expansion
            past the budget, or a refusal by ``torch.load(weights_only=True)``.
    """
    f = open_checkpoint_file(storage, url)
    # Streamed from the open file: tensors are read once, into their own memory (a whole-file
    # buffer first would cost twice an optimizer's size).
    with f:
        scan_pickle(read_archive(f, url), url, _RULES)
        allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
            (obj, name) for name, obj in ALLOWED_GLOBALS.items()
        ]
        try:
            f.seek(0)
            with torch.serialization.safe_globals(allowed):
                value = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise refused(url, f"torch.load(weights_only=True) refused it ({exc})") from None
    _check_loaded(value, url)
    return value


_SCALARS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def _check_loaded(value: Any, url: str) -> None:
    """The second look, at the objects torch built: plain data only, each tensor dense, on
    the CPU and inside its storage, each NumPy array uint32 and 1-D."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, _SCALARS) or id(item) in seen:
            continue
        seen.add(id(item))
        if type(item) in (dict, OrderedDict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif type(item) in (list, tuple, set, torch.Size):
            todo.extend(item)
        elif type(item) is torch.Tensor:
            _check_tensor(item, url)
        elif type(item) is np.ndarray:
            if item.dtype != np.dtype("<u4") or item.ndim != 1:
                raise refused(url, f"a NumPy array of {item.dtype} with shape {item.shape}")
        else:
            raise refused(url, f"it holds a {type(item).__name__}, which is not plain data")


def _check_tensor(tensor: torch.Tensor, url: str) -> None:
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        raise refused(url, f"a tensor of layout {tensor.layout} on {tensor.device}")
    try:
        extent = tensor_extent(tuple(tensor.shape), tuple(tensor.stride()))
    except ValueError as exc:
        raise refused(url, f"a tensor: {exc}") from None
    have = tensor.untyped_storage().nbytes() // max(1, tensor.element_size())
    if extent and tensor.storage_offset() + extent > have:
        raise refused(url, f"a tensor of shape {list(tensor.shape)} reaches past its storage")
