"""Aim, for real and local: a killed job resumes into the same run with each step once, a
checkpoint cannot send the tracker to another run's files, a run another process holds is not
forced open, and Accelerate's ways of logging to Aim work. Every value is read back with Aim's
own ``Repo``. The shipped contract runs in ``test_conformance.py``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.trackers.backends.aim import AimTracker, run_hash_of
from tests.helpers.preloaded import Preloaded
from tests.trackers.conftest import job_env, run_job
from tests.trackers.readers import aim_metrics, aim_runs

pytest.importorskip("aim", reason="aim (accelkit[aim]) is not installed")

QUIET = {"system_tracking_interval": None, "capture_terminal_logs": False}
# Another process that opens a run, logs one point and holds the run until it is killed.
HOLD = """
import sys, time
from aim import Run
run = Run(repo=sys.argv[1], system_tracking_interval=None, capture_terminal_logs=False)
run.track(5.0, name="loss", step=9)
print(run.hash, flush=True)
time.sleep(600)
"""


def _job(jobs: Preloaded, project: Path, *args: str, killed: bool = False) -> None:
    done = run_job(
        jobs, "-m", "tests.trackers.resume_job", "--project", str(project),
        "--log-with", "aim", *args, timeout=300,
    )  # fmt: skip
    expected = -signal.SIGKILL if killed else 0
    assert done.returncode == expected, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_killed_job_resumes_into_the_same_aim_run_each_step_once(
    tmp_path: Path, jobs: Preloaded
) -> None:
    project = tmp_path / "project"
    # Aim's own defaults (system metrics, terminal capture), as Accelerate's tracker runs them.
    _job(jobs, project, "--kill-at", "150", killed=True)
    (run,) = aim_runs(str(project)).values()
    # What the killed attempt left: steps 0..150, the ones after the checkpoint included, and
    # the run's lock, held by a process that is gone.
    assert aim_metrics(run)["loss"][-1] == (150, 150.0)
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())
    experiment = manifest["experiment"]
    assert experiment["runs"]["aim"] == {"run_hash": run.hash}
    assert run.hash == run_hash_of(experiment["key"])  # named before it opened

    _job(jobs, project, "--resume", "--attempt", "1")
    runs = aim_runs(str(project))
    assert list(runs) == [run.hash]  # the same run, no second one
    expected = [(s, float(s)) for s in range(101)] + [(s, s + 1000.0) for s in range(101, 200)]
    assert aim_metrics(runs[run.hash])["loss"] == expected
    assert runs[run.hash].name == "run" and runs[run.hash]["hparams"] == {"lr": 0.1}


def _resume_job(project: Path, steps: range, *, save_at: int | None, load: bool) -> str:
    """Log ``loss`` (and ``extra`` after step 3) at ``steps`` in one process; returns the run."""
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with="aim", project_config=config)
    accelerator.init_trackers("run", init_kwargs={"aim": QUIET})
    accelerator.prepare(torch.nn.Linear(2, 2))
    if load:
        accelerator.load_state()
    for step in steps:
        values: dict[str, Any] = {"loss": float(step + 100 * load), "note": f"{load} at {step}"}
        if step > 3 and not load:
            values["extra"] = 1.0  # only the abandoned attempt logs it, after the checkpoint
        accelerator.log(values, step=step)
        if step == save_at:
            accelerator.save_state()
    run_hash: str = accelerator.get_tracker("aim").run_reference()["run_hash"]
    accelerator.end_training()
    return run_hash


def test_a_resume_forgets_every_sequence_after_the_checkpoint(tmp_path: Path) -> None:
    first = _resume_job(tmp_path, range(0, 8), save_at=2, load=False)
    second = _resume_job(tmp_path, range(3, 5), save_at=None, load=True)
    assert first == second
    (run,) = aim_runs(str(tmp_path)).values()
    metrics = {k: v for k, v in aim_metrics(run).items() if not k.startswith("checkpoint/")}
    # Steps 5-7 of the abandoned attempt are gone although the resumed one never logged them;
    # "extra", logged only after the checkpoint, has no point left (Aim's index, which only
    # ever adds, may still list it: as it does for a parameter deleted with `del run[key]`).
    assert metrics.pop("extra", []) == []
    assert metrics == {"loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]}
    from aim.storage.context import Context

    steps, (notes,) = run.get_text_sequence("note", Context({})).data.view("val").items_list()
    assert [(at, note.data) for at, note in zip(steps, notes)] == [
        *((at, f"False at {at}") for at in range(3)),
        *((at, f"True at {at}") for at in range(3, 5)),
    ]  # a sequence of objects (Aim keys them by the step itself) is cut the same way
    summary = run.meta_run_tree["traces"]
    (names,) = summary.values()
    assert names["loss"]["last_step"] == 4
    assert names["loss"]["last"] == 104.0 and names["loss"]["max"] == 104.0


def test_a_reference_that_is_not_an_aim_hash_starts_a_new_run(tmp_path: Path) -> None:
    tracker = AimTracker("run", str(tmp_path), **QUIET)
    named = tracker.name_run("k" * 32)
    assert named == {"run_hash": run_hash_of("k" * 32)}
    for crafted in ("../../outside", "A" * 24, 7, "0" * 23):
        with pytest.warns(UserWarning, match=r"is not an Aim run hash.*new run"):
            tracker.continue_run({"run_hash": crafted}, 3)
        assert tracker._resume_step is None
    tracker.start()
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert list(aim_runs(str(tmp_path))) == [named["run_hash"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".aim"]


def test_a_run_held_by_a_live_process_is_not_forced_open(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
        env=job_env(),
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        held = holder.stdout.readline().strip()
        assert len(held) == 24, held
        tracker = AimTracker("run", str(tmp_path), **QUIET)
        tracker.name_run("k" * 32)
        tracker.continue_run({"run_hash": held}, 3)
        with pytest.warns(UserWarning, match=rf"run {held} is held by another process"):
            tracker.start()
        assert tracker.writer.hash != held
        tracker.log({"loss": 1.0}, step=4)
        tracker.finish()
    finally:
        holder.kill()
        holder.wait()
    runs = aim_runs(str(tmp_path))
    assert aim_metrics(runs[held])["loss"] == [(9, 5.0)]  # its points stay
    assert aim_metrics(runs[tracker.writer.hash])["loss"] == [(4, 1.0)]


def test_accelerates_idioms_text_distributions_and_images(tmp_path: Path) -> None:
    accelerator = Accelerator(log_with="aim", project_dir=str(tmp_path))
    accelerator.init_trackers(
        "idioms", config={"lr": 0.1}, init_kwargs={"aim": {"experiment": "exp1", **QUIET}}
    )
    for step in range(2):
        accelerator.log(
            {"note": f"at {step}", "weights": torch.arange(4.0)},
            step=step,
            log_kwargs={"aim": {"context": {"subset": "train"}}},
        )
    picture = np.zeros((8, 6, 3), dtype=np.uint8)
    tracker = accelerator.get_tracker("aim")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            tracker.log({"blob": object()}, step=step, context={"subset": "train"})
    tracker.log_images(
        {"sample": (picture, "a caption"), "chw": torch.rand(3, 4, 5)},
        step=1,
        kwargs={"aim_image": {"format": "png"}, "track": {"context": {"subset": "val"}}},
    )
    accelerator.end_training()
    blob_warnings = [str(w.message) for w in caught if "'blob'" in str(w.message)]
    assert len(blob_warnings) == 1 and "logged to Aim as its text" in blob_warnings[0]

    (run,) = aim_runs(str(tmp_path)).values()
    assert run.name == "idioms" and run.experiment == "exp1" and run["hparams"] == {"lr": 0.1}
    from aim.storage.context import Context

    train, val = Context({"subset": "train"}), Context({"subset": "val"})

    def points(sequence: Any) -> tuple[list[int], list[Any]]:
        steps, (values,) = sequence.data.view("val").items_list()
        return steps, values

    steps, texts = points(run.get_text_sequence("note", train))
    assert steps == [0, 1] and [t.data for t in texts] == ["at 0", "at 1"]
    _, weights = points(run.get_distribution_sequence("weights", train))
    assert weights[1].to_np_histogram()[0].sum() == 4  # four values in the histogram
    _, blobs = points(run.get_text_sequence("blob", train))
    assert blobs[0].data.startswith("<object object")
    steps, (image,) = points(run.get_image_sequence("sample", val))
    assert steps == [1] and image.caption == "a caption" and image.format == "png"
    assert image.to_pil_image().size == (6, 8)  # width, height of the HWC array
    _, (chw,) = points(run.get_image_sequence("chw", val))
    assert chw.to_pil_image().size == (5, 4)


def test_an_instance_given_to_log_with_is_started_and_its_empty_run_discarded(
    tmp_path: Path,
) -> None:
    project = tmp_path / "p"
    first = _resume_job(project, range(0, 3), save_at=2, load=False)
    tracker = AimTracker("run", str(project), **QUIET)
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(log_with=[tracker], project_config=config)
    accelerator.init_trackers("run")
    opened = tracker.writer.hash  # started by init_trackers, as Accelerate does
    assert opened != first
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.load_state()  # the empty run is given up for the checkpoint's
    accelerator.log({"loss": 50.0}, step=3)
    accelerator.end_training()
    runs = aim_runs(str(project))
    assert list(runs) == [first]
    assert aim_metrics(runs[first])["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 50.0)]
