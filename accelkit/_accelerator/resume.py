"""The resume check of the :class:`~accelkit.Accelerator`: exact means checked.

Each ``save_state`` records, per process, a resume fingerprint
(:mod:`accelkit.checkpointing.objects.fingerprint`): what the next steps will consume and the
run's shape. After ``load_state`` the same record is made at the first step boundary (a prepared
dataloader asked for its first batch, or a prepared optimizer's step: before anything of the
resumed run is consumed) and compared with the checkpoint's. A difference is warned about once,
naming it, on the main process (:class:`~accelkit.checkpointing.errors.ResumeMismatchWarning`);
with ``Accelerator(strict_resume=True)`` every process raises
:class:`~accelkit.checkpointing.errors.ResumeMismatchError` there instead.

The record's components:

=================================  ==================================================
component                          holds
=================================  ==================================================
``world size``                     the number of processes
``gradient accumulation steps``    micro-steps per optimizer step
``dataloader <i> batch size``      samples per batch on this process
``dataloader <i> sampler``         the sampler's class, sample count and seed
``dataloader <i> workers``         its ``num_workers``, when its reads draw random
                                   numbers (mid-epoch: the state holds
                                   ``read_ahead_rng`` or ``worker_rng``); a resume
                                   with another count draws other augmentations
``dataloader <i> data order``      a digest of the sample indices of the next
                                   :data:`LOOKAHEAD` batches
                                   (:func:`accelkit.data.lookahead.upcoming_batches`;
                                   of the position and its shuffling randomness
                                   where indices are not known ahead: iterable
                                   datasets, dispatched batches, passes longer than
                                   ``lookahead.MAX_SAMPLES``)
``RNG stream <name>``              a digest of the Python, NumPy, torch (and CUDA)
                                   generator states
=================================  ==================================================

Across a change of world size, the data order and the random streams of one process are not
comparable (another process count shares the data and seeds the streams differently): only the
other components are compared then. The check is paid once per save and once per resume: its
hook leaves the step boundaries after the first one.

Public API: :class:`ResumeCheck`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelkit.checkpointing.errors import ResumeMismatchError, ResumeMismatchWarning
from accelkit.checkpointing.objects.fingerprint import (
    Difference,
    Fingerprint,
    differences,
    digest,
    rng_components,
)
from accelkit.data.lookahead import per_process_batch_size, sampler_summary, upcoming_batches
from accelkit.data.prepared import is_prepared
from accelkit.data.random_streams import READ_AHEAD_KEY, WORKERS_KEY
from accelkit.errors import WrongTypeError, warn_at_user_line
from accelkit.runtime import ops

if TYPE_CHECKING:
    from accelkit._accelerator.prepared_objects import PreparedObjects
    from accelkit.runtime.state import AcceleratorState
    from accelkit.training.boundary import BoundaryHook
    from accelkit.training.optim import GradientState

__all__ = ["LOOKAHEAD", "ResumeCheck"]

logger = logging.getLogger(__name__)

LOOKAHEAD = 4
"""How many upcoming batches of each dataloader the fingerprint's data order covers."""

WORLD_SIZE = "world size"
ACCUMULATION = "gradient accumulation steps"
_PER_PROCESS = (" data order", "RNG stream ")

# What to do about a difference, by the end (or start) of the component's name.
_FIXES = (
    (WORLD_SIZE, "launch as many processes as the saved run ({saved})"),
    (ACCUMULATION, "pass the saved run's gradient_accumulation_steps ({saved})"),
    (" batch size", "prepare each dataloader with the batch size it was saved with"),
    (" sampler", "prepare the same dataset with the same sampler, shuffle and seed settings"),
    (" data order", "prepare the same dataset with the same sampler, shuffle and seed settings"),
    (
        " workers",
        "prepare each dataloader with the num_workers it was saved with ({saved}): which "
        "process reads a batch decides the random numbers its augmentations draw",
    ),
    (
        "RNG stream ",
        "keep every random_states_<rank> file and draw no random numbers between load_state() "
        "and the first batch",
    ),
)


