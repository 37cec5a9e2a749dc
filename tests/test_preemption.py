"""Preemption and save decisions on one process (issue 25): real signals to this process, real
checkpoints on disk, resumed runs compared bitwise. The 2-process cases are in
``tests/distributed/test_preemption.py``; the launcher's pass-through in
``tests/examples/test_slurm.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.manifest import Manifest, ManifestError
from accelkit.cli.main import main
from accelkit.errors import ConfigurationError
from accelkit.runtime.preemption import Agreement, PreemptionExit, SignalFlag, parse_signals
from accelkit.runtime.saving import AnyOf, EveryNSteps, EverySeconds, SaveDecider
from tests.helpers.preemption_job import train


def _manifests(project: Path) -> list[dict[str, Any]]:
    root = project / "checkpoints"
    found = [json.loads((p / "accelkit.json").read_text()) for p in root.iterdir()]
    return sorted(found, key=lambda m: m["iteration"])


# ---------------------------------------------------------------------- construction errors


@pytest.mark.parametrize(
    ("settings", "named", "fix"),
    [
        ({"save_every_steps": 0}, "save_every_steps=0", "> 0"),
        ({"save_every_steps": -3}, "save_every_steps=-3", "> 0"),
        ({"save_every_steps": 2.5}, "save_every_steps=2.5", "whole number"),
        ({"save_every_steps": True}, "save_every_steps=True", "whole number"),
        ({"save_every_seconds": 0}, "save_every_seconds=0", "> 0"),
        ({"save_every_seconds": math.nan}, "save_every_seconds=nan", "> 0"),
        ({"save_every_seconds": "60"}, "save_every_seconds='60'", "number of seconds"),
        ({"preemption_signals": ("SIGTERM", "SIGNOPE")}, "'SIGNOPE'", "SIGUSR1"),
        ({"preemption_signals": ("SIGKILL",)}, "SIGKILL cannot be caught", "SIGTERM"),
        ({"preemption_signals": (int(signal.SIGKILL),)}, "SIGKILL", "SIGTERM"),
        ({"preemption_signals": ("SIGSTOP",)}, "SIGSTOP", "SIGTERM"),
        ({"preemption_signals": (4096,)}, "4096", "SIGTERM"),
        ({"preemption_signals": (1.5,)}, "1.5", "SIGTERM"),
        ({"preemption_exit_code": 256}, "preemption_exit_code=256", "0 to 255"),
        ({"preemption_exit_code": -1}, "preemption_exit_code=-1", "0 to 255"),
    ],
)
def test_bad_settings_fail_at_construction_naming_value_and_fix(
    settings: dict[str, Any], named: str, fix: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        ProjectConfiguration(**settings)
    message = str(raised.value)
    assert named in message and fix in message
    assert isinstance(raised.value, ValueError)  # as the reference raises bad arguments


def test_bad_setting_fails_in_accelerator_before_any_handler_is_installed(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(ConfigurationError, match="SIGKILL"):
        Accelerator(
            cpu=True,
            project_config=ProjectConfiguration(
                project_dir=str(tmp_path), preemption_signals=("SIGUSR2", "SIGKILL")
            ),
        )
    assert signal.getsignal(signal.SIGUSR2) == before


def test_signal_names_and_numbers() -> None:
    term, usr1 = int(signal.SIGTERM), int(signal.SIGUSR1)
    assert parse_signals(("SIGTERM", "usr1", usr1, signal.SIGTERM)) == (term, usr1)
    assert parse_signals("SIGUSR1") == (usr1,)
    assert parse_signals(None) == ()
    config = ProjectConfiguration(preemption_signals=["SIGTERM"])  # type: ignore[arg-type]
    assert config.preemption_signals == ("SIGTERM",)


# ---------------------------------------------------------------------- the manifest's reason


def test_manifest_reason_round_trips_and_old_manifests_read_as_user() -> None:
    manifest = Manifest(iteration=3, step=30, world_size=1, files=[], reason="preemption")
    assert Manifest.from_json(manifest.to_json()).reason == "preemption"
    old = json.loads(Manifest(iteration=0, step=0, world_size=1, files=[]).to_json())
    del old["reason"]  # written before issue 25
    assert Manifest.from_json(json.dumps(old)).reason == "user"
    old["reason"] = "\x1b[2Jcosmic rays"
    with pytest.raises(ManifestError, match="reason"):
        Manifest.from_json(json.dumps(old))


# ---------------------------------------------------------------------- decisions (policy)


def test_interval_decisions_by_steps_and_by_the_main_process_clock() -> None:
    now = [0.0]
    decider = SaveDecider(
        Agreement(1),
        SignalFlag(()),
        AnyOf(EveryNSteps(5), EverySeconds(10.0)),
        is_main=True,
        clock=lambda: now[0],
    )
    decisions = []
    for step in range(1, 13):
        now[0] += 1.0
        decider.boundary(step)
        due = decider.should_save(step)
        decisions.append(due)
        if due:
            assert decider.reason(step) == "interval"
            decider.saved("interval", "checkpoint", step)
    # Every 5 steps (1 s a step: the 10 s interval never comes first).
    assert [i + 1 for i, d in enumerate(decisions) if d] == [5, 10]
    now[0] += 60.0  # a long evaluation: the wall-clock interval is due without a step
    decider.boundary(12)
    assert decider.should_save(12) and decider.reason(12) == "interval"


def test_should_save_and_preemption_requested_without_any_policy_are_false(
    tmp_path: Path,
) -> None:
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    assert accelerator.should_save() is False
    assert accelerator.preemption_requested is False


# ---------------------------------------------------------------------- real signals, 1 process


def test_signal_before_the_first_step_saves_step_0_and_exits_with_the_code(
    tmp_path: Path,
) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    result = train(str(tmp_path), total=8, where="before", signum="SIGUSR1")
    assert result["exit"] == 75
    (manifest,) = _manifests(tmp_path)
    assert (manifest["step"], manifest["reason"]) == (0, "preemption")
    # The handlers are put back on the way out.
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_preemption_exit_waits_for_the_remote_tier_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 26 item 5: with replicate_to, the exit waits (up to replicate_preemption_seconds)
    until the preemption checkpoint is committed on the remote tier, and logs that it is."""
    remote = tmp_path / "remote"
    with caplog.at_level("WARNING", logger="accelkit"):
        result = train(
            str(tmp_path / "local"), total=8, where="backward", signal_at=3,
            replicate_to=str(remote),
        )  # fmt: skip
    assert result["exit"] == 75
    (local,) = _manifests(tmp_path / "local")
    (copied,) = _manifests(remote)
    assert copied == local and copied["reason"] == "preemption"
    assert any("is on the remote tier" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.slow
def test_a_preemption_exit_waits_no_longer_than_its_deadline_for_a_dead_remote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An object store that refuses every connection: the exit gives up after
    replicate_preemption_seconds (not replicate_deadline_seconds' 300 s), names what is left,
    and the local preemption checkpoint is committed."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    options = {
        "replicate_preemption_seconds": 2.0,
        "storage_options": {
            "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        },
    }  # fmt: skip
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="accelkit"):
        result = train(
            str(tmp_path / "local"), total=8, where="backward", signal_at=3,
            replicate_to="s3://nowhere/run", replicate_options=options,
        )  # fmt: skip
    assert result["exit"] == 75
    assert time.monotonic() - started < 120  # the 300 s default would hold it far longer
    (local,) = _manifests(tmp_path / "local")
    assert local["reason"] == "preemption"
    assert "ckpt sync" in caplog.text and "is on the remote tier" not in caplog.text


@pytest.mark.slow
def test_a_loop_that_asks_leaves_within_the_preemption_deadline_for_a_dead_remote(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37 item 7h: the guide's loop that asks (``end_training(); sys.exit(75)``) drains
    the replication queue for replicate_preemption_seconds once a preemption is pending, not
    for replicate_deadline_seconds (60 s here, 300 s by default)."""
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    options = {
        "replicate_preemption_seconds": 2.0,
        "replicate_deadline_seconds": 60.0,
        "storage_options": {
            "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        },
    }  # fmt: skip
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="accelkit"):
        result = train(
            str(tmp_path / "local"), total=8, mode="explicit", where="backward", signal_at=3,
            replicate_to="s3://nowhere/run", replicate_options=options,
        )  # fmt: skip
    assert result["exit"] == 75
    assert time.monotonic() - started < 40  # replicate_deadline_seconds would hold it 60 s
    (local,) = _manifests(tmp_path / "local")
    assert local["reason"] == "preemption"
    assert "not replicated: checkpoint_0" in caplog.text and "ckpt sync" in caplog.text


# While step 10 runs (counter 9): in backward, between optimizer.step() and scheduler.step();
# or in the evaluation after step 10 (counter 10). All save step 10, at the next batch.
@pytest.mark.slow
@pytest.mark.parametrize(("where", "at"), [("backward", 9), ("step", 9), ("eval", 10)])
def test_unchanged_script_preempted_resumes_bitwise_equal(
    tmp_path: Path, where: str, at: int
) -> None:
    settings: dict[str, Any] = {"total": 16, "eval_every": 5, "save_every": 6}
    reference = train(str(tmp_path / "reference"), **settings)
    project = str(tmp_path / "run")
    first = train(project, **settings, where=where, signal_at=at, signum="SIGTERM")
    assert first["exit"] == 75
    manifests = _manifests(Path(project))
    # save_state() of the script at 6, then the preemption at the step the signal came in.
    assert [(m["step"], m["reason"]) for m in manifests] == [(6, "user"), (10, "preemption")]
    resumed = train(project, **settings, resume=True)
    assert resumed["steps"] == reference["steps"] == 16
    assert resumed["digest"] == reference["digest"]


@pytest.mark.slow
def test_signal_during_an_async_save_commits_it_and_makes_no_second_checkpoint(
    tmp_path: Path,
) -> None:
    settings: dict[str, Any] = {"total": 16, "save_every": 6, "async_save": True}
    reference = train(str(tmp_path / "reference"), **settings)
    project = str(tmp_path / "run")
    # The signal arrives right after save_state(async_save=True) returned, while the writer
    # thread still writes: the save in flight is committed and it is the newest state.
    first = train(project, **settings, where="async", signal_at=6)
    assert first["exit"] == 75
    manifests = _manifests(Path(project))
    assert [(m["step"], m["reason"]) for m in manifests] == [(6, "user")]
    assert main(["ckpt", "verify", str(Path(project) / "checkpoints")]) == 0
    resumed = train(project, **settings, resume=True)
    assert resumed["digest"] == reference["digest"]


def test_a_script_that_asks_saves_itself_once(tmp_path: Path) -> None:
    settings: dict[str, Any] = {"total": 16, "mode": "explicit"}
    reference = train(str(tmp_path / "reference"), **settings)
    project = str(tmp_path / "run")
    first = train(project, **settings, where="backward", signal_at=4)
    assert first["exit"] == 75  # the script's own sys.exit after preemption_requested
    # One preemption, one checkpoint: the script's own, made when should_save() said so.
    assert [(m["step"], m["reason"]) for m in _manifests(Path(project))] == [(5, "preemption")]
    assert train(project, **settings, resume=True)["digest"] == reference["digest"]


def test_ls_shows_the_reason_and_the_tracker_event_carries_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, preemption_signals="SIGUSR1"
    )
    accelerator = Accelerator(cpu=True, project_config=config, log_with="jsonl")
    accelerator.init_trackers("run")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    model, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=2)
    )
    accelerator.save_state()  # the user's
    with pytest.raises(PreemptionExit) as stopped:
        for (x,) in loader:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": 1.0})
            os.kill(os.getpid(), signal.SIGUSR1)
    # The documented exception, a SystemExit with the exit code, saying what was saved.
    assert isinstance(stopped.value, SystemExit) and stopped.value.code == 75
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGUSR1, 1)
    assert stopped.value.checkpoint == accelerator._checkpointing.last_path
    capsys.readouterr()
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "REASON" in table[0].split()
    assert "user" in table[1].split() and "preemption" in table[2].split()
    assert main(["ckpt", "ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(i["step"], i["reason"]) for i in listed] == [(0, "user"), (1, "preemption")]
    rows = [json.loads(line) for line in next(tmp_path.rglob("*.jsonl")).read_text().splitlines()]
    saves = [r for r in rows if r.get("event") == "checkpoint_save"]
    assert [r["reason"] for r in saves] == ["user", "preemption"]
    assert saves[1]["values"]["checkpoint/preemption"] == 1.0
    assert "checkpoint/preemption" not in saves[0]["values"]


def _accumulating(project: str, micro_steps: int, signal_after: int = -1) -> Any:
    """2 micro-steps per optimizer step; SIGUSR1 after micro-step ``signal_after``."""
    config = ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, preemption_signals=("SIGUSR1",)
    )
    accelerator = Accelerator(cpu=True, project_config=config, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if os.path.isdir(os.path.join(project, "checkpoints")):
        accelerator.load_state()
    done = accelerator.gradient_state.optimizer_steps * 2
    try:
        while done < micro_steps:
            for x, y in loader:
                if done >= micro_steps:
                    break
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                done += 1
                if done == signal_after:
                    os.kill(os.getpid(), signal.SIGUSR1)
    except SystemExit as exc:
        return exc.code
    state = [t.clone() for t in model.state_dict().values()], torch.get_rng_state()
    accelerator.end_training()
    return state


def test_accumulated_gradients_are_never_saved_half_way(tmp_path: Path) -> None:
    reference = _accumulating(str(tmp_path / "reference"), 40)
    project = str(tmp_path / "run")
    # After micro-step 13, whose gradients wait for micro-step 14: the save comes after it.
    assert _accumulating(project, 40, signal_after=13) == 75
    assert [(m["step"], m["reason"]) for m in _manifests(Path(project))] == [(7, "preemption")]
    params, rng = _accumulating(project, 40)
    assert all(torch.equal(a, b) for a, b in zip(params, reference[0], strict=True))
    assert torch.equal(rng, reference[1])


# ---------------------------------------------------------------------- the exit record (untrusted)


def _read_soon(path: Path, job: str | None) -> dict[str, Any] | None:
    """read_exit_record in a thread, failing the test if it does not return within 5 s."""
    import threading

    from accelkit.runtime.preemption import read_exit_record

    found: list[Any] = []
    reader = threading.Thread(target=lambda: found.append(read_exit_record(str(path), job)))
    reader.daemon = True
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), f"read_exit_record({path}) hangs"
    return found[0]  # type: ignore[no-any-return]


def test_the_exit_record_round_trips_with_its_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelkit.runtime.preemption import ENV_PREEMPTION_JOB, write_exit_record

    path = tmp_path / "preempted.json"
    monkeypatch.setenv(ENV_PREEMPTION_JOB, "job-a")
    write_exit_record(str(path), {"exit_code": 75, "signal": "SIGUSR1", "step": 3})
    assert (path.stat().st_mode & 0o777) == 0o600
    assert _read_soon(path, "job-a") == {
        "exit_code": 75,
        "signal": "SIGUSR1",
        "step": 3,
        "job": "job-a",
    }
    assert _read_soon(path, "job-b") is None  # a record of another job is not this job's
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_writing_the_record_never_follows_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelkit.runtime.preemption import ENV_PREEMPTION_JOB, write_exit_record

    monkeypatch.delenv(ENV_PREEMPTION_JOB, raising=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "preempted.json"
    (tmp_path / f"preempted.json.{os.getpid()}.tmp").symlink_to(victim)
    write_exit_record(str(path), {"exit_code": 75})
    assert victim.read_text() == "precious"
    assert json.loads(path.read_text()) == {"exit_code": 75}


@pytest.mark.parametrize(
    "plant",
    ["symlink", "fifo", "huge", "garbage", "not-utf8", "deep", "list", "bool", "range", "no-job"],
)
def test_an_untrusted_exit_record_is_refused_without_hanging(tmp_path: Path, plant: str) -> None:
    # Each is what a script (or anyone who can write the launcher's folder) could leave where
    # the launcher looks; none may hang, crash or make a failure read as a preemption.
    path = tmp_path / "preempted.json"
    good = {"exit_code": 75, "job": "job-a"}
    if plant == "symlink":  # to a record that would be accepted if followed
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        path.symlink_to(tmp_path / "elsewhere.json")
    elif plant == "fifo":  # opening it for reading would wait for a writer forever
        os.mkfifo(path)
    elif plant == "huge":  # a valid record padded past the limit
        path.write_text(json.dumps({**good, "pad": "x" * (1 << 20)}))
    elif plant == "garbage":
        path.write_bytes(b'{"exit_code": 75, "job": "job-a"')
    elif plant == "not-utf8":
        path.write_bytes(b'{"exit_code": 75, "job": "\xff\xfe"}')
    elif plant == "deep":
        path.write_text("[" * 50000 + "]" * 50000)
    elif plant == "list":
        path.write_text(json.dumps([good]))
    elif plant == "bool":
        path.write_text(json.dumps({**good, "exit_code": True}))
    elif plant == "range":
        path.write_text(json.dumps({**good, "exit_code": 75 + 256}))
    elif plant == "no-job":
        path.write_text(json.dumps({"exit_code": 75}))
    started = time.monotonic()
    assert _read_soon(path, "job-a") is None
    assert time.monotonic() - started < 2


SPAWNED_LOADER_JOB = """
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
from accelkit import Accelerator, ProjectConfiguration

if __name__ == "__main__":
    config = ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True, preemption_signals=("SIGUSR1",)
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(
        data, batch_size=4, num_workers=1, multiprocessing_context="spawn", persistent_workers=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        if step == 1:
            # What SLURM's --signal=USR1@N (without B:) does: every process of the job step.
            workers = loader._iterator._workers
            for worker in workers:
                os.kill(worker.pid, signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1.0)
            print("workers alive:", all(w.is_alive() for w in workers), flush=True)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    print("not preempted", flush=True)
"""


@pytest.mark.slow
def test_a_signal_to_every_process_spares_spawned_dataloader_workers(tmp_path: Path) -> None:
    """A spawned DataLoader worker is a fresh interpreter in which SIGUSR1 terminates: without
    the watched signals blocked while workers start, the job step's signal killed the worker
    and the training process failed on its next batch instead of saving."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(SPAWNED_LOADER_JOB)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "project")],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert "workers alive: True" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 75, result.stdout + result.stderr
    (manifest,) = _manifests(tmp_path / "project")
    assert manifest["reason"] == "preemption"
