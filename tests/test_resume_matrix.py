"""The resume matrix (issue #40, item 3): every known way a resume can diverge, as a real run.

A run trains a small model (dropout, Adam) on a shuffled loader for 2 epochs, uninterrupted; an
interrupted run saves mid-epoch (after 2 steps of epoch 1) or at the epoch boundary (after
epoch 0's loop) and stops; a fresh run resumes (``load_state``, then the loader, or
``skip_first_batches`` with the saving run's count) and trains to the end. Every run is a real
gloo job on 127.0.0.1 (``run_distributed``); one module-scoped fixture runs all cells in four
jobs (on 1, 2, 1 and 3 processes), so each cell costs one resume, not a job.

Outcomes. On the same number of processes the final weights are bitwise the uninterrupted
run's (``torch.equal``, every process) and the global sample order is the same, with no resume
warning. On another number of processes weights cannot be bitwise (other global batches,
other per-process random streams, docs/guides/checkpoints.md): the global sample order of the
interrupted epoch is exactly the uninterrupted run's, the load warns once naming
``--num_processes``, and ``strict_resume=True`` raises ``ResumeMismatchError`` naming the world
size. A lost or damaged random-states file is a ``CorruptCheckpointError`` naming it.

Cells: counts; loader workers; loader; save point; style or case -> the test. "resave": a save
right after the load, before any batch, then training on, and a third run from that checkpoint
(Accelerate #4244); "rng": Accelerate #4283. P = test_resume_process_count.py, I =
test_resume_idiom.py, C = test_resume_check.py; "here" = this module.

* 1->1, 2->2; 0; plain, stateful; mid, boundary; load, skip -> covered before:
  I::test_every_resume_style_matches_an_uninterrupted_run_on_one_process, ::..._two_processes
  (ids and random draws exact, weights approximately).
* 1->1, 2->2; 0; plain, stateful; mid, boundary; load + resave -> here:
  test_a_resume_on_the_same_count_is_bitwise (before: state dicts only,
  P::test_a_save_right_after_a_load_keeps_the_saved_position).
* 1->1; 2; plain, stateful; mid; load -> here (before: the loader's order only,
  test_data.py::test_stateful_dataloader_resumes_mid_epoch[2]).
* 2->2; 2; plain, stateful; mid, boundary; load -> here.
* 2->2; 2; plain, stateful; mid; skip, load + resave -> here.
* 1->1; 2; boundary, skip, resave -> not run (the same code as the 2->2 cells, on one process).
* 2->1, 1->2, 2->3; 0; plain; mid; load -> P::test_saved_on_two_mid_epoch_resumes_on_one_and_three,
  P::test_saved_on_one_mid_epoch_resumes_on_two.
* 2->1, 2->3; 0; plain; boundary; load ->
  P::test_saved_at_an_epoch_boundary_resumes_with_the_next_epoch.
* 1->2; 0; plain; boundary; load -> here:
  test_a_resume_on_another_count_continues_the_data_and_names_the_rest.
* 2->3; 0; plain; mid; skip -> P::test_skip_first_batches_with_the_saved_count_on_another_count.
* 2->1, 1->2; 0; plain; mid; skip -> here.
* 2->1, 1->2, 2->3; 0; plain, stateful; mid, boundary; load + resave -> here.
* 2->3; 0; stateful; mid; load -> P::test_a_stateful_loader_resumes_on_another_count.
* 2->1, 1->2; 0; stateful; mid; load -> here.
* 2->1, 1->2, 2->3; 0; stateful; mid; skip, and boundary; load -> here.
* 2->1; 2; plain; mid; load -> P::test_two_loader_workers_resume_on_another_count.
* 1->2, 2->3; 2; plain; mid; load -> here.
* 2->1, 1->2, 2->3; 2; stateful; mid; load -> here.
* another count, the load's warning naming --num_processes -> here, every cell above; also
  P::test_an_older_checkpoint_on_another_count_warns_naming_the_fix (2->1).
* strict_resume=True on another count: 2->1 -> C::test_another_world_size_is_named; 1->2,
  2->3 -> here: test_strict_resume_on_another_count_is_a_named_error.
* rng lost, 1->1 -> C::test_a_removed_random_states_file_is_a_named_error; rng damaged, 1->1
  -> reliability/test_redteam.py (manifest re-signed), checkpointing/test_manager.py (not).
* rng lost or damaged (random_states_1), 2->2, 2->1, 2->3 -> here:
  test_a_lost_or_damaged_random_states_file_is_a_named_error (2->1 damaged: loads; one process
  never reads that file, so nothing of it reaches the run).
* 1->1; 0 plain, 2 plain and stateful; mid; load, a Dataset drawing random numbers per
  sample -> here: test_an_augmentation_drawn_per_sample_resumes_bitwise_mid_epoch (the read-
  ahead batch read again from its generator states; the workers' streams carried over; more
  cases in tests/test_data_streams.py).
"""