class ResumeCheck:
    """Records the resume fingerprint at each save; compares it at the first step after each
    load (see the module docstring).

    Args:
        state: this process (rank, world size, main process).
        gradient_state: the accumulation state; its step boundaries host the check.
        prepared: the prepared objects; their dataloaders are looked ahead.
        strict: raise :class:`~accelkit.checkpointing.errors.ResumeMismatchError` instead of
            warning (``Accelerator(strict_resume=True)``).
    """

    def __init__(
        self,
        state: AcceleratorState,
        gradient_state: GradientState,
        prepared: PreparedObjects,
        *,
        strict: bool = False,
    ) -> None:
        if not isinstance(strict, bool):
            raise WrongTypeError(
                f"strict_resume={strict!r} ({type(strict).__name__}): expected True or False. "
                "Pass strict_resume=True to stop a resumed run that would differ from the saved "
                "one, or leave it out to be warned."
            )
        self.state = state
        self.gradient_state = gradient_state
        self.prepared = prepared
        self.strict = strict
        self._expected: Fingerprint | None = None
        self._path = ""
        self._remove: Callable[[], None] | None = None

    def record(self) -> Fingerprint:
        """This process's fingerprint now: what its next steps consume, and the run's shape."""
        world = self.state.num_processes
        record: Fingerprint = {
            WORLD_SIZE: str(world),
            ACCUMULATION: str(self.gradient_state.num_steps),
        }
        # Numbered as the checkpoint numbers their positions (dataloader_<i>).
        for i, loader in enumerate(self.prepared.dataloaders):
            if not is_prepared(loader):
                continue
            size = per_process_batch_size(loader, world)
            record[f"dataloader {i} batch size"] = "unknown" if size is None else str(size)
            record[f"dataloader {i} sampler"] = sampler_summary(loader)
            state = loader.state_dict()
            if READ_AHEAD_KEY in state or WORKERS_KEY in state:  # its reads draw random numbers
                record[f"dataloader {i} workers"] = str(getattr(loader, "num_workers", 0))
            batches = upcoming_batches(loader, LOOKAHEAD)
            if batches is None:  # the position, and the randomness its pass draws from
                keys = ("epoch", "batches_yielded", "seed", "randomness")
                batches = [["position", *(state.get(key) for key in keys)]]
            record[f"dataloader {i} data order"] = digest(batches)
        record.update(rng_components())
        return record

    def expect(self, path: str, saved: Fingerprint | None) -> None:
        """After ``load_state(path)``: compare ``saved`` (this process's record in the
        checkpoint; ``None`` for none) at the next step boundary. Call it on every process: the
        comparison is agreed by all of them."""
        self._disarm()
        self._expected = saved
        self._path = path
        self._remove = self.gradient_state.on_boundary.register(_ArmedHook(self))

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a pickled accelerator) is not armed: the remover is a closure, and the one
        # comparison of a resume is the original's.
        return {**self.__dict__, "_remove": None, "_expected": None}

    def _disarm(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()

    def _at_boundary(self, where: str, source: object) -> None:
        if self._remove is None:  # a copy's hook, or one already removed
            return
        self._disarm()
        saved, self._expected = self._expected, None
        found = None if saved is None else self._differences(saved)
        rank = self.state.process_index
        reports: list[Any] = (
            ops.gather_object([(rank, found)]) if self.state.num_processes > 1 else [(0, found)]
        )
        if all(found is None for _, found in reports):
            return  # a checkpoint saved without fingerprints: nothing to compare
        message = _message(self._path, reports, self.state.num_processes, self.strict)
        if message is None:
            return
        if self.strict:
            raise ResumeMismatchError(message)
        if _only_world_size(reports):
            # The load said it already, once, with the same fix (restore/native.py): one
            # warning for one cause.
            logger.info("Resume on another number of processes: %s", message)
        elif self.state.is_main_process:
            warn_at_user_line(message, ResumeMismatchWarning)
        else:
            logger.debug("Resume mismatch, warned about on the main process: %s", message)

    def _differences(self, saved: Fingerprint) -> list[Difference]:
        now = self.record()
        if saved.get(WORLD_SIZE) != now.get(WORLD_SIZE):
            # Another process count: this process's share and streams are not comparable.
            def shared(name: str) -> bool:
                return not (name.endswith(_PER_PROCESS[0]) or name.startswith(_PER_PROCESS[1]))

            saved = {k: v for k, v in saved.items() if shared(k)}
            now = {k: v for k, v in now.items() if shared(k)}
        return differences(saved, now)


class _ArmedHook:
    """The boundary hook of an armed :class:`ResumeCheck`. A pickled copy (a prepared loader
    carries its accelerator's boundary hooks) is a hook that does nothing: the check belongs to
    the run that loaded the checkpoint, and pickling it from the hook would pickle the loader
    inside its own reconstruction."""

    __slots__ = ("check",)

    def __init__(self, check: ResumeCheck) -> None:
        self.check = check

    def __call__(self, where: str, source: object) -> None:
        self.check._at_boundary(where, source)

    def __reduce__(self) -> tuple[Callable[[], BoundaryHook], tuple[()]]:
        return _inert_hook, ()


def _ignore(where: str, source: object) -> None:
    """A boundary hook that does nothing (what a pickled :class:`_ArmedHook` becomes)."""


def _inert_hook() -> BoundaryHook:
    return _ignore


def _only_world_size(reports: list[Any]) -> bool:
    """Whether the world size is all that differs, on every process."""
    return all(d.component == WORLD_SIZE for _, found in reports for d in found or ())


def _message(path: str, reports: list[Any], world: int, strict: bool) -> str | None:
    """The warning's (or error's) text from every process's differences; None if none."""
    where: dict[str, list[int]] = {}
    first: dict[str, Difference] = {}
    for rank, found in reports:
        for difference in found or ():
            text = difference.describe()
            where.setdefault(text, []).append(rank)
            first.setdefault(text, difference)
    if not where:
        return None
    items = []
    for text, ranks in where.items():
        if len(ranks) < world:
            text += f" (process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        items.append(text)
    fixes: list[str] = []
    for difference in first.values():
        name = difference.component
        for key, fix in _FIXES:
            if name == key or name.endswith(key) or (key.endswith(" ") and name.startswith(key)):
                text = fix.format(saved=difference.saved)
                if text not in fixes:
                    fixes.append(text)
                break
    if all(d.component == WORLD_SIZE for d in first.values()):
        why = (
            "The dataloaders continue the epoch at its global position, but each process's "
            "random streams (dropout) are not the saved run's, so it would differ from an "
            "uninterrupted run."
        )
    else:
        why = (
            "Its first steps would consume other data or random numbers than the saved run's "
            "next steps, so it would differ silently from an uninterrupted run."
        )
    message = (
        f"The run resumed from {path} does not continue the saved run: "
        + "; ".join(items)
        + f". {why} To resume exactly, "
        + "; ".join(fixes)
        + "."
    )
    if not strict:
        message += " Accelerator(strict_resume=True) stops the run here instead."
    return message
