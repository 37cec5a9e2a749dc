"""``accelkit ckpt import`` is a save (issue 23, item 3).

The README's way to move over from Accelerate mid-run is to keep training and import the
Accelerate folder beside the run. An import therefore takes the project's save lock, creates its
destination exclusively once it has chosen it, and never writes into or under its source; a
training save whose next ``checkpoint_<n>`` an import took moves past it. Everything here runs
the real ``accelkit`` console script against real folders written by Hugging Face accelerate
(a subprocess) and, for the race, a real training process saving in a loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.commit.lock import IMPORT, LOCK_NAME, SAVE
from accelkit.checkpointing.errors import CheckpointError
from accelkit.checkpointing.formats.manifest import read_manifest
from accelkit.checkpointing.storage import get_storage
from accelkit.utils import DataLoaderConfiguration
from tests.checkpointing.accelerate_helpers import accelerate_checkpoint
from tests.checkpointing.accelerate_run import Counter, build
from tests.helpers.preloaded import Preloaded

pytestmark = pytest.mark.reliability

REPO = Path(__file__).resolve().parents[2]
ACCELKIT = str(Path(sys.executable).with_name("accelkit"))
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
IMPORTS = 3  # imports run while the job saves
SEEN_BY_ACCELERATE = 3  # the registered counter in accelerate's checkpoint (accelerate_run.py)


@pytest.fixture(scope="module")
def accelerate_folder(
    tmp_path_factory: pytest.TempPathFactory, accelerate_checkpoint_template: Path
) -> Path:
    """``checkpoints/checkpoint_0`` written by Hugging Face accelerate's ``save_state``."""
    root = tmp_path_factory.mktemp("accelerate") / "checkpoints"
    return accelerate_checkpoint(root, accelerate_checkpoint_template)