from __future__ import annotations

import itertools
import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.distributed import run_distributed

pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")

# 20 samples in batches of 2: after MID steps on 2 processes (8 samples) or on 1 (4), the rest
# of the epoch fills whole rounds on 1, 2 and 3 processes (no even_batches padding).
N, BATCH, EPOCHS, MID = 20, 2, 2, 2  # MID: steps of epoch 1 done when saving mid-epoch
WORKERS = (0, 2)
LOADERS = ("plain", "stateful")
POINTS = ("mid", "boundary")
# style: "load" (iterate the loader after load_state) or "skip" (skip_first_batches(loader,
# MID) for the resumed epoch). resave "resave" (#4244): save right after the load, before any
# batch, and train on; a third run resumes from that second checkpoint.

SETUPS = list(itertools.product(WORKERS, LOADERS))
COUNT_PAIRS = ((2, 1), (1, 2), (2, 3))


# Cells the real runs of tests/test_resume_process_count.py cover already (global order).
COVERED = {
    (saved_on, world, 0, "plain", "mid", "load", "no") for saved_on, world in COUNT_PAIRS
} | {
    (2, 1, 0, "plain", "boundary", "load", "no"),
    (2, 3, 0, "plain", "boundary", "load", "no"),
    (2, 3, 0, "plain", "mid", "skip", "no"),
    (2, 1, 2, "plain", "mid", "load", "no"),
    (2, 3, 0, "stateful", "mid", "load", "no"),
}


def _cells(saved_on: int, world: int) -> list[tuple[Any, ...]]:
    """The cells (workers, loader, point, style, resave) run from ``saved_on`` to ``world``
    processes: those no other test covers (the module docstring's table)."""
    cells: list[tuple[Any, ...]] = []
    for loader in LOADERS:
        cells += [(0, loader, point, "load", "resave") for point in POINTS]
        if saved_on == world == 1:
            cells += [(2, loader, "mid", "load", "no")]
        elif saved_on == world:
            cells += [(2, loader, point, "load", "no") for point in POINTS]
            cells += [(2, loader, "mid", "skip", "no"), (2, loader, "mid", "load", "resave")]
        else:
            cells += [(0, loader, "mid", "skip", "no"), (0, loader, "boundary", "load", "no")]
            cells += [(0, loader, "mid", "load", "no"), (2, loader, "mid", "load", "no")]
    return [cell for cell in cells if (saved_on, world, *cell) not in COVERED]


SAME_CELLS = [((w, w), cell) for w in (1, 2) for cell in _cells(w, w)]
CROSS_CELLS = [(pair, cell) for pair in COUNT_PAIRS for cell in _cells(*pair)]
_NATIVE = "accelkit.checkpointing.restore.native"


# ------------------------------------------------------------------ one training run


def _inputs() -> torch.Tensor:
    return torch.randn(N, 4, generator=torch.Generator().manual_seed(7))


class _Augmented(torch.utils.data.Dataset[tuple[int, torch.Tensor]]):
    """Sample ``i`` and, with ``augment``, a random augmentation drawn where the sample is read
    (the training process, or a loader worker), as a transform would; else zeros."""

    def __init__(self, augment: bool) -> None:
        self.augment = augment

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.randn(4) * 0.1 if self.augment else torch.zeros(4)

    def __len__(self) -> int:
        return N


_AUGMENT = False  # a random augmentation per sample (test_an_augmentation_...)


def _setup(workers: int, loader: str, strict: bool = False) -> tuple[Any, ...]:
    from accelkit import Accelerator, DataLoaderConfiguration, set_seed

    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=loader == "stateful")
    acc = Accelerator(cpu=True, dataloader_config=config, strict_resume=strict)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    # Workers forked, as under torchrun on Linux (a run_distributed process inherits its
    # forkserver start method, whose first worker would start a fresh interpreter: ~15 s).
    context = "fork" if workers else None
    data = DataLoader(
        _Augmented(_AUGMENT),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context=context,
    )
    return (acc, *acc.prepare(model, optimizer, data))


