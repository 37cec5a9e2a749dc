"""Reading checkpoint folders written by Hugging Face accelerate's ``save_state``, safely.

Accelerate writes (``accelerate/checkpointing.py``, ``utils/constants.py``):

==================================  ================================================================
file                                holds
==================================  ================================================================
``model.safetensors``,              each prepared model's weights (safetensors; tied duplicates
``model_1.safetensors``...          removed) or, with ``safe_serialization=False``,
``pytorch_model[_i].bin``           a ``torch.save`` pickle of the state dict
``optimizer[_i].bin``               each optimizer's ``state_dict()`` (pickle)
``scheduler[_i].bin``               each scheduler's ``state_dict()`` (pickle)
``dl_state_dict[_i].bin``           a stateful dataloader's ``state_dict()`` (pickle)
``sampler[_i].bin``                 a pickled ``SeedableRandomSampler`` *object* (never read here)
``scaler.pt``                       the grad scaler's ``state_dict()`` (pickle)
``random_states_<rank>.pkl``        ``{"step", "random_state" (Python), "numpy_random_seed" (NumPy's
                                    ``get_state()`` tuple), "torch_manual_seed", and
                                    "torch_cuda_manual_seed" where CUDA was available}`` (pickle)
``custom_checkpoint_<i>.pkl``       each registered object's ``state_dict()`` (pickle)
==================================  ================================================================

The file names are those of :data:`~accelkit.checkpointing.formats.layout.ACCELERATE_KINDS`
(the one table of them; this one says what each file holds).

Every pickle is read by
:func:`~accelkit.checkpointing.interop.accelerate_pickle.load_pickle` as data, never as a
program nor an amplifier (its module says how). Every file is read through
:func:`~accelkit.checkpointing.storage.confined.confine` (no link followed). Each value is
checked here for the shape Accelerate gives it before any live object changes.

Public API:

- :class:`AccelerateCheckpoint` and :func:`read_accelerate(storage, folder, ranks)
  <read_accelerate>` -- everything in a folder, checked, as accelkit-shaped states (random
  states as :func:`~accelkit.checkpointing.objects.rng.capture_rng_state` returns them).
- :func:`check_accelerate(storage, folder) <check_accelerate>` -> :class:`AccelerateCheck` --
  what ``accelkit ckpt verify`` checks in such a folder, which records no checksums: every
  file read to its end at its listed size, then the whole folder read as ``load_state`` reads
  it (pickles through the allow-list, safetensors headers against their files, every value's
  shape).
- :class:`AccelerateReader` -- what ``load_state`` does with such a folder: the reader the
  checkpoint manager plugs into the load sequence
  (:class:`~accelkit.checkpointing.restore.sequence.LoadSequence`); its manifest is a stand-in
  (no files; ``step`` is the optimizer steps read from the optimizer state, else
  Accelerate's own counter).
- :func:`optimizer_steps(states) <optimizer_steps>` and :func:`read_optimizer_steps(storage,
  folder) <read_optimizer_steps>` -- the optimizer steps an Accelerate checkpoint was saved at
  (Accelerate records only its ``accumulate`` counter), for ``load_state`` and ``ckpt ls``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from accelkit._version import __version__
from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.checkpointing.formats.layout import (
    ACCELERATE_KINDS,
    KINDS,
    TENSORS_SUFFIX,
    parse_checkpoint_name,
)
from accelkit.checkpointing.formats.manifest import Manifest
from accelkit.checkpointing.formats.model_io import check_model_keys
from accelkit.checkpointing.formats.safetensors_io import read_safetensors
from accelkit.checkpointing.interop.accelerate_pickle import load_pickle
from accelkit.checkpointing.objects.contents import (
    LoadedContents,
    TrainingObjects,
    apply_contents,
    fallback_rng_seed,
    unwrap_model,
)
from accelkit.checkpointing.objects.fingerprint import Fingerprint
from accelkit.checkpointing.objects.rng import check_rng_state
from accelkit.checkpointing.restore.sequence import LoadSource
from accelkit.checkpointing.storage import Storage, join
from accelkit.checkpointing.storage.confined import confine

__all__ = [
    "AccelerateCheck",
    "AccelerateCheckpoint",
    "AccelerateReader",
    "check_accelerate",
    "optimizer_steps",
    "read_accelerate",
    "read_optimizer_steps",
]

logger = logging.getLogger(__name__)


# Accelerate's file names, from the one table of them (formats/layout.py's ACCELERATE_KINDS);
# its models are model[_i].safetensors, named as accelkit's (KINDS["model"], one file each),
# or pytorch_model[_i].bin with safe_serialization=False.
_RNG_FILE = ACCELERATE_KINDS["random_states"].regex()
_INDEXED = {
    "model": re.compile(
        f"^(?:{KINDS['model'].pattern((TENSORS_SUFFIX,), shards=False)}"
        f"|{ACCELERATE_KINDS['model'].pattern()})$"
    ),
    **{kind: ACCELERATE_KINDS[kind].regex() for kind in ("optimizer", "scheduler", "sampler")},
    "dataloader": ACCELERATE_KINDS["dataloader"].regex(),
    "custom": ACCELERATE_KINDS["custom"].regex(),
}
_RNG_KEYS = {"step", "random_state", "numpy_random_seed", "torch_manual_seed"}
_CUDA_KEY = "torch_cuda_manual_seed"


# --------------------------------------------------------------------------- checking values


def _python_state(value: Any, url: str) -> tuple[Any, ...]:
    if (
        not isinstance(value, tuple)
        or len(value) != 3
        or type(value[0]) is not int
        or not isinstance(value[1], tuple)
        or not all(type(v) is int for v in value[1])
        or not (value[2] is None or type(value[2]) is float)
    ):
        raise CorruptCheckpointError(
            f"{url}: 'random_state' is not Python's random.getstate() tuple (version, tuple of "
            "ints, gauss); the file is damaged."
        )
    return value


def _numpy_state(value: Any, url: str) -> tuple[Any, ...]:
    if (
        not isinstance(value, tuple)
        or len(value) != 5
        or value[0] != "MT19937"
        or not isinstance(value[1], np.ndarray)
        or value[1].dtype != np.uint32
        or value[1].shape != (624,)
        or type(value[2]) is not int
        or type(value[3]) is not int
        or type(value[4]) is not float
    ):
        raise CorruptCheckpointError(
            f"{url}: 'numpy_random_seed' is not NumPy's get_state() tuple ('MT19937', 624 "
            "uint32 words, position, has_gauss, cached_gaussian); the file is damaged."
        )
    return value


def _byte_tensor(value: Any, url: str, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise CorruptCheckpointError(
            f"{url}: {key!r} is not a generator state (a 1-D uint8 tensor); the file is damaged."
        )
    return value


def rng_from_accelerate(value: Any, url: str) -> tuple[dict[str, Any], int]:
    """Convert one ``random_states_<rank>.pkl`` to ``(accelkit random states, step)``.

    Raises:
        CorruptCheckpointError: naming the file and the key that is missing or malformed.
    """
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CorruptCheckpointError(f"{url}: expected a dict of random states; it is damaged.")
    missing = sorted(_RNG_KEYS - set(value))
    if missing:
        raise CorruptCheckpointError(
            f"{url}: the key {missing[0]!r} is missing (Accelerate writes {sorted(_RNG_KEYS)}); "
            "the file is damaged."
        )
    step = value["step"]
    if type(step) is not int or step < 0:
        raise CorruptCheckpointError(f"{url}: 'step' is {step!r}, not a whole number >= 0.")
    state: dict[str, Any] = {
        "python": _python_state(value["random_state"], url),
        "numpy": _numpy_state(value["numpy_random_seed"], url),
        "torch": _byte_tensor(value["torch_manual_seed"], url, "torch_manual_seed"),
    }
    cuda = value.get(_CUDA_KEY)
    if cuda is not None:
        if not isinstance(cuda, list):
            raise CorruptCheckpointError(f"{url}: {_CUDA_KEY!r} is not a list of states.")
        state["cuda"] = [_byte_tensor(t, url, _CUDA_KEY) for t in cuda]
    others = sorted(set(value) - _RNG_KEYS - {_CUDA_KEY})
    if others:
        logger.warning(
            "%s: generator states %s are for devices accelkit does not drive; not restored.",
            url,
            others,
        )
    check_rng_state(state, url)
    return state, step


def _state_dict(value: Any, url: str, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{url}: expected a {what} state_dict (a dict), found {type(value).__name__}; the "
            "file is damaged."
        )
    return value


def dataloader_from_accelerate(value: Any, url: str) -> dict[str, Any]:
    """Convert a ``dl_state_dict[_i].bin`` (a ``StatefulDataLoader`` state Accelerate saved with
    ``use_stateful_dataloader``) to a prepared accelkit dataloader's position.

    The position in the epoch is the batches already yielded (``_num_yielded``); the whole
    state goes on to a stateful accelkit loader's ``StatefulDataLoader``. Accelerate does not
    save the epoch number, so the epoch counts from 0 (as it does in Accelerate's own resume).

    Raises:
        CorruptCheckpointError: naming the file, if ``_num_yielded`` is missing or not a count.
    """
    state = _state_dict(value, url, "dataloader")
    yielded = state.get("_num_yielded")
    if type(yielded) is not int or yielded < 0:
        raise CorruptCheckpointError(
            f"{url}: '_num_yielded' is {yielded!r}, not a count of batches; the file is damaged."
        )
    return {
        "epoch": 0,
        "batches_yielded": yielded,
        "seed": None,
        "stateful_dataloader": state,
        "sampler_offset": 0,
    }


def _weights(value: Any, url: str) -> dict[str, torch.Tensor]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        raise CorruptCheckpointError(f"{url}: expected a dict of tensors (a model state_dict).")
    return value


# --------------------------------------------------------------------------- the folder


@dataclass
class AccelerateCheckpoint:
    """Everything read from an Accelerate folder, checked, in accelkit's shapes.

    Attributes:
        folder: its path or URL.
        models: weights per model index (``model.safetensors`` is index 0).
        optimizers / schedulers / custom: ``state_dict()`` per index.
        dataloaders: dataloader positions by index, from ``dl_state_dict[_i].bin``, in the
            format of a prepared accelkit dataloader's ``state_dict()``.
        scaler: the grad scaler's state, if saved.
        rng: accelkit random states by rank (only the ranks asked for).
        world_size: number of ``random_states_<rank>.pkl`` files (processes that saved it).
        step: Accelerate's ``step`` (micro-steps counted by ``accumulate``; 0 without it).
        optimizer_steps: the optimizer steps taken, from the optimizers' states (what
            accelkit's ``step`` means), or ``None`` where no state records one (SGD without
            momentum, no optimizer saved).
        files: what was read, by relative name (for messages and the import's metadata).
    """

    folder: str
    models: list[dict[str, torch.Tensor]] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    dataloaders: dict[int, Any] = field(default_factory=dict)
    scaler: Any = None
    custom: list[Any] = field(default_factory=list)
    rng: dict[int, dict[str, Any]] = field(default_factory=dict)
    world_size: int = 0
    step: int = 0
    optimizer_steps: int | None = None
    files: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """The checkpoint's step as accelkit counts it: optimizer steps where the optimizer
        state records them, else Accelerate's own counter."""
        return self.step if self.optimizer_steps is None else self.optimizer_steps


def _indexed(names: Iterable[str], kind: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for name in sorted(names):
        match = _INDEXED[kind].match(name)
        if match is None:
            continue
        index = int(next((g for g in match.groups() if g is not None), 0))
        if index in found:  # model.safetensors and pytorch_model.bin both present
            if name.endswith(".safetensors"):
                found[index] = name  # Accelerate itself prefers the safetensors file
            continue
        found[index] = name
    return found


def _contiguous(folder: str, found: dict[int, str], kind: str) -> list[str]:
    indexes = sorted(found)
    if indexes != list(range(len(indexes))):
        raise CorruptCheckpointError(
            f"{folder}: {kind} files {[found[i] for i in indexes]} skip an index; a file is "
            "missing. Restore it, or load another checkpoint."
        )
    return [found[i] for i in indexes]


def read_accelerate(
    storage: Storage, folder: str, ranks: Iterable[int] | None = None, *, warn: bool = True
) -> AccelerateCheckpoint:
    """Read and check every file of the Accelerate checkpoint ``folder``; change nothing.

    Args:
        storage: a confined view of ``folder``.
        folder: the checkpoint folder.
        ranks: the processes whose random states to read (``None``: all of them).
        warn: log that pickled sampler objects are not read (``False``: the caller says so).

    Raises:
        CorruptCheckpointError: naming the file (and the global or key) that is refused.
        CheckpointMismatchError: a sharded (FSDP) save, which is not read.
    """
    listing = storage.walk_files(folder)
    nested = sorted({n.split("/")[0] for n in listing if "/" in n})
    if nested:
        raise CheckpointMismatchError(
            f"{folder} holds the folder(s) {nested}: a sharded (FSDP) save by Hugging Face "
            "accelerate, which accelkit does not read. Save it again in accelerate with a full "
            "state dict (fsdp_state_dict_type FULL_STATE_DICT) to move it over."
        )
    names = sorted(listing)
    out = AccelerateCheckpoint(folder, files=names)
    rng_files = {int(m.group(1)): n for n in names if (m := _RNG_FILE.match(n))}
    out.world_size = len(_contiguous(folder, rng_files, "random_states_<rank>.pkl"))
    for name in _contiguous(folder, _indexed(names, "model"), "model"):
        url = join(folder, name)
        if name.endswith(".safetensors"):
            out.models.append(read_safetensors(storage, url)[0])
        else:
            out.models.append(_weights(load_pickle(storage, url), url))
    for kind, target in (
        ("optimizer", out.optimizers),
        ("scheduler", out.schedulers),
        ("custom", out.custom),
    ):
        for name in _contiguous(folder, _indexed(names, kind), kind):
            url = join(folder, name)
            value = load_pickle(storage, url)
            target.append(_state_dict(value, url, kind) if kind != "custom" else value)
    for index, name in _indexed(names, "dataloader").items():
        url = join(folder, name)
        out.dataloaders[index] = dataloader_from_accelerate(load_pickle(storage, url), url)
    samplers = sorted(_indexed(names, "sampler").values())
    if samplers and warn:
        logger.warning(
            "%s: %s hold(s) a pickled sampler object, which accelkit never unpickles; the "
            "dataloader's shuffling restarts from its seed.",
            folder,
            ", ".join(samplers),
        )
    if "scaler.pt" in names:
        url = join(folder, "scaler.pt")
        out.scaler = _state_dict(load_pickle(storage, url), url, "grad scaler")
    steps = set()
    wanted = range(out.world_size) if ranks is None else ranks
    for rank in wanted:
        if rank in rng_files:
            url = join(folder, rng_files[rank])
            out.rng[rank], step = rng_from_accelerate(load_pickle(storage, url), url)
            steps.add(step)
    out.step = max(steps) if steps else 0
    out.optimizer_steps = optimizer_steps(out.optimizers)
    return out


def optimizer_steps(states: Iterable[Any]) -> int | None:
    """The optimizer steps recorded in optimizer ``state_dict()``\\ s: the largest per-parameter
    ``step`` (Adam, AdamW, RMSprop... keep one; a tensor or a number), or ``None`` if no state
    has one. Accelerate's own ``step`` counts ``accumulate`` calls, not optimizer steps."""
    found: list[int] = []
    for state in states:
        per_param = state.get("state") if isinstance(state, dict) else None
        if not isinstance(per_param, dict):
            continue
        for entry in per_param.values():
            step = entry.get("step") if isinstance(entry, dict) else None
            if isinstance(step, torch.Tensor) and step.numel() == 1:
                step = step.item()
            if isinstance(step, bool) or not isinstance(step, (int, float)):
                continue
            if math.isfinite(step) and step >= 0:
                found.append(int(step))
    return max(found) if found else None


def read_optimizer_steps(storage: Storage, folder: str) -> int | None:
    """The optimizer steps of the Accelerate checkpoint ``folder``, read from its
    ``optimizer*.bin`` files alone (through
    :func:`~accelkit.checkpointing.interop.accelerate_pickle.load_pickle`: no code runs, memory
    stays within a small multiple of the file's size); ``None`` if no optimizer state records
    one.

    Raises:
        CorruptCheckpointError: an optimizer file refused by
            :func:`~accelkit.checkpointing.interop.accelerate_pickle.load_pickle`, naming it.
    """
    storage = confine(storage, folder)
    names = [n for n in storage.walk_files(folder) if "/" not in n]
    states = []
    for name in _indexed(names, "optimizer").values():
        url = join(folder, name)
        states.append(_state_dict(load_pickle(storage, url), url, "optimizer"))
    return optimizer_steps(states)


@dataclass(frozen=True)
class AccelerateCheck:
    """What :func:`check_accelerate` found in an Accelerate folder.

    Attributes:
        files: how many files the folder holds (all of them read).
        size_bytes: their total size.
        problems: ``"file: what is wrong"`` lines (a file that cannot be read, a size that
            differs from the listing, a refused pickle or value); empty when the folder is
            healthy.
        unparsed: files read to their end but not parsed: pickled sampler objects, which
            accelkit never unpickles (``load_state`` restarts the shuffling from its seed).
    """

    files: int
    size_bytes: int
    problems: list[str]
    unparsed: list[str]


_READ_CHUNK = 1 << 20


def check_accelerate(storage: Storage, folder: str) -> AccelerateCheck:
    """Check the Accelerate checkpoint ``folder`` as far as it can be without checksums (it
    records none): every file is read to its end and must have the size its listing gives,
    then the folder is read as ``load_state`` reads it (:func:`read_accelerate`), which names
    the first file it refuses. Nothing runs, nothing is written.

    Args:
        storage: the storage holding ``folder`` (confined to it here: no link is followed).
        folder: the checkpoint folder.

    Returns:
        The verdict; healthy when its ``problems`` are empty.
    """
    storage = confine(storage, folder)
    try:
        listing = storage.walk_files(folder)
    except (CorruptCheckpointError, OSError) as exc:  # a link inside, or unreadable
        return AccelerateCheck(0, 0, [f"{folder}: cannot be listed ({exc})"], [])
    problems = []
    for name, size in sorted(listing.items()):
        try:
            read = 0
            with storage.open_read(join(folder, name)) as f:
                while chunk := f.read(_READ_CHUNK):
                    read += len(chunk)
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(f"{name}: cannot be read ({type(exc).__name__}: {exc})")
            continue
        if read != size:
            problems.append(f"{name}: the listing gives {size} bytes but {read} were read")
    if not problems:
        try:
            read_accelerate(storage, folder, warn=False)
        except (CheckpointMismatchError, CorruptCheckpointError) as exc:
            problems.append(str(exc))
        except OSError as exc:  # the folder changed under us
            problems.append(f"{folder}: cannot be read ({type(exc).__name__}: {exc})")
    names = [n for n in listing if "/" not in n]
    return AccelerateCheck(
        files=len(listing),
        size_bytes=sum(listing.values()),
        problems=problems,
        unparsed=sorted(_indexed(names, "sampler").values()),
    )


def stand_in_manifest(folder: str, checkpoint: AccelerateCheckpoint) -> Manifest:
    """A manifest describing an Accelerate folder for ``load_state``'s caller (no files)."""
    return Manifest(
        iteration=parse_checkpoint_name(folder),
        step=checkpoint.steps,
        world_size=checkpoint.world_size,
        files=[],
        created=0.0,
        metadata={"format": "accelerate"},
        accelkit_version=__version__,
        torch_version=torch.__version__,
    )


def _retie(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the names Accelerate dropped from a safetensors file because they share memory with
    another saved name (tied weights): in the live model they are the same tensor."""
    live = model.state_dict(keep_vars=True)
    by_ptr: dict[tuple[int, int], str] = {}
    for name, tensor in live.items():
        if name in tensors and tensor.numel():
            by_ptr[(tensor.data_ptr(), tensor.numel())] = name
    out = dict(tensors)
    for name, tensor in live.items():
        if name not in out and tensor.numel():
            source = by_ptr.get((tensor.data_ptr(), tensor.numel()))
            if source is not None:
                out[name] = out[source]
    return out


def _check_count(folder: str, kind: str, saved: int, wanted: int, fix: str) -> None:
    if saved != wanted:
        raise CheckpointMismatchError(
            f"{folder} holds {saved} {kind} state(s) (written by Hugging Face accelerate) but "
            f"{wanted} {kind}(s) are to be restored. {fix}"
        )


def _check_groups(optimizer: Any, state: Any, source: str) -> None:
    try:
        saved = [len(g["params"]) for g in state["param_groups"]]
        current = [len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
    except (TypeError, KeyError):
        raise CorruptCheckpointError(
            f"{source}: not an optimizer state_dict (no param_groups with params); the file is "
            "damaged."
        ) from None
    if saved != current:
        raise CheckpointMismatchError(
            f"{source}: the optimizer was saved with parameter groups of sizes {saved} but the "
            f"current one has {current}. Build the optimizer over the same parameters."
        )


def _plan(checkpoint: AccelerateCheckpoint, objects: TrainingObjects, rank: int) -> LoadedContents:
    folder = checkpoint.folder
    out = LoadedContents()
    names = checkpoint.files
    _check_count(
        folder, "model", len(checkpoint.models), len(objects.models), "Prepare the same models."
    )
    for i, (model, tensors) in enumerate(zip(objects.models, checkpoint.models)):
        target = unwrap_model(model)
        tensors = _retie(target, tensors)
        name = next(n for n in names if _INDEXED["model"].match(n) and _index(n) == i)
        strict = bool(objects.model_load_kwargs.get("strict", True))
        check_model_keys(target, tensors, join(folder, name), strict=strict)
        out.models.append((target, tensors))
    pairs: list[tuple[str, Sequence[Any], list[Any], str]] = [
        ("optimizer", objects.optimizers, checkpoint.optimizers, "Prepare the same optimizers."),
        ("scheduler", objects.schedulers, checkpoint.schedulers, "Prepare the same schedulers."),
        (
            "registered object",
            objects.custom,
            checkpoint.custom,
            "Call register_for_checkpointing with the same objects, in the same order.",
        ),
    ]
    for kind, live, saved, fix in pairs:
        _check_count(folder, kind, len(saved), len(live), fix)
        for i, (obj, state) in enumerate(zip(live, saved)):
            source = join(folder, _file_name(kind, i))
            if kind == "optimizer":
                _check_groups(obj, state, source)
            out.states.append((obj, state, source))
    loaders = [
        (i, dl) for i, dl in enumerate(objects.dataloaders) if hasattr(dl, "load_state_dict")
    ]
    for i, loader in loaders:
        if i in checkpoint.dataloaders:
            source = join(folder, "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin")
            out.states.append((loader, checkpoint.dataloaders[i], source))
    if objects.scaler is not None and checkpoint.scaler is not None:
        out.states.append((objects.scaler, checkpoint.scaler, join(folder, "scaler.pt")))
    elif objects.scaler is not None or checkpoint.scaler is not None:
        logger.warning(
            "%s: the grad scaler state is %s; the scaler keeps its initial scale.",
            folder,
            "missing" if checkpoint.scaler is None else "not restored (this run has no scaler)",
        )
    if rank in checkpoint.rng:
        out.rng = checkpoint.rng[rank]
        out.rng_file = join(folder, f"random_states_{rank}.pkl")
    elif rank >= checkpoint.world_size:
        out.rng_fallback_seed = fallback_rng_seed(stand_in_manifest(folder, checkpoint), rank)
    return out


def _index(name: str) -> int:
    match = re.search(r"_(\d+)\.", name)
    return int(match.group(1)) if match else 0


def _file_name(kind: str, index: int) -> str:
    if kind == "registered object":
        return f"custom_checkpoint_{index}.pkl"
    return f"{kind}.bin" if index == 0 else f"{kind}_{index}.bin"


class AccelerateReader:
    """Reads one folder written by Hugging Face accelerate's ``save_state`` for one load: the
    :class:`~accelkit.checkpointing.restore.sequence.FolderReader` that the checkpoint manager
    plugs into :class:`~accelkit.checkpointing.restore.sequence.LoadSequence` for folders in
    state ``accelerate``.

    Every file is read and checked in the read phase (on every process); the sequence changes
    the live objects only when all of it is good on all processes. The main process says in
    one log line that it read an Accelerate checkpoint.

    Args:
        source: the checked folder (a confined view of it).
    """

    def __init__(self, source: LoadSource) -> None:
        self.source = source
        self._checkpoint = AccelerateCheckpoint(source.path)
        self._objects = TrainingObjects()
        self._loaded = LoadedContents()

    def check(self, objects: TrainingObjects) -> None:
        """Nothing to refuse before the files are read: the counts and keys are checked with
        them."""

    def read(self, objects: TrainingObjects) -> None:
        """Read every file (this process's random states only) and plan the restore of
        ``objects``; change nothing.

        Raises:
            CorruptCheckpointError: a file refused (naming it, and the global it wanted).
            CheckpointMismatchError: counts of objects, a model's keys or an optimizer's groups
                that do not match.
        """
        source = self.source
        self._checkpoint = read_accelerate(source.storage, source.path, ranks=[source.rank])
        self._loaded = _plan(self._checkpoint, objects, source.rank)
        self._objects = objects

    @property
    def fingerprint(self) -> Fingerprint | None:
        """Always ``None``: accelerate's folders record no resume fingerprint (nothing is
        compared at the first step after the load)."""
        return None

    def apply(self) -> Manifest:
        """Restore the live objects from what :meth:`read` planned.

        Returns:
            A stand-in manifest: ``iteration`` from a ``checkpoint_<n>`` name, Accelerate's
            ``step``, ``world_size`` = the number of ``random_states_<rank>.pkl`` files.
        """
        source, checkpoint = self.source, self._checkpoint
        apply_contents(self._loaded, self._objects)
        if source.is_main:
            # WARNING, so that it shows without any logging set up (Python prints warnings of
            # an unconfigured logger to stderr): a run resumed from another tool's files
            # should say so where the user looks.
            logger.warning(
                "Loaded %s, a checkpoint written by Hugging Face accelerate (%d process(es), "
                "optimizer step %d); its pickles were read with an allow-list. `accelkit ckpt "
                "import` converts it to an accelkit checkpoint.",
                source.path,
                checkpoint.world_size,
                checkpoint.steps,
            )
            if checkpoint.world_size != source.world_size:
                logger.warning(
                    "%s was saved by %d process(es) and this run has %d: processes without "
                    "saved random states are seeded deterministically. Resume with "
                    "--num_processes %d for an exact continuation.",
                    source.path,
                    checkpoint.world_size,
                    source.world_size,
                    checkpoint.world_size,
                )
        return stand_in_manifest(source.path, checkpoint)
