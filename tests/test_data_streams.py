"""A dataset that draws random numbers as it reads (an augmentation) resumes bit for bit
mid-epoch: in the training process (``num_workers=0``) the read-ahead batch is read again from
the generator states it was first read from (accelkit.data.readahead); with loader workers each
resumed worker plays the role, and starts from the generator states, of the worker whose turn
it was (accelkit.data.worker_streams).

Each test trains the same loop uninterrupted and interrupted (saved mid-epoch, resumed in a
fresh Accelerator) and compares what every batch held (the augmented values) and the global
generators at the end.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from xxhash import xxh3_128_hexdigest

from accelkit import Accelerator, set_seed
from accelkit.checkpointing.errors import (
    CorruptCheckpointError,
    ResumeMismatchError,
    ResumeMismatchWarning,
)
from accelkit.data.readahead import PROBE_EVERY, ReadAheadRandomness, read_under
from accelkit.runtime.random import global_generator_states

N, BATCH, STOP = 40, 4, 3  # 10 batches an epoch; the save after the 3rd of the 2nd epoch


class _Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Sample ``i`` plus noise drawn from the global generator(s) ``draws`` names."""

    def __init__(self, draws: tuple[str, ...]) -> None:
        self.draws = draws

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = [0.0, 0.0, 0.0]
        if "python" in self.draws:
            noise[0] = random.random()
        if "numpy" in self.draws:
            noise[1] = float(np.random.rand())
        if "torch" in self.draws:
            noise[2] = float(torch.rand(()))
        return torch.tensor([i / N, *noise])

    def __len__(self) -> int:
        return N


class _AugmentedStream(torch.utils.data.IterableDataset[torch.Tensor]):
    """The same samples as an iterable dataset (a resume reads and drops the done batches)."""

    def __iter__(self) -> Any:
        for i in range(N):
            yield torch.tensor([i / N, float(torch.rand(()))])


def _setup(dataset: Any, strict: bool = False, **loader_kwargs: Any) -> tuple[Any, ...]:
    set_seed(0)
    acc = Accelerator(cpu=True, strict_resume=strict)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shuffle = not isinstance(dataset, torch.utils.data.IterableDataset)
    if loader_kwargs.get("num_workers"):
        loader_kwargs.setdefault("multiprocessing_context", "fork")  # as under torchrun
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=shuffle, **loader_kwargs
    )
    return (acc, *acc.prepare(model, optimizer, loader))


def _train(acc: Any, model: Any, optimizer: Any, batches: Any, stop: int | None = None) -> list:
    seen = []
    for step, batch in enumerate(batches):
        features = torch.nn.functional.pad(batch, (0, 4 - batch.shape[1]))
        acc.backward(model(features).pow(2).mean())  # dropout draws from torch's generator
        optimizer.step()
        optimizer.zero_grad()
        seen.append(batch.clone())
        if stop is not None and step + 1 == stop:
            break
    return seen


def _end(model: Any) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()], **_generators()}


def _generators() -> dict[str, Any]:
    states = global_generator_states()
    return {
        "python": states["python"],
        "numpy": states["numpy"][1].tolist(),
        "torch": states["torch"],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(map(torch.equal, a["params"], b["params"]))
        and a["python"] == b["python"]
        and a["numpy"] == b["numpy"]
        and torch.equal(a["torch"], b["torch"])
    )


def _uninterrupted(dataset: Any, **kw: Any) -> tuple[list, dict[str, Any]]:
    acc, model, optimizer, loader = _setup(dataset, **kw)
    seen = _train(acc, model, optimizer, loader) + _train(acc, model, optimizer, loader)
    seen += _train(acc, model, optimizer, loader)
    return seen, _end(model)


def _interrupted(dataset: Any, folder: Path, stop: int = STOP, **kw: Any) -> list:
    acc, model, optimizer, loader = _setup(dataset, **kw)
    seen = _train(acc, model, optimizer, loader) + _train(acc, model, optimizer, loader, stop)
    acc.save_state(str(folder))
    return seen


def _resumed(
    dataset: Any, folder: Path, idiom: str = "load", stop: int = STOP, **kw: Any
) -> tuple[list, dict[str, Any]]:
    acc, model, optimizer, loader = _setup(dataset, **kw)
    acc.load_state(str(folder))
    first = acc.skip_first_batches(loader, stop) if idiom == "skip" else loader
    seen = _train(acc, model, optimizer, first) + _train(acc, model, optimizer, loader)
    return seen, _end(model)