@pytest.fixture
def project(tmp_path: Path, accelerate_folder: Path) -> Path:
    """A project whose ``checkpoints/checkpoint_0`` is accelerate's."""
    root = tmp_path / "project"
    shutil.copytree(accelerate_folder, root / "checkpoints" / "checkpoint_0")
    return root


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` with its content and mtime (to prove nothing touched it)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


# Each command runs the real console script in a fresh process forked from one that has
# already imported what `accelkit ckpt import` imports (torch: 2.5-3.5 s a fresh interpreter
# pays). The 20-odd commands of this module paid that import each: about 60 s of its 100.
_SERVERS: list[Preloaded] = []


@pytest.fixture(scope="module", autouse=True)
def _command_server() -> Iterator[None]:
    preload = ["accelkit.cli.main", "accelkit.checkpointing.interop.accelerate_import"]
    with Preloaded(preload, env=ENV) as preloaded:
        _SERVERS.append(preloaded)
        yield
        _SERVERS.pop()


def _accelkit(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = _SERVERS[-1].run(ACCELKIT, *args, timeout=timeout, cwd=Path.cwd())
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def _import(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return _accelkit("ckpt", "import", *args, timeout=timeout)


def _accelerator(project: Path) -> tuple[Accelerator, torch.nn.Module, Counter]:
    """The objects accelerate's checkpoint holds (those of ``accelerate_run.py``)."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(
        project_config=config,
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    model, optimizer, scheduler = build()
    loader = DataLoader(TensorDataset(torch.arange(96.0).view(48, 2)), batch_size=2)
    model, optimizer, scheduler, _ = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, counter


_JOB = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import torch
    from tests.reliability.test_hostile_import import _accelerator

    project, events, stop = sys.argv[1:4]
    accelerator, model, counter = _accelerator(Path(project))
    accelerator.load_state()  # the newest checkpoint: accelerate's checkpoint_0
    stamp = 0
    with open(events, "a") as log:
        while stamp < 3 or not Path(stop).exists():
            stamp += 1
            with torch.no_grad():  # every value of this save is its stamp
                for p in model.parameters():
                    p.fill_(float(stamp))
            counter.seen = 10_000 + stamp
            try:
                path = accelerator.save_state()
            except Exception as exc:
                log.write(json.dumps({"stamp": stamp, "error": repr(exc)}) + "\\n")
                sys.exit(1)
            log.write(json.dumps({"stamp": stamp, "path": path}) + "\\n")
            log.flush()
            time.sleep(0.1)
    """
)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_saves(path: Path, count: int, job: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 180
    while len(_events(path)) < count:
        assert job.poll() is None, f"the job ended early: {_events(path)}"
        assert time.monotonic() < deadline, "the job did not save"
        time.sleep(0.05)


def test_imports_beside_a_running_job_and_its_saves_each_commit_their_own_folder(
    project: Path, tmp_path: Path
) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    before = _tree(src)
    script, events, stop = tmp_path / "job.py", tmp_path / "events.jsonl", tmp_path / "stop"
    script.write_text(_JOB)
    job = subprocess.Popen(
        [sys.executable, str(script), str(project), str(events), str(stop)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    imported: list[str] = []
    try:
        _wait_for_saves(events, 1, job)
        for _ in range(IMPORTS):
            done = _import(str(src), "--json")
            assert done.returncode == 0, done.stdout + done.stderr
            imported.append(json.loads(done.stdout)["destination"])
            # The job saves again after each import: its counter meets the imported number.
            _wait_for_saves(events, len(_events(events)) + 2, job)
    finally:
        stop.touch()
        output, _ = job.communicate(timeout=300)
    saves = _events(events)
    assert job.returncode == 0, (output, saves)
    assert all("path" in e for e in saves), saves  # no save failed

    def number(path: str) -> int:
        return int(path.rstrip("/").rsplit("_", 1)[1])

    saved = [number(e["path"]) for e in saves]
    taken = [number(p) for p in imported]
    # Each writer committed into its own folder; no number is skipped or used twice.
    assert len(set(saved)) == len(saved) and not set(saved) & set(taken), (saved, taken)
    assert sorted(saved + taken) == list(range(1, len(saved) + len(taken) + 1))
    # Each import took the number the running job was about to use; the job moved past it.
    assert all(min(saved) < n < max(saved) for n in taken), (saved, taken)
    names = {p.name for p in (project / "checkpoints").iterdir()}
    assert names == {f"checkpoint_{n}" for n in [0, *saved, *taken]}  # nothing left over
    assert not (project / LOCK_NAME).exists()
    assert _tree(src) == before  # the source is only read

    verify = _accelkit("ckpt", "verify", str(project))
    count = len(saved) + len(taken) + 1  # and the accelerate folder checkpoint_0
    assert f"{count} of {count} checkpoint(s) intact" in verify.stdout, (
        verify.stdout + verify.stderr
    )

    # Loading: each checkpoint holds the state its writer put there, never a mix.
    reference, ref_model, ref_counter = _accelerator(tmp_path / "ref")
    reference.load_state(str(src))
    accelerate_weights = {k: v.clone() for k, v in ref_model.state_dict().items()}
    assert ref_counter.seen == SEEN_BY_ACCELERATE
    for event in saves:
        accelerator, model, counter = _accelerator(project)
        accelerator.load_state(event["path"])
        assert all(bool((v == float(event["stamp"])).all()) for v in model.state_dict().values())
        assert counter.seen == 10_000 + event["stamp"]
        manifest = read_manifest(get_storage(event["path"]), event["path"])
        assert manifest is not None and "imported_from" not in manifest.metadata
    for path in imported:
        accelerator, model, counter = _accelerator(project)
        accelerator.load_state(path)
        state = model.state_dict()
        assert all(torch.equal(state[k], accelerate_weights[k]) for k in state), path
        assert counter.seen == SEEN_BY_ACCELERATE
        manifest = read_manifest(get_storage(path), path)
        assert manifest is not None and manifest.metadata["imported_from"] == str(src)


def _links(tmp_path: Path, src: Path) -> dict[str, str]:
    link = tmp_path / "link-to-source"
    link.symlink_to(src, target_is_directory=True)
    parent_link = tmp_path / "link-to-checkpoints"
    parent_link.symlink_to(src.parent, target_is_directory=True)
    cases = {
        "the source itself": src,
        "inside the source": src / "converted",
        "deep inside the source": src / "a" / "b" / "checkpoint_9",
        "holding the source": src.parent,
        "the source through a link": link,
        "inside the source through a link": link / "converted",
        "the source through a linked parent": parent_link / src.name,
    }
    return {
        **{case: str(path) for case, path in cases.items()},
        "the source with a trailing slash and dots": f"{src}/./",
        "inside the source, spelt with ..": f"{src}/../{src.name}/converted",
    }


def test_a_destination_overlapping_the_source_is_refused_before_anything_is_written(
    project: Path, tmp_path: Path
) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    before = _tree(src)
    listing = sorted(p.name for p in (project / "checkpoints").iterdir())
    for case, destination in _links(tmp_path, src).items():
        done = _import(str(src), str(destination))
        message = done.stdout + done.stderr
        assert done.returncode == 2, (case, message)
        assert "source" in message and "nothing was written" in message, (case, message)
        assert destination in message, (case, message)
        assert _tree(src) == before, case  # not one file added, changed or touched
        assert not (src / "converted").exists() and not (src / "a").exists(), case
        assert sorted(p.name for p in (project / "checkpoints").iterdir()) == listing, case
        assert not (project / LOCK_NAME).exists(), case


def test_an_existing_destination_is_never_written_into(project: Path, tmp_path: Path) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("notes")
    file = tmp_path / "file"
    file.write_text("a file")
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    trees = {p: _tree(p) if p.is_dir() else p.read_bytes() for p in (elsewhere, folder, empty)}
    for destination in (folder, file, link, dangling, empty):
        done = _import(str(src), str(destination))
        assert done.returncode == 2, done.stdout + done.stderr
        assert "already exists" in done.stderr and str(destination) in done.stderr
    assert file.read_text() == "a file"
    assert not (tmp_path / "nowhere").exists()  # a dangling link is not followed either
    assert {p: _tree(p) for p in trees} == trees
    assert sorted(p.name for p in empty.iterdir()) == []


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from accelkit.checkpointing.commit.lock import RunLock
    from accelkit.checkpointing.storage import get_storage

    project, role, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    lock = RunLock(get_storage(project), project, role=role)
    lock.acquire()
    print("held", flush=True)
    time.sleep(hold)
    lock.release()
    """
)


def _hold_lock(project: Path, role: str, seconds: float) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(project), role, str(seconds)],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_an_import_waits_for_a_save_in_flight_and_a_save_waits_for_an_import(
    project: Path, tmp_path: Path
) -> None:
    src = project / "checkpoints" / "checkpoint_0"
    # A live process saving into the project (role save) holds the lock for 4 s: the import
    # waits for it, then commits (neither is refused, nothing is written before).
    holder = _hold_lock(project, SAVE, 4.0)
    started = time.monotonic()
    done = _import(str(src), "--json")
    waited = time.monotonic() - started
    holder.wait(timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["destination"] == str(project / "checkpoints" / "checkpoint_1")
    assert holder.returncode == 0 and waited >= 3.0, waited
    # The wait is said once, with who holds the lock, not silent for up to PRUNE_WAIT_S.
    assert done.stderr.count("waiting for pid") == 1, done.stderr
    assert f"pid {holder.pid} " in done.stderr and "'save'" in done.stderr, done.stderr

    # An import in flight (role import) holds it: a training save waits, then commits past it.
    accelerator, _, _ = _accelerator(project)
    accelerator.load_state()  # newest: the import, checkpoint_1
    holder = _hold_lock(project, IMPORT, 3.0)
    started = time.monotonic()
    path = accelerator.save_state()
    assert time.monotonic() - started >= 2.0
    holder.wait(timeout=60)
    assert path.endswith("checkpoint_2")

    # A prune meeting an import in flight is refused and deletes nothing.
    holder = _hold_lock(project, IMPORT, 30.0)
    try:
        listing = sorted(p.name for p in (project / "checkpoints").iterdir())
        prune = _accelkit("ckpt", "prune", str(project), "--keep", "1", "--yes", timeout=120)
        assert prune.returncode != 0 and "in flight" in prune.stdout + prune.stderr
        assert sorted(p.name for p in (project / "checkpoints").iterdir()) == listing
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_a_save_whose_name_is_taken_moves_past_it(project: Path, tmp_path: Path) -> None:
    accelerator, model, _ = _accelerator(project)
    accelerator.load_state()  # accelerate's checkpoint_0: the next save is checkpoint_1
    checkpoints = project / "checkpoints"

    # An interrupted import (its marker names the source, no manifest): moved past silently.
    crashed = checkpoints / "checkpoint_1"
    crashed.mkdir()
    marker = {"format": "accelkit-save", "pid": 1, "imported_from": "elsewhere"}
    (crashed / ".accelkit-save.json").write_text(json.dumps(marker))
    assert accelerator.save_state().endswith("checkpoint_2")
    assert sorted(p.name for p in crashed.iterdir()) == [".accelkit-save.json"]

    # A folder of the user's: refused once (untouched), then the run goes on past it.
    foreign = checkpoints / "checkpoint_3"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"checkpoint_3 already exists.*checkpoint_4"):
        accelerator.save_state()
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert accelerator.save_state().endswith("checkpoint_4")

    # A link where the next checkpoint goes, even one whose target carries an import's marker:
    # refused once, nothing written through it, then the run goes on.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".accelkit-save.json").write_text(json.dumps(marker))
    before = _tree(outside)
    (checkpoints / "checkpoint_5").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="checkpoint_5 already exists"):
        accelerator.save_state()
    assert _tree(outside) == before
    assert accelerator.save_state().endswith("checkpoint_6")

    # A marker too big to be a save marker, or not JSON, is not an import's: refused once.
    for n, content in ((7, b"{" * 70_000), (9, b"\x00not json")):
        folder = checkpoints / f"checkpoint_{n}"
        folder.mkdir()
        (folder / ".accelkit-save.json").write_bytes(content)
        with pytest.raises(CheckpointError, match=f"checkpoint_{n} already exists"):
            accelerator.save_state()
        assert accelerator.save_state().endswith(f"checkpoint_{n + 1}")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    last = accelerator.save_state()
    fresh, fresh_model, _ = _accelerator(project)
    fresh.load_state()  # the newest is the last save, the only one holding 7.0
    assert all(bool((v == 7.0).all()) for v in fresh_model.state_dict().values()), last
