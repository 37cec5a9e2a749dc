"""The resume fingerprint: a resumed run that would not continue the saved one is named.

Real runs save part-way through an epoch and a fresh ``Accelerator`` resumes from the checkpoint,
unchanged or with one thing changed (the batch size, the shuffling, a sampler's seed, a random
number drawn between ``load_state`` and the first batch, the number of processes). Unchanged, the
first batch comes without a warning; changed, a ``ResumeMismatchWarning`` names what differs,
and with ``Accelerator(strict_resume=True)`` the first batch raises ``ResumeMismatchError`` on
every process. A checkpoint saved without a fingerprint loads without either.
"""

from __future__ import annotations

import pickle
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from accelkit import Accelerator, set_seed
from accelkit.checkpointing.errors import (
    CorruptCheckpointError,
    ResumeMismatchError,
    ResumeMismatchWarning,
)
from tests.helpers.distributed import run_distributed

N = 24
SAVED_AFTER = 3


def _loader(
    batch: int = 2, shuffle: bool = True, sampler_seed: int | None = None, n: int = N
) -> Any:
    data = torch.arange(n)
    if sampler_seed is not None:  # a sampler of the user's own, kept as it is by prepare()
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=sampler_seed)
        return DataLoader(data, batch_size=batch, sampler=sampler)
    return DataLoader(data, batch_size=batch, shuffle=shuffle)


def _prepared(strict: bool = False, seed: int = 0, **loader: Any) -> tuple[Any, Any, Any, Any]:
    set_seed(seed)
    acc = Accelerator(cpu=True, strict_resume=strict)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return (acc, *acc.prepare(model, optimizer, _loader(**loader)))


def _train(acc: Any, model: Any, optimizer: Any, batches: Any, count: int) -> list[int]:
    """``count`` steps on the next batches of the iterator ``batches``; their sample ids."""
    seen: list[int] = []
    for _ in range(count):
        batch = next(batches)
        loss = model(batch.float().unsqueeze(1)).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen += batch.tolist()
    return seen


def _save(folder: str, fingerprint: bool = True, **loader: Any) -> list[int]:
    """The interrupted run: ``SAVED_AFTER`` steps, then ``save_state``; returns the ids the
    uninterrupted run takes in its next two steps."""
    acc, model, optimizer, dl = _prepared(**loader)
    if not fingerprint:  # a checkpoint as accelkit wrote them before the fingerprint
        acc._checkpointing.resume = None
    batches = iter(dl)
    _train(acc, model, optimizer, batches, SAVED_AFTER)
    acc.save_state(folder)
    return _train(acc, model, optimizer, batches, 2)