def _pass(acc: Any, model: Any, optimizer: Any, loader: Any, stop: int | None = None) -> list[int]:
    """Train on ``loader`` (``stop`` steps, or a whole pass); the global order of its samples."""
    inputs = _inputs()
    seen: list[int] = []
    for step, (ids, noise) in enumerate(loader):
        loss = model(inputs[ids] + noise).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen += acc.gather(ids).tolist()
        if stop is not None and step + 1 == stop:
            break
    return seen


def _params(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in getattr(model, "module", model).parameters()]


def _full(workers: int, loader: str) -> dict[str, Any]:
    acc, model, optimizer, data = _setup(workers, loader)
    epochs = [_pass(acc, model, optimizer, data) for _ in range(EPOCHS)]
    return {"epochs": epochs, "params": _params(model)}


def _interrupt(folder: str, workers: int, loader: str, point: str) -> list[list[int]]:
    """Train up to the save point, save, stop; the global order seen per epoch."""
    acc, model, optimizer, data = _setup(workers, loader)
    epochs = [_pass(acc, model, optimizer, data)]
    if point == "mid":
        epochs.append(_pass(acc, model, optimizer, data, stop=MID))
    acc.save_state(folder)
    return epochs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def _continue(
    folder: str, workers: int, loader: str, point: str, style: str, skip: int, resave: str
) -> dict[str, Any]:
    """A fresh run resumes from ``folder`` and trains to the end. ``skip``: the batches the
    script believes were done in the resumed epoch (the saving run's count). With ``resave``,
    the run saves right after the load and trains on, and a third run resumes from that
    second checkpoint (its result under ``again``)."""
    handler = _Records()
    logging.getLogger(_NATIVE).addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _train_on(folder, workers, loader, point, style, skip, resave == "resave")
            if resave == "resave":
                out["again"] = _train_on(folder + "-again", workers, loader, point, style, skip)
    finally:
        logging.getLogger(_NATIVE).removeHandler(handler)
    from accelkit.checkpointing.errors import ResumeMismatchWarning

    out["mismatch"] = [str(w.message) for w in caught if w.category is ResumeMismatchWarning]
    out["logged"] = handler.texts
    return out


def _train_on(
    folder: str, workers: int, loader: str, point: str, style: str, skip: int, resave: bool = False
) -> dict[str, Any]:
    acc, model, optimizer, data = _setup(workers, loader)
    acc.load_state(folder)
    if resave:
        acc.save_state(folder + "-again")
    epochs = []
    start = 1  # mid: epoch 1 goes on; boundary: epoch 0 was done, epoch 1 is next
    for epoch in range(start, EPOCHS):
        active = data
        if style == "skip" and epoch == start:
            active = acc.skip_first_batches(data, skip if point == "mid" else 0)
        epochs.append(_pass(acc, model, optimizer, active))
    acc.end_training()
    return {"epochs": epochs, "params": _params(model)}


def _strict(folder: str) -> str:
    """Resume ``folder`` with ``strict_resume=True``: the error's text, or "ran"."""
    from accelkit.checkpointing.errors import ResumeMismatchError

    acc, model, optimizer, data = _setup(0, "plain", strict=True)
    acc.load_state(folder)
    try:
        _pass(acc, model, optimizer, data, stop=1)
    except ResumeMismatchError as exc:
        return f"ResumeMismatchError: {exc}"
    return "ran"


