"""A run saved on N processes and resumed on M continues its epoch: every sample exactly once.

A dataloader position records where the epoch is in its *global* order (the batches of the
user's batch sampler, or samples of an iterable dataset, that every process together has
consumed), and the shuffling generator is matched by its role, so a resume on another number of
processes starts the rest of the epoch where the saving run stopped and in its order.

The in-process tests check the arithmetic on prepared loaders built for each rank (no shuffle,
so no process group is needed); the multi-process tests run real gloo jobs with a shuffled
loader, save mid-epoch or at an epoch's end, resume on another number of processes, and compare
the global order of every step (``gather``) with the uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from accelkit.data.position import GLOBAL_POSITION
from tests.helpers.distributed import run_distributed

SAMPLES, BATCH, EPOCHS = 96, 4, 2


# ------------------------------------------------------------------ in one process, per rank


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(SAMPLES))

    def __len__(self) -> int:
        return SAMPLES


def _rank_loaders(processes: int, *, split: bool = False, iterable: bool = False) -> list[Any]:
    from accelkit.data.preparation import DataLoaderConfiguration, prepare_data_loader

    data: Any = _Stream() if iterable else torch.arange(SAMPLES)
    config = DataLoaderConfiguration(split_batches=split, dispatch_batches=False)
    return [
        prepare_data_loader(
            DataLoader(data, batch_size=12 if split else BATCH),
            num_processes=processes,
            process_index=rank,
            config=config,
        )
        for rank in range(processes)
    ]


def _global_order(loaders: list[Any], steps: int | None = None) -> list[int]:
    """The samples of the next ``steps`` steps of a new pass (all, if None), rank after rank."""
    return _take([iter(loader) for loader in loaders], steps)


def _take(iterators: list[Any], steps: int | None = None) -> list[int]:
    """The samples of the next ``steps`` steps of ``iterators`` (all, if None)."""
    out: list[int] = []
    taken = 0
    while steps is None or taken < steps:
        batches = [next(it, None) for it in iterators]
        if any(batch is None for batch in batches):
            assert all(batch is None for batch in batches), "processes ended unevenly"
            break
        for batch in batches:
            out += batch.tolist()
        taken += 1
    return out


@pytest.mark.parametrize("saved_on", [1, 2, 3])
@pytest.mark.parametrize("resumed_on", [1, 2, 3])
@pytest.mark.parametrize("kind", ["map", "split", "iterable"])
def test_the_rest_of_the_epoch_follows_on_any_process_count(
    saved_on: int, resumed_on: int, kind: str
) -> None:
    split, iterable = kind == "split", kind == "iterable"
    saving = _rank_loaders(saved_on, split=split, iterable=iterable)
    steps = 4 if split else 12 // saved_on  # 48 samples: a step boundary of 1, 2 and 3
    before = _global_order(saving, steps)
    assert len(before) == 48
    state = saving[0].state_dict()
    assert state[GLOBAL_POSITION]["num_processes"] == saved_on
    resuming = _rank_loaders(resumed_on, split=split, iterable=iterable)
    for loader in resuming:
        loader.load_state_dict(state)
    after = _global_order(resuming)
    assert before + after == list(range(SAMPLES))  # each sample once, in the saved order
    # The next epoch is a full one.
    assert _global_order(resuming) == list(range(SAMPLES))


def test_a_position_saved_after_a_resume_on_another_count_carries_on() -> None:
    # 1 process, 3 steps (12 samples), then 2 processes: the pass starts between two of their
    # steps; its position, saved after one more step, resumes on 3 and on 2 exactly.
    one = _rank_loaders(1)
    before = _global_order(one, 3)
    two = _rank_loaders(2)
    for loader in two:
        loader.load_state_dict(one[0].state_dict())
    passes = [iter(loader) for loader in two]
    middle = _take(passes, 1)
    state = two[0].state_dict()
    assert state[GLOBAL_POSITION]["units"] == 5
    for processes in (3, 2):
        resumed = _rank_loaders(processes)
        for loader in resumed:
            loader.load_state_dict(state)
        order = before + middle + _global_order(resumed)
        assert order[:SAMPLES] == list(range(SAMPLES))
        # 19 batches left do not fill whole rounds: the last round is completed with the
        # epoch's first samples, as in an uninterrupted run (``even_batches``).
        padding = order[SAMPLES:]
        assert padding == list(range(len(padding))) and len(padding) < processes * BATCH
    rest = _take(passes)  # the rest of the epoch on 2: the next one starts at its beginning
    assert (before + middle + rest)[:SAMPLES] == list(range(SAMPLES))
    assert two[0].state_dict()[GLOBAL_POSITION]["units"] == 0


def test_a_save_right_after_a_load_keeps_the_saved_position() -> None:
    two = _rank_loaders(2)
    before = _global_order(two, 3)
    three = _rank_loaders(3)
    three[0].load_state_dict(two[0].state_dict())
    again = three[0].state_dict()  # nothing iterated since the load
    assert again[GLOBAL_POSITION] == two[0].state_dict()[GLOBAL_POSITION]
    one = _rank_loaders(1)
    one[0].load_state_dict(again)
    assert before + _global_order(one) == list(range(SAMPLES))


def test_skip_first_batches_with_the_saved_count_resumes_on_another_count() -> None:
    two = _rank_loaders(2)
    before = _global_order(two, 6)
    state = two[0].state_dict()
    three = _rank_loaders(3)
    for loader in three:
        loader.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saving run's count is the restored position
        skipping = [loader.skip_first_batches(6) for loader in three]
        after = _global_order(skipping)
    assert before + after == list(range(SAMPLES))
    assert _global_order(three) == list(range(SAMPLES))  # the next epoch is whole


def test_another_batch_size_rounds_the_position_down_and_says_so() -> None:
    from accelkit.data.preparation import DataLoaderConfiguration, prepare_data_loader

    two = _rank_loaders(2)
    before = _global_order(two, 3)  # 24 samples
    loader = prepare_data_loader(
        DataLoader(torch.arange(SAMPLES), batch_size=5),
        config=DataLoaderConfiguration(),
    )
    loader.load_state_dict(two[0].state_dict())
    with pytest.warns(UserWarning, match=r"sample 24 .*batches of 5.*batch_size=4"):
        after = _global_order([loader])
    assert after == list(range(20, SAMPLES))  # from sample 20: 4 seen twice, none lost
    assert before[-4:] == after[:4]


def test_an_older_position_without_the_global_record_applies_per_process() -> None:
    two = _rank_loaders(2)
    _global_order(two, 3)
    state = two[0].state_dict()
    del state[GLOBAL_POSITION]
    again = _rank_loaders(2)
    for loader in again:
        loader.load_state_dict(state)
    assert _global_order(again) == list(range(24, SAMPLES))  # as before the record existed


# ------------------------------------------------------------------- real multi-process jobs


def _accelerator(workers: int, stateful: bool, dispatch: bool = False) -> tuple[Any, Any]:
    from accelkit import Accelerator, DataLoaderConfiguration, set_seed

    set_seed(0)
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, dispatch_batches=dispatch)
    acc = Accelerator(cpu=True, dataloader_config=config)
    # Loader workers forked, as under torchrun on Linux: a run_distributed process inherits its
    # forkserver start method, whose first loader worker would start a fresh interpreter (and
    # import torch) in each of the three jobs: the test of two workers took 21 s, now 8.
    loader = DataLoader(
        torch.arange(SAMPLES),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
    )
    return acc, acc.prepare(loader)


def _steps(acc: Any, loader: Any, limit: int | None = None) -> list[int]:
    """The global order of the next steps of ``loader`` (``limit`` steps, or a whole pass)."""
    out: list[int] = []
    for step, batch in enumerate(loader):
        out += acc.gather(batch).tolist()
        if limit is not None and step + 1 == limit:
            break
    return out


def _job(
    folder: str,
    save_epoch: int,
    save_after: int,
    workers: int,
    stateful: bool,
    style: str,
    dispatch: bool = False,
) -> dict[str, Any]:
    """``style``: "full" (uninterrupted), "save" (stop and save after ``save_after`` steps of
    epoch ``save_epoch``; 0: after the whole epoch), "load" (iterate the loader after
    ``load_state``) or "skip" (``skip_first_batches`` with the saving run's count)."""
    acc, loader = _accelerator(workers, stateful, dispatch)
    epochs: list[list[int]] = []
    if style in ("full", "save"):
        for epoch in range(EPOCHS):
            if style == "save" and epoch == save_epoch:
                epochs.append(_steps(acc, loader, save_after or None))
                acc.save_state(folder)
                break
            epochs.append(_steps(acc, loader))
        return {"epochs": epochs}
    acc.load_state(folder)
    start = loader.epoch
    first = loader.skip_first_batches(save_after) if style == "skip" else loader
    epochs.append(_steps(acc, first))
    for _ in range(start + 1, EPOCHS):
        epochs.append(_steps(acc, loader))
    return {"epochs": epochs, "start": start}


class _Runs:
    """The uninterrupted and the saving jobs, each run once for every test that starts from the
    same one: the same process count and settings give the same orders and the same checkpoint
    (``set_seed(0)``), which no resume changes. Every test resumes in a job of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._results: dict[tuple[Any, ...], dict[str, Any]] = {}

    def job(self, saved_on: int, style: str, setting: tuple[Any, ...]) -> tuple[str, Any]:
        """The checkpoint folder of ``setting`` and rank 0's result of its ``style`` job."""
        save_epoch, save_after, workers, stateful, dispatch = setting
        # The uninterrupted run does not depend on where the saving run stops.
        key = (saved_on, style, *((workers, stateful, dispatch) if style == "full" else setting))
        folder = str(self.folder / "-".join(map(str, (saved_on, *setting))))
        if key not in self._results:
            args = (folder, save_epoch, save_after, workers, stateful, style, dispatch)
            self._results[key] = run_distributed(_job, *args, world_size=saved_on, timeout=300)[0]
        return folder, self._results[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("saved"))


def _resume(
    runs: _Runs,
    saved_on: int,
    resumed_on: int,
    *,
    save_epoch: int = 0,
    save_after: int = 6,
    workers: int = 0,
    stateful: bool = False,
    style: str = "load",
    dispatch: bool = False,
) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """The uninterrupted run's epochs, the saving run's, and the resumed run's result."""
    setting = (save_epoch, save_after, workers, stateful, dispatch)
    _, full = runs.job(saved_on, "full", setting)
    folder, saved = runs.job(saved_on, "save", setting)
    args = (folder, save_epoch, save_after, workers, stateful, style, dispatch)
    resumed = run_distributed(_job, *args, world_size=resumed_on, timeout=300)
    assert all(r == resumed[0] for r in resumed)  # gathered: every process saw the same steps
    return full["epochs"], saved["epochs"], resumed[0]


def _check_exactly_once(full: list[list[int]], saved: list[list[int]], resumed: Any) -> None:
    epoch = len(saved) - 1 if saved[-1] != full[len(saved) - 1] else len(saved)
    assert resumed["start"] == epoch
    if epoch < len(saved):  # mid-epoch: the saved part and the resumed part make the epoch
        interrupted = saved[-1] + resumed["epochs"][0]
        assert sorted(interrupted) == list(range(SAMPLES))  # every sample exactly once
        assert interrupted == full[epoch]  # in the uninterrupted run's global order
        later = resumed["epochs"][1:]
    else:
        later = resumed["epochs"]
    for order in later:
        assert sorted(order) == list(range(SAMPLES))


@pytest.mark.slow
@pytest.mark.parametrize("resumed_on", [1, 3])
def test_saved_on_two_mid_epoch_resumes_on_one_and_three(runs: _Runs, resumed_on: int) -> None:
    full, saved, resumed = _resume(runs, 2, resumed_on)
    _check_exactly_once(full, saved, resumed)
    # The shared shuffling generator is carried over: the next epoch's order is the saving
    # run's too.
    assert resumed["epochs"][1] == full[1]


@pytest.mark.slow
def test_saved_on_one_mid_epoch_resumes_on_two(runs: _Runs) -> None:
    full, saved, resumed = _resume(runs, 1, 2)
    _check_exactly_once(full, saved, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("resumed_on", [1, 3])
def test_saved_at_an_epoch_boundary_resumes_with_the_next_epoch(
    runs: _Runs, resumed_on: int
) -> None:
    full, saved, resumed = _resume(runs, 2, resumed_on, save_after=0)
    assert saved == full[:1]
    _check_exactly_once(full, saved, resumed)
    assert resumed["epochs"] == full[1:]  # the next epoch in the saving run's order


@pytest.mark.slow
def test_skip_first_batches_with_the_saved_count_on_another_count(runs: _Runs) -> None:
    full, saved, resumed = _resume(runs, 2, 3, style="skip")
    _check_exactly_once(full, saved, resumed)
    assert resumed["epochs"][1] == full[1]


@pytest.mark.slow
def test_two_loader_workers_resume_on_another_count(runs: _Runs) -> None:
    full, saved, resumed = _resume(runs, 2, 1, workers=2)
    _check_exactly_once(full, saved, resumed)
    assert resumed["epochs"][1] == full[1]


@pytest.mark.slow
def test_a_stateful_loader_resumes_on_another_count(runs: _Runs) -> None:
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")
    full, saved, resumed = _resume(runs, 2, 3, stateful=True)
    _check_exactly_once(full, saved, resumed)
    assert resumed["epochs"][1] == full[1]


def _load_old(folder: str) -> list[int]:
    acc, loader = _accelerator(0, False)
    acc.load_state(folder)
    return _steps(acc, loader)


@pytest.mark.slow
def test_a_dispatching_loader_resumes_on_another_count(runs: _Runs) -> None:
    # dispatch_batches: the main process reads the user's batches (2, then 3, per step).
    full, saved, resumed = _resume(runs, 2, 3, dispatch=True)
    _check_exactly_once(full, saved, resumed)


def _strip_global_record(folder: Path) -> None:
    """Make ``folder`` an older checkpoint: its dataloader position without the global record
    (the manifest's size and checksum of the file recomputed, so that it loads)."""
    from accelkit.checkpointing.formats.manifest import FileEntry, file_checksum, read_manifest
    from accelkit.checkpointing.storage import get_storage
    from accelkit.checkpointing.storage.checksum import DEFAULT_ALGORITHM

    name = "dataloader_0.json"
    data = json.loads((folder / name).read_text())
    assert GLOBAL_POSITION in json.dumps(data)
    _drop_key(data)
    (folder / name).write_text(json.dumps(data))
    manifest = read_manifest(get_storage(str(folder)), str(folder))
    assert manifest is not None
    size, checksum = file_checksum(get_storage(str(folder)), str(folder / name), DEFAULT_ALGORITHM)
    entries = {e.path: e for e in manifest.files}
    entries[name] = FileEntry(name, size, checksum)
    record = json.loads(manifest.to_json())
    record["files"] = [
        {"path": e.path, "size": e.size, "checksum": e.checksum}
        for e in sorted(entries.values(), key=lambda e: e.path)
    ]
    (folder / "accelkit.json").write_text(json.dumps(record))


def _drop_key(node: Any) -> None:
    if isinstance(node, dict):
        node.pop(GLOBAL_POSITION, None)
        for value in node.values():
            _drop_key(value)
    elif isinstance(node, list):
        for value in node:
            _drop_key(value)


def _load_and_iterate(folder: str) -> list[int]:
    acc, loader = _accelerator(0, False)
    acc.load_state(folder)
    return _steps(acc, loader)


@pytest.mark.slow
def test_an_older_checkpoint_on_another_count_warns_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    run_distributed(_job, str(folder), 0, 6, 0, False, "save", world_size=2, timeout=300)
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.restore.native"):
        _load_and_iterate(str(folder))  # with the record: the data follows, dropout cannot
    assert "continue the epoch at its global position" in caplog.text
    assert "dataloader_0.json" not in caplog.text
    caplog.clear()
    _strip_global_record(folder)
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.restore.native"):
        _load_and_iterate(str(folder))
    assert "Resume with --num_processes 2 for an exact continuation" in caplog.text
    assert "dataloader_0.json" in caplog.text
    assert "may repeat or leave out samples" in caplog.text
