"""Resuming mid-epoch gives exactly the batches of an uninterrupted run, in every resume style.

A run trains a small model for several shuffled epochs and records, per epoch, the sample ids
each process saw, whether each micro-step synchronised gradients, and a draw of the global RNG
after each step (what dropout would see). An interrupted run saves with ``save_state`` part-way
through an epoch (or on its last batch, or after its loop) and stops; a fresh ``Accelerator``
then loads the checkpoint and finishes the run in one of the styles scripts use:

* ``load``: iterate the prepared loader (``load_state`` restored its position);
* ``skip``: the Accelerate documents' idiom, ``skip_first_batches(loader, n)`` for the resumed
  epoch and the loader for the following ones;
* ``reassign``: ``loader = skip_first_batches(loader, n)`` once, then that loader for every
  epoch.

Each style must see, per process and per epoch, the same ids in the same order as the
uninterrupted run, synchronise on the same micro-steps, draw the same random numbers, and end
with the same weights, with either sampler (``use_seedable_sampler``), with and without
``use_stateful_dataloader`` and gradient accumulation. The same scenarios run on 1 process and
on 2 real processes.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from accelkit import Accelerator, DataLoaderConfiguration, set_seed
from accelkit.checkpointing.errors import ResumeMismatchWarning
from tests.helpers.distributed import run_distributed

N, BATCH, EPOCHS = 16, 2, 4
RESUME_EPOCH = 1
STYLES = ("load", "skip", "reassign")


def _setup(stateful: bool, accumulation: int, seedable: bool = False) -> tuple[Any, ...]:
    set_seed(0)
    acc = Accelerator(
        cpu=True,
        gradient_accumulation_steps=accumulation,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=stateful, use_seedable_sampler=seedable
        ),
    )
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(torch.arange(N), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    return acc, model, optimizer, loader


def _epoch(
    acc: Any,
    model: Any,
    optimizer: Any,
    loader: Any,
    out: dict[str, list[Any]],
    save_to: str | None = None,
    save_after: int = -1,
) -> None:
    """Train one pass over ``loader``; with ``save_to``, save after ``save_after`` batches and
    stop (the interrupted run)."""
    ids: list[int] = []
    syncs: list[bool] = []
    draws: list[float] = []
    for step, batch in enumerate(loader):
        with acc.accumulate(model):
            loss = model(batch.float().unsqueeze(1)).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        ids += batch.tolist()
        syncs.append(acc.sync_gradients)
        draws.append(float(torch.rand(1)))  # the global RNG stream, as dropout would see it
        if save_to is not None and step + 1 == save_after:
            acc.save_state(save_to)
            break
    out["ids"].append(ids)
    out["syncs"].append(syncs)
    out["rng"].append(draws)


def _weights(model: Any) -> list[float]:
    return [float(p.detach().sum()) for p in getattr(model, "module", model).parameters()]


def _full(stateful: bool, accumulation: int, seedable: bool = False) -> dict[str, Any]:
    acc, model, optimizer, loader = _setup(stateful, accumulation, seedable)
    out: dict[str, Any] = {"ids": [], "syncs": [], "rng": []}
    for _ in range(EPOCHS):
        _epoch(acc, model, optimizer, loader, out)
    out["weights"] = _weights(model)
    return out


def _interrupt(
    folder: str, save_after: int, stateful: bool, accumulation: int, seedable: bool
) -> None:
    acc, model, optimizer, loader = _setup(stateful, accumulation, seedable)
    out: dict[str, Any] = {"ids": [], "syncs": [], "rng": []}
    for _ in range(RESUME_EPOCH):
        _epoch(acc, model, optimizer, loader, out)
    if save_after == 0:
        _epoch(acc, model, optimizer, loader, out)
        acc.save_state(folder)
        return
    save_after = len(loader) if save_after < 0 else save_after
    _epoch(acc, model, optimizer, loader, out, save_to=folder, save_after=save_after)


def _resume(
    folder: str,
    style: str,
    skip: int,
    start: int,
    stateful: bool,
    accumulation: int,
    seedable: bool,
) -> dict[str, Any]:
    """Finish the run from the checkpoint; ``start`` is the epoch the script resumes in and
    ``skip`` the batches it thinks were done in it (what a script computes from its step)."""
    acc, model, optimizer, loader = _setup(stateful, accumulation, seedable)
    out: dict[str, Any] = {"ids": [], "syncs": [], "rng": []}
    with warnings.catch_warnings():
        # An exact resume never trips the resume check (tests/test_resume_check.py).
        warnings.simplefilter("error", ResumeMismatchWarning)
        acc.load_state(folder)
        if style == "reassign":
            loader = acc.skip_first_batches(loader, skip)
        for epoch in range(start, EPOCHS):
            active = loader
            if style == "skip" and epoch == start:
                active = acc.skip_first_batches(loader, skip)
            _epoch(acc, model, optimizer, active, out)
    out["weights"] = _weights(model)
    return out


# (use_seedable_sampler, use_stateful_dataloader, gradient_accumulation_steps)
SETUPS = [(False, False, 1), (False, False, 2), (False, True, 2), (True, False, 1), (True, True, 1)]
SAVE_POINTS = {
    # name: (batches done in the resumed epoch when saving, epoch to resume in, batches to skip)
    "mid_epoch": (2, RESUME_EPOCH, 2),
    "last_batch": (-1, RESUME_EPOCH + 1, 0),  # -1: the epoch's last batch (set per world size)
    "after_epoch": (0, RESUME_EPOCH + 1, 0),  # 0: after the epoch's loop has ended
}


def _scenarios(folder: str) -> dict[str, Any]:
    """Every (sampler, stateful, accumulation, save point, style) case; runs on each process."""
    results: dict[str, Any] = {}
    for seedable, stateful, accumulation in SETUPS:
        key = f"seedable={seedable},stateful={stateful},acc={accumulation}"
        results[key + ",full"] = _full(stateful, accumulation, seedable)
        for point, (after, start, skip) in SAVE_POINTS.items():
            ckpt = str(Path(folder) / f"{key}-{point}".replace(",", "_").replace("=", ""))
            _interrupt(ckpt, after, stateful, accumulation, seedable)
            for style in STYLES:
                results[f"{key},{point},{style}"] = _resume(
                    ckpt, style, skip, start, stateful, accumulation, seedable
                )
    return results


def _check(results: dict[str, Any], world: int) -> None:
    per_epoch = N // BATCH // world
    checked = 0
    for name, got in results.items():
        if name.endswith(",full"):
            continue
        config, point, _ = name.rsplit(",", 2)
        full = results[config + ",full"]
        after, start, _ = SAVE_POINTS[point]
        after = per_epoch if after < 0 else after
        want_ids = full["ids"][start:]
        want_syncs = full["syncs"][start:]
        want_rng = full["rng"][start:]
        if start == RESUME_EPOCH:  # resumed mid-epoch: that epoch continues after the save
            want_ids = [want_ids[0][after * BATCH :], *want_ids[1:]]
            want_syncs = [want_syncs[0][after:], *want_syncs[1:]]
            want_rng = [want_rng[0][after:], *want_rng[1:]]
        assert got["rng"] == want_rng, f"{name}: the global RNG stream shifted"
        assert got["ids"] == want_ids, f"{name}: batches differ from the uninterrupted run"
        assert got["syncs"] == want_syncs, f"{name}: gradient synchronisation differs"
        assert got["weights"] == pytest.approx(full["weights"], rel=1e-6, abs=1e-7), name
        checked += 1
    assert checked == len(SETUPS) * len(SAVE_POINTS) * len(STYLES)


@pytest.mark.slow
def test_every_resume_style_matches_an_uninterrupted_run_on_one_process(tmp_path: Path) -> None:
    results = _scenarios(str(tmp_path))
    _check(results, world=1)
    # the shuffled epochs really differ, so a replayed or shifted epoch would show
    full = results["seedable=False,stateful=False,acc=1,full"]["ids"]
    assert len({tuple(e) for e in full}) == EPOCHS and all(len(e) == N for e in full)


def _distributed_scenarios(folder: str) -> dict[str, Any]:
    return _scenarios(folder)


@pytest.mark.slow
def test_every_resume_style_matches_an_uninterrupted_run_on_two_processes() -> None:
    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_distributed(_distributed_scenarios, folder, world_size=2, timeout=300)
    for rank, results in enumerate(per_rank):
        _check(results, world=2)
        full = results["seedable=False,stateful=False,acc=1,full"]["ids"]
        assert all(len(e) == N // 2 for e in full), rank
    # the two processes saw disjoint halves of every epoch
    for epoch in range(EPOCHS):
        halves = [
            set(r["seedable=False,stateful=False,acc=1,full"]["ids"][epoch]) for r in per_rank
        ]
        assert halves[0].isdisjoint(halves[1]) and len(halves[0] | halves[1]) == N


# ------------------------------------------------------------------ single-pass behaviour


def _loader(stateful: bool = False, seedable: bool = False) -> tuple[Any, Any]:
    acc, _, _, loader = _setup(stateful, 1, seedable)
    return acc, loader


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("seedable", [False, True])
def test_skip_without_a_restored_position_skips_one_pass_only(
    stateful: bool, seedable: bool
) -> None:
    _, reference = _loader(stateful, seedable)
    epochs = [[b.tolist() for b in reference] for _ in range(3)]
    _, loader = _loader(stateful, seedable)
    skipped = loader.skip_first_batches(3)
    assert len(skipped) == len(epochs[0]) - 3
    assert [b.tolist() for b in skipped] == epochs[0][3:]
    assert len(skipped) == len(epochs[0])  # the skip is spent
    assert [b.tolist() for b in loader] == epochs[1]  # the original: the next epoch, whole
    assert [b.tolist() for b in skipped] == epochs[2]  # and so is the skipping loader's
    if seedable:  # the order is a function of the epoch: any epoch can be replayed
        loader.set_epoch(1)
        assert [b.tolist() for b in loader.skip_first_batches(2)] == epochs[1][2:]


def test_a_skip_that_disagrees_with_the_restored_position_is_obeyed_and_warned(
    tmp_path: Path,
) -> None:
    _, reference = _loader()
    epoch = [b.tolist() for b in reference]
    acc, loader = _loader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    acc.save_state(str(tmp_path))
    del it
    acc, loader = _loader()
    acc.load_state(str(tmp_path))
    skipped = acc.skip_first_batches(loader, 1)
    with pytest.warns(UserWarning, match=r"num_batches=1\).*batch 3 of epoch 0.*num_batches=3"):
        got = [b.tolist() for b in skipped]
    assert got == epoch[1:]
    # the restored position was spent by that pass: the original goes on with epoch 1, whole
    assert len([b for b in loader]) == len(epoch)
    assert loader.epoch == 2


def test_matching_skip_after_load_state_does_not_warn(tmp_path: Path) -> None:
    acc, loader = _loader()
    it = iter(loader)
    next(it)
    next(it)
    acc.save_state(str(tmp_path))
    del it
    acc, loader = _loader()
    acc.load_state(str(tmp_path))
    assert loader.state_dict()["batches_yielded"] == 2  # saving again keeps the position
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(acc.skip_first_batches(loader, 2))) == len(loader) - 2


@pytest.mark.parametrize("stateful", [False, True])
def test_a_position_saved_from_a_skipping_pass_resumes_at_the_right_batch(stateful: bool) -> None:
    # The skip happens in the sampler, before a StatefulDataLoader starts counting: the saved
    # state must still point at batch 3 + 2 of the epoch, not at batch 2.
    _, reference = _loader(stateful, seedable=True)
    epoch = [b.tolist() for b in reference]
    _, loader = _loader(stateful, seedable=True)
    it = iter(loader.skip_first_batches(3))
    assert [next(it).tolist() for _ in range(2)] == epoch[3:5]
    state = loader.state_dict()
    assert state["batches_yielded"] == 5
    del it
    _, resumed = _loader(stateful, seedable=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == epoch[5:]