def _refused_before_anything_changes(
    folder: Path, key: str, named: str, dataset: Any, **kw: Any
) -> None:
    """Loading ``folder`` is refused as a damaged file, naming ``key`` and ``named``, and leaves
    the weights and the loader's position as they were."""
    acc, model, _, loader = _setup(dataset, **kw)
    position, weights = loader.state_dict(), copy.deepcopy(model.state_dict())
    with pytest.raises(CorruptCheckpointError, match=r"dataloader_0\.json") as caught:
        acc.load_state(str(folder))
    message = str(caught.value)
    assert key in message and named in message and "load another checkpoint" in message
    assert loader.state_dict() == position
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def _edit_loader_state(folder: Path, key: str, value: Any) -> None:
    """An attacker's checkpoint: ``key`` of the loader's state set to ``value``, the manifest
    re-signed so that only the loader's own check can refuse it."""
    loader_file = folder / "dataloader_0.json"
    document = json.loads(loader_file.read_text())
    document["state"][key] = value
    loader_file.write_text(json.dumps(document))
    manifest = json.loads((folder / "accelkit.json").read_text())
    for listed in manifest["files"]:
        data = (folder / listed["path"]).read_bytes()
        listed["size"], listed["checksum"] = len(data), "xxh3_128:" + xxh3_128_hexdigest(data)
    (folder / "accelkit.json").write_text(json.dumps(manifest))


def _equal_runs(full: list, parts: list) -> bool:
    return len(full) == len(parts) and all(map(torch.equal, full, parts))


@pytest.mark.parametrize(
    "draws", [("python",), ("numpy",), ("torch",), ("python", "numpy", "torch")], ids="+".join
)
def test_an_augmentation_resumes_bit_for_bit_mid_epoch(tmp_path: Path, draws: tuple) -> None:
    full, full_end = _uninterrupted(_Augmented(draws))
    before = _interrupted(_Augmented(draws), tmp_path / "ckpt")
    after, end = _resumed(_Augmented(draws), tmp_path / "ckpt")
    assert _equal_runs(full, before + after), "the augmented batches differ after the resume"
    assert _same(end, full_end), "weights or generators differ at the end"
    # The loader kept exactly the generators its reads draw from.
    state = json.loads((tmp_path / "ckpt" / "dataloader_0.json").read_text())["state"]
    assert sorted(state["read_ahead_rng"]) == sorted(draws)


def test_the_skip_first_batches_idiom_resumes_bit_for_bit(tmp_path: Path) -> None:
    dataset = _Augmented(("torch", "numpy"))
    full, full_end = _uninterrupted(dataset)
    before = _interrupted(dataset, tmp_path / "ckpt")
    after, end = _resumed(dataset, tmp_path / "ckpt", idiom="skip")
    assert _equal_runs(full, before + after)
    assert _same(end, full_end)


def test_an_iterable_dataset_read_and_dropped_resumes_bit_for_bit(tmp_path: Path) -> None:
    full, full_end = _uninterrupted(_AugmentedStream())
    before = _interrupted(_AugmentedStream(), tmp_path / "ckpt")
    after, end = _resumed(_AugmentedStream(), tmp_path / "ckpt")
    assert _equal_runs(full, before + after)
    assert _same(end, full_end)


def test_a_save_right_after_the_load_keeps_the_read_ahead_states(tmp_path: Path) -> None:
    # Accelerate #4244's case: a checkpoint saved before the resumed run reads a batch.
    dataset = _Augmented(("torch",))
    full, full_end = _uninterrupted(dataset)
    before = _interrupted(dataset, tmp_path / "ckpt")
    acc, *_ = _setup(dataset)
    acc.load_state(str(tmp_path / "ckpt"))
    acc.save_state(str(tmp_path / "again"))
    after, end = _resumed(dataset, tmp_path / "again")
    assert _equal_runs(full, before + after)
    assert _same(end, full_end)


def test_a_dataset_without_randomness_keeps_nothing(tmp_path: Path) -> None:
    _interrupted(_Augmented(()), tmp_path / "ckpt")
    state = json.loads((tmp_path / "ckpt" / "dataloader_0.json").read_text())["state"]
    assert state["batches_yielded"] == STOP and "read_ahead_rng" not in state