def _resume(
    folder: str, strict: bool = False, draw: bool = False, **loader: Any
) -> tuple[list[str], list[int], Any]:
    """Resume from ``folder``; the resume warnings' texts, the ids of the first two steps, and
    the accelerator."""
    acc, model, optimizer, dl = _prepared(strict=strict, **loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(folder)
        if draw:  # a random number drawn after load_state, before the first batch
            torch.rand(1)
        ids = _train(acc, model, optimizer, iter(dl), 2)
    texts = [str(w.message) for w in caught if issubclass(w.category, ResumeMismatchWarning)]
    return texts, ids, acc


@pytest.fixture
def folder() -> Any:
    with tempfile.TemporaryDirectory(prefix="accelkit-fp-") as root:
        yield str(Path(root) / "ckpt")


def test_an_unchanged_resume_is_silent_and_exact(folder: str) -> None:
    expected = _save(folder)
    assert (Path(folder) / "resume_fingerprint_0.json").is_file()
    texts, ids, acc = _resume(folder, strict=True)
    assert texts == []
    assert ids == expected
    # Paid once: the check's hook left the step boundaries at the first one.
    assert acc.gradient_state.on_boundary.hooks == ()


def test_a_changed_script_seed_is_overridden_by_the_checkpoint(folder: str) -> None:
    # set_seed(other) before prepare: the checkpoint restores the shuffling and random
    # states, so the resume is still exact and nothing is said.
    expected = _save(folder)
    texts, ids, _ = _resume(folder, strict=True, seed=1234)
    assert (texts, ids) == ([], expected)


def test_another_batch_size_is_named(folder: str) -> None:
    _save(folder)
    texts, _, _ = _resume(folder, batch=4)
    assert len(texts) == 1
    assert "dataloader 0 batch size 2 -> 4" in texts[0]
    assert "batch size it was saved with" in texts[0]
    assert "strict_resume=True" in texts[0]


def test_another_shuffle_is_named_as_sampler_and_data_order(folder: str) -> None:
    _save(folder)
    texts, _, _ = _resume(folder, shuffle=False)
    assert len(texts) == 1
    assert "dataloader 0 sampler RecordedRandomSampler over 24 samples -> " in texts[0]
    assert "SequentialSampler over 24 samples" in texts[0]
    assert "dataloader 0 data order differs" in texts[0]


def test_a_dataset_of_another_length_is_named(folder: str) -> None:
    _save(folder)
    texts, _, _ = _resume(folder, n=N + 4)
    assert len(texts) == 1
    assert (
        "sampler RecordedRandomSampler over 24 samples -> RecordedRandomSampler over 28"
        in (texts[0])
    )


def test_a_sampler_seed_the_checkpoint_does_not_restore_is_named(folder: str) -> None:
    expected = _save(folder, sampler_seed=1)
    texts, ids, _ = _resume(folder, sampler_seed=1)
    assert (texts, ids) == ([], expected)
    texts, ids, _ = _resume(folder, sampler_seed=2)
    assert len(texts) == 1
    assert "DistributedSampler over 24 samples, seed 1 -> DistributedSampler over 24" in texts[0]
    assert "data order differs" in texts[0]
    assert ids != expected  # what the warning was about


def test_a_long_pass_is_compared_by_its_position_and_randomness(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above MAX_SAMPLES the next indices are not replayed; the position and the shuffling
    # randomness it continues from stand for them.
    import accelkit.data.lookahead as lookahead

    monkeypatch.setattr(lookahead, "MAX_SAMPLES", 10)
    expected = _save(folder, sampler_seed=1)
    assert _resume(folder, strict=True, sampler_seed=1)[:2] == ([], expected)
    texts, _, _ = _resume(folder, batch=4, sampler_seed=1)
    assert len(texts) == 1 and "dataloader 0 batch size 2 -> 4" in texts[0]


def test_a_random_number_drawn_before_the_first_batch_is_named(folder: str) -> None:
    _save(folder)
    texts, _, _ = _resume(folder, draw=True)
    assert len(texts) == 1
    assert "RNG stream torch differs" in texts[0]
    assert "batch size" not in texts[0] and "data order" not in texts[0]
    assert "draw no random numbers between load_state()" in texts[0]


def test_strict_resume_raises_at_the_first_batch(folder: str) -> None:
    _save(folder)
    with pytest.raises(ResumeMismatchError, match=r"dataloader 0 batch size 2 -> 4") as info:
        _resume(folder, strict=True, batch=4)
    assert isinstance(info.value, RuntimeError) and not isinstance(info.value, ValueError)


def test_a_loader_pickled_before_the_first_batch_carries_no_armed_check(folder: str) -> None:
    _save(folder)
    acc, _, _, dl = _prepared(strict=True, batch=4)
    acc.load_state(folder)
    copy = pickle.loads(pickle.dumps(dl))
    next(iter(copy))  # the copy's hook is inert: nothing compared, nothing raised
    assert pickle.loads(pickle.dumps(acc)).num_processes == 1
    with pytest.raises(ResumeMismatchError, match="batch size 2 -> 4"):
        next(iter(dl))


def test_strict_resume_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"strict_resume='yes' \(str\): expected True or False"):
        Accelerator(cpu=True, strict_resume="yes")  # type: ignore[arg-type]


def test_a_checkpoint_without_fingerprint_loads_silently(folder: str) -> None:
    _save(folder, fingerprint=False)
    assert not (Path(folder) / "resume_fingerprint_0.json").exists()
    texts, _, acc = _resume(folder, strict=True, batch=4)
    assert texts == []
    assert acc.gradient_state.on_boundary.hooks == ()


def test_a_removed_random_states_file_is_a_named_error(folder: str) -> None:
    _save(folder)
    (Path(folder) / "random_states_0.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="random_states_0"):
        _resume(folder)


# ---------------------------------------------------------------- real processes


def _job(folder: str, mode: str) -> Any:
    """One process of a 2-process (or 1-process) job: ``save`` or resume as ``mode`` says."""
    batch = 4 if mode == "batch" else 2
    acc, model, optimizer, dl = _prepared(strict=mode == "strict", batch=batch)
    if mode == "save":
        batches = iter(dl)
        _train(acc, model, optimizer, batches, SAVED_AFTER)
        acc.save_state(folder)
        return _train(acc, model, optimizer, batches, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(folder)
        if mode == "draw" and acc.process_index == 1:
            torch.rand(1)
        try:
            ids = _train(acc, model, optimizer, iter(dl), 2)
        except ResumeMismatchError as exc:
            return ["error", str(exc)]
    return [str(w.message) for w in caught if issubclass(w.category, ResumeMismatchWarning)], ids


def test_two_processes_unchanged_random_stream_changed_and_strict(folder: str) -> None:
    expected = run_distributed(_job, folder, "save")
    assert all((Path(folder) / f"resume_fingerprint_{r}.json").is_file() for r in (0, 1))
    unchanged = run_distributed(_job, folder, "same")
    assert unchanged == [([], expected[0]), ([], expected[1])]
    drawn = run_distributed(_job, folder, "draw")
    # Warned once, on the main process, naming the process whose stream differs.
    assert len(drawn[0][0]) == 1 and drawn[1][0] == []
    assert "RNG stream torch differs (process 1)" in drawn[0][0][0]
    # Both processes stop at the first batch, with the same message.
    failed = run_distributed(_job_strict_batch, folder)
    assert [f[0] for f in failed] == ["error", "error"]
    assert failed[0][1] == failed[1][1]
    assert "dataloader 0 batch size 2 -> 4" in failed[0][1]


def _job_strict_batch(folder: str) -> Any:
    acc, model, optimizer, dl = _prepared(strict=True, batch=4)
    acc.load_state(folder)
    try:
        _train(acc, model, optimizer, iter(dl), 1)
    except ResumeMismatchError as exc:
        return ["error", str(exc)]
    return ["ran"]


def test_another_world_size_is_named(folder: str) -> None:
    run_distributed(_job, folder, "save")
    # Warned once, by the load (which names the fix); the check does not say it again.
    texts, _ = run_distributed(_job, folder, "same", world_size=1)[0]
    assert texts == []
    # Strict: the world size is what stops the run, named with its fix.
    (failed,) = run_distributed(_job, folder, "strict", world_size=1)
    assert failed[0] == "error"
    assert "world size 2 -> 1" in failed[1]
    assert "launch as many processes as the saved run (2)" in failed[1]
    assert "continue the epoch at its global position" in failed[1]
    # Across process counts one process's data share and random streams are not compared.
    assert "RNG stream" not in failed[1] and "data order" not in failed[1]