def _load_error(folder: str) -> str:
    """Load ``folder``: the named error it raises, or "loaded"."""
    from accelkit.checkpointing.errors import CheckpointError

    acc, *_ = _setup(0, "plain")
    try:
        acc.load_state(folder)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def _damaged_copies(folder: str) -> None:
    """Next to ``folder``: a copy without process 1's random states (``-lost``), and one with a
    byte of them changed (``-damaged``; the manifest not re-signed)."""
    for kind in ("lost", "damaged"):
        copy = Path(f"{folder}-{kind}")
        shutil.copytree(folder, copy)
        rng = copy / "random_states_1.json"
        if kind == "lost":
            rng.unlink()
        else:
            data = bytearray(rng.read_bytes())
            data[len(data) // 2] ^= 1
            rng.write_bytes(bytes(data))


# ------------------------------------------------------------------ the jobs


def _ckpt(root: str, world: int, workers: int, loader: str, point: str) -> str:
    return f"{root}/saved-on-{world}/{workers}-{loader}-{point}"


def _job(root: str, world: int, fresh: bool, resume_from: list[int]) -> dict[str, Any]:
    """One process of a job on ``world`` processes: with ``fresh``, the uninterrupted runs, the
    interrupted ones (saved under ``root``) and their resumes on this count; then the resumes of
    the checkpoints saved on each count of ``resume_from``."""
    out: dict[str, Any] = {}
    if fresh:
        for workers, loader in SETUPS:
            out[f"full/{workers}/{loader}"] = _full(workers, loader)
            for point in POINTS:
                folder = _ckpt(root, world, workers, loader, point)
                out[f"saved/{workers}/{loader}/{point}"] = _interrupt(
                    folder, workers, loader, point
                )
        if world == 2:
            import torch.distributed as dist

            if dist.get_rank() == 0:
                _damaged_copies(_ckpt(root, 2, 0, "plain", "mid"))
            dist.barrier()
    for saved_on in (world, *resume_from) if fresh else resume_from:
        for workers, loader, point, style, resave in _cells(saved_on, world):
            folder = _ckpt(root, saved_on, workers, loader, point)
            key = f"{saved_on}->{world}/{workers}/{loader}/{point}/{style}/{resave}"
            out[key] = _continue(folder, workers, loader, point, style, MID, resave)
            shutil.rmtree(folder + "-again", ignore_errors=True)
        mid = _ckpt(root, saved_on, 0, "plain", "mid")
        if saved_on != world:
            out[f"strict/{saved_on}->{world}"] = _strict(mid)
        if saved_on == 2:
            for kind in ("lost", "damaged"):
                out[f"rng-{kind}/2->{world}"] = _load_error(f"{mid}-{kind}")
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every cell's result, from four jobs: on 1 process (1 -> 1), on 2 (2 -> 2, 1 -> 2), on 1
    again (2 -> 1) and on 3 (2 -> 3). Keys ``<saved>-><resumed>/...``; per rank results of
    resumed runs under ``ranks``."""
    root = str(tmp_path_factory.mktemp("matrix"))
    results: dict[str, Any] = {}
    for world, fresh, resume_from in (
        (1, True, []),
        (2, True, [1]),
        (1, False, [2]),
        (3, False, [2]),
    ):
        per_rank = run_distributed(
            _job, root, world, fresh, resume_from, world_size=world, timeout=600
        )
        for key, value in per_rank[0].items():
            if key.startswith(("full/", "saved/")):
                key = f"{key}@{world}"
            results[key] = value
            if isinstance(value, dict) and "params" in value:
                value["ranks"] = [rank[key.split("@")[0]] for rank in per_rank]
            elif key.startswith(("strict/", "rng-")):
                value = [rank[key] for rank in per_rank]  # what each process raised
                results[key] = value
    results["root"] = root
    return results


# ------------------------------------------------------------------ the checks

# The shared fixture's four jobs are the cost (about 70 s on a 2-core machine); every test
# that uses it is in the slow tier, so that the fast tier does not start them.
SLOW = pytest.mark.slow


def _case_id(case: Any) -> str:
    if len(case) == 2:  # (saved_on, resumed_on)
        return f"{case[0]}to{case[1]}"
    return "-".join(str(part) for part in case)


def _runs(resumed: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The resumed run, and with a resave the third run that resumed from its checkpoint."""
    return [("resumed", resumed)] + (
        [("resumed again", resumed["again"])] if "again" in resumed else []
    )


def _check_data(
    matrix: dict[str, Any], counts: tuple[int, int], epochs: list[list[int]], cell: Any
) -> None:
    """The resumed run's global sample order continues the uninterrupted run's on the saving
    count: each sample of the interrupted epoch once, in the same order."""
    saved_on, world = counts
    workers, loader, point = cell[:3]
    full = matrix[f"full/{workers}/{loader}@{saved_on}"]["epochs"]
    saved = matrix[f"saved/{workers}/{loader}/{point}@{saved_on}"]
    assert saved[0] == full[0] and len(epochs) == 1
    order = saved[1] + epochs[0] if point == "mid" else epochs[0]
    if point == "boundary" and N % (world * BATCH):  # even_batches: the last round completed
        order, padding = order[:N], order[N:]
        assert padding == order[: len(padding)]
    assert sorted(order) == list(range(N)), "a sample was lost or repeated"
    if point == "mid" or saved_on >= world:
        assert order == full[1], "the epoch is not in the uninterrupted run's order"
    # Saved on 1 and resumed on more at a boundary, the next epoch follows the shared
    # generator: every sample once, in another order (docs/guides/checkpoints.md).


@SLOW
@pytest.mark.parametrize(("counts", "cell"), SAME_CELLS, ids=_case_id)
def test_a_resume_on_the_same_count_is_bitwise(
    matrix: dict[str, Any], counts: tuple[int, int], cell: tuple[Any, ...]
) -> None:
    world = counts[0]
    workers, loader = cell[:2]
    full = matrix[f"full/{workers}/{loader}@{world}"]["params"]
    resumed = matrix[f"{world}->{world}/" + "/".join(map(str, cell))]
    assert resumed["mismatch"] == [] and resumed["logged"] == []
    for rank, result in enumerate(resumed["ranks"]):
        for name, run in _runs(result):
            _check_data(matrix, (world, world), run["epochs"], cell)
            assert all(map(torch.equal, run["params"], full)), f"{name}, rank {rank}: weights"


@SLOW
@pytest.mark.parametrize(("counts", "cell"), CROSS_CELLS, ids=_case_id)
def test_a_resume_on_another_count_continues_the_data_and_names_the_rest(
    matrix: dict[str, Any], counts: tuple[int, int], cell: tuple[Any, ...]
) -> None:
    saved_on, world = counts
    resumed = matrix[f"{saved_on}->{world}/" + "/".join(map(str, cell))]
    for result in resumed["ranks"]:
        for _, run in _runs(result):
            _check_data(matrix, counts, run["epochs"], cell)
    # The weights cannot be bitwise (other global batches, other random streams): the load
    # says so, once, naming the fix; the resumed-again run is on its own saving count.
    named = [t for t in resumed["logged"] if f"Resume with --num_processes {saved_on}" in t]
    assert len(named) == 1, resumed["logged"]
    assert resumed["mismatch"] == []


@SLOW
@pytest.mark.parametrize("counts", [(1, 2), (2, 3)], ids=_case_id)  # 2 -> 1: test_resume_check
def test_strict_resume_on_another_count_is_a_named_error(
    matrix: dict[str, Any], counts: tuple[int, int]
) -> None:
    saved_on, world = counts
    texts = matrix[f"strict/{saved_on}->{world}"]
    assert len(texts) == world and len(set(texts)) == 1  # every process, the same error
    assert texts[0].startswith("ResumeMismatchError:"), texts[0]
    assert f"world size {saved_on} -> {world}" in texts[0]


@SLOW
@pytest.mark.parametrize("kind", ["lost", "damaged"])
@pytest.mark.parametrize("world", [2, 1, 3])
def test_a_lost_or_damaged_random_states_file_is_a_named_error(
    matrix: dict[str, Any], kind: str, world: int
) -> None:
    texts = matrix[f"rng-{kind}/2->{world}"]
    assert len(texts) == world
    if (kind, world) == ("damaged", 1):
        # One process reads only random_states_0: process 1's file is never read, so nothing
        # of it can reach the run (its loss is still refused: the manifest lists it).
        assert texts == ["loaded"]
        return
    for text in texts:
        assert text.startswith("CorruptCheckpointError:"), text
        assert "random_states_1" in text


@pytest.mark.parametrize(("workers", "loader"), [(0, "plain"), (2, "plain"), (2, "stateful")])
def test_an_augmentation_drawn_per_sample_resumes_bitwise_mid_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, loader: str
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "_AUGMENT", True)
    folder = str(tmp_path / "ckpt")
    full = _full(workers, loader)
    saved = _interrupt(folder, workers, loader, "mid")
    resumed = _continue(folder, workers, loader, "mid", "load", MID, "no")
    assert saved[1] + resumed["epochs"][0] == full["epochs"][1]  # the data is exact
    assert resumed["mismatch"] == [] and resumed["logged"] == []  # and nothing is said
    assert all(map(torch.equal, resumed["params"], full["params"])), "weights differ"