@pytest.mark.parametrize(("first", "kept_from"), [(5, 9), (PROBE_EVERY + 3, 2 * PROBE_EVERY + 1)])
def test_a_pass_that_starts_drawing_later_is_caught_by_the_next_probe(
    first: int, kept_from: int
) -> None:
    # Reads before `first` draw nothing; from then on torch's generator. The probes (reads 1, 2,
    # 4, ..., PROBE_EVERY, then every PROBE_EVERY) see it at the next one; kept from the read after.
    record = ReadAheadRandomness()
    record.start_pass()
    for read in range(kept_from + 2):
        record.read(lambda read=read: torch.rand(()) if read >= first else None)
        assert (record.held is None) == (read < kept_from), read
    assert record.held is not None and sorted(record.held) == ["torch"]


def test_read_under_draws_the_saved_numbers_and_moves_nothing_else() -> None:
    torch.manual_seed(1)
    saved = global_generator_states(["torch"])
    first = torch.rand(3)
    torch.manual_seed(2)
    now = global_generator_states(["torch"])
    again = read_under(saved, lambda: torch.rand(3))
    assert torch.equal(first, again)
    assert torch.equal(global_generator_states(["torch"])["torch"], now["torch"])


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"torch": [1, 2, 3]}, "torch generator state"),
        ({"python": [3, [1, 2], None]}, "python generator state"),
        ({"numpy": ["MT19937", [0] * 3, 0, 0, 0.0]}, "numpy generator state"),
        ({"cuda": []}, "keyed by"),
    ],
)
def test_a_malformed_read_ahead_state_is_refused_naming_it(
    tmp_path: Path, entry: dict, named: str
) -> None:
    dataset = _Augmented(("torch",))
    folder = tmp_path / "ckpt"
    _interrupted(dataset, folder)
    _edit_loader_state(folder, "read_ahead_rng", entry)
    _refused_before_anything_changes(folder, "read_ahead_rng", named, dataset)


# ------------------------------------------------------------------ loader workers

_DRAWN_AT_START: list[float] = []


def _drawing_init(worker_id: int) -> None:
    """A user's worker_init_fn that draws (it runs before the saved states are put back)."""
    np.random.seed(torch.initial_seed() % 2**32)
    _DRAWN_AT_START.append(random.random())


@pytest.mark.parametrize(
    ("workers", "stop", "init"),
    [(2, STOP, None), (3, STOP, _drawing_init), (3, 1, None)],
    ids=["2-workers", "3-workers-drawing-init", "3-workers-saved-on-the-first-batch"],
)
def test_augmentations_drawn_in_workers_resume_bit_for_bit(
    tmp_path: Path, workers: int, stop: int, init: Any
) -> None:
    # saved on the first batch: 2 of the 3 roles had read nothing, so they start from the seeds
    # PyTorch gave them in the interrupted pass.
    kw = {"num_workers": workers, "worker_init_fn": init}
    dataset = _Augmented(("python", "numpy", "torch"))
    full, full_end = _uninterrupted(dataset, **kw)
    before = _interrupted(dataset, tmp_path / "ckpt", stop, **kw)
    after, end = _resumed(dataset, tmp_path / "ckpt", stop=stop, **kw)
    assert _equal_runs(full, before + after), "the augmented batches differ after the resume"
    assert _same(end, full_end)
    state = json.loads((tmp_path / "ckpt" / "dataloader_0.json").read_text())["state"]
    plan = state["worker_rng"]
    assert plan["workers"] == workers and plan["next"] == stop % workers
    assert "read_ahead_rng" not in state  # the training process's reads drew nothing


def test_a_run_resumed_twice_with_workers_stays_bit_for_bit(tmp_path: Path) -> None:
    # The second checkpoint is saved by resumed workers: their roles, not their ids, count.
    dataset = _Augmented(("torch",))
    kw = {"num_workers": 3}
    full, full_end = _uninterrupted(dataset, **kw)
    before = _interrupted(dataset, tmp_path / "one", **kw)
    acc, model, optimizer, loader = _setup(dataset, **kw)
    acc.load_state(str(tmp_path / "one"))
    middle = _train(acc, model, optimizer, loader, stop=2)
    acc.save_state(str(tmp_path / "two"))
    after, end = _resumed(dataset, tmp_path / "two", stop=STOP + 2, **kw)
    assert _equal_runs(full, before + middle + after)
    assert _same(end, full_end)


def test_workers_of_a_dataset_without_randomness_record_nothing(tmp_path: Path) -> None:
    _interrupted(_Augmented(()), tmp_path / "ckpt", num_workers=2)
    state = json.loads((tmp_path / "ckpt" / "dataloader_0.json").read_text())["state"]
    assert state["batches_yielded"] == STOP and "worker_rng" not in state


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"workers": 2, "base_seed": 1, "next": 5, "states": []}, "out of range"),
        ({"workers": 2, "base_seed": 1, "next": 0, "states": [[0, {"torch": 3}]]}, "torch"),
        ({"workers": 2, "next": 0, "states": []}, "base_seed"),
    ],
)
def test_a_malformed_worker_state_is_refused_naming_it(
    tmp_path: Path, entry: dict, named: str
) -> None:
    dataset = _Augmented(("torch",))
    folder = tmp_path / "ckpt"
    _interrupted(dataset, folder, num_workers=2)
    _edit_loader_state(folder, "worker_rng", entry)
    _refused_before_anything_changes(folder, "worker_rng", named, dataset, num_workers=2)


# ------------------------------------------------------------------ another worker count


def _resume_warnings(dataset: Any, folder: Path, **kw: Any) -> list[str]:
    acc, model, optimizer, loader = _setup(dataset, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(str(folder))
        _train(acc, model, optimizer, loader, stop=1)
    return [str(w.message) for w in caught if issubclass(w.category, ResumeMismatchWarning)]


@pytest.mark.parametrize(("saved", "resumed"), [(2, 3), (0, 2), (2, 0)])
def test_another_worker_count_is_named_when_the_reads_draw(
    tmp_path: Path, saved: int, resumed: int
) -> None:
    # Which process reads a batch decides its augmentations: the saved streams cannot be
    # played by another number of workers (or by the training process instead of workers).
    dataset = _Augmented(("torch",))
    _interrupted(dataset, tmp_path / "ckpt", num_workers=saved)
    texts = _resume_warnings(dataset, tmp_path / "ckpt", num_workers=resumed)
    assert len(texts) == 1, texts
    assert f"dataloader 0 workers {saved} -> {resumed}" in texts[0]
    assert f"num_workers it was saved with ({saved})" in texts[0]
    acc, _, _, loader = _setup(dataset, strict=True, num_workers=resumed)
    acc.load_state(str(tmp_path / "ckpt"))
    with pytest.raises(ResumeMismatchError, match=f"workers {saved} -> {resumed}"):
        next(iter(loader))


def test_another_worker_count_is_silent_when_the_reads_draw_nothing(tmp_path: Path) -> None:
    dataset = _Augmented(())
    full, _ = _uninterrupted(dataset, num_workers=2)
    before = _interrupted(dataset, tmp_path / "ckpt", num_workers=2)
    assert _resume_warnings(dataset, tmp_path / "ckpt", num_workers=3) == []
    after, _ = _resumed(dataset, tmp_path / "ckpt", num_workers=3)
    assert _equal_runs(full, before + after)


def test_augmentations_in_spawned_workers_resume_bit_for_bit(tmp_path: Path) -> None:
    # The worker hooks travel to workers started by "spawn" (pickled, not inherited).
    kw = {"num_workers": 2, "multiprocessing_context": "spawn"}
    dataset = _Augmented(("python", "torch"))
    full, full_end = _uninterrupted(dataset, **kw)
    before = _interrupted(dataset, tmp_path / "ckpt", **kw)
    after, end = _resumed(dataset, tmp_path / "ckpt", **kw)
    assert _equal_runs(full, before + after)
    assert _same(end, full_end)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_augmentations_in_workers_resume_bit_for_bit_with_pinned_memory(tmp_path: Path) -> None:
    # The pinning thread rebuilds each tagged batch (a NamedTuple) and keeps its tags.
    kw = {"num_workers": 2, "pin_memory": True}
    dataset = _Augmented(("torch",))
    full, full_end = _uninterrupted(dataset, **kw)
    before = _interrupted(dataset, tmp_path / "ckpt", **kw)
    after, end = _resumed(dataset, tmp_path / "ckpt", **kw)
    assert _equal_runs(full, before + after)
    assert _same(end, full_end)
