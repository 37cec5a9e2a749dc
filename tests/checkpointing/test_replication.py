"""Local-first checkpoints replicated to a remote tier (issue #26), against SeaweedFS.

The remote tier is a real S3 server on 127.0.0.1 reached through a fault-injecting TCP proxy
(:class:`tests.helpers.faultproxy.FaultProxy`): outages, dropped and reset connections are
the ones the network stack really produces.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.listing import list_checkpoints
from accelkit.checkpointing.catalog.retention import AnyOf, KeepAll, KeepEvery, KeepLast
from accelkit.checkpointing.formats.manifest import Manifest, read_manifest, resumed_of
from accelkit.checkpointing.replication import Replicator
from accelkit.checkpointing.storage import get_storage, join
from accelkit.cli.main import main as cli
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

pytest.importorskip("s3fs", reason="the remote tier is S3: pip install 'accelkit[s3]'")

REPO = Path(__file__).resolve().parents[2]


class Blob:
    """A registered object whose state is one tensor."""

    def __init__(self, numel: int, seed: int) -> None:
        self.data = torch.randn(numel, generator=torch.Generator().manual_seed(seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"data": self.data}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.data = state["data"]


def _options(server: S3Server, proxy: FaultProxy | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {
        **server.storage_options,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
    }
    if proxy is not None:
        options["endpoint_url"] = proxy.endpoint_url
    return options


def _run(
    local: str, remote: str, options: dict[str, Any], seed: int = 0, **config: Any
) -> tuple[Accelerator, nn.Module, Blob]:
    cfg = ProjectConfiguration(
        project_dir=local,
        automatic_checkpoint_naming=True,
        replicate_to=remote,
        storage_options=options,
        **config,
    )
    accelerator = Accelerator(project_config=cfg, cpu=True)
    torch.manual_seed(seed)
    model = nn.Linear(32, 32)
    accelerator.prepare(model)
    blob = Blob(50_000, seed)
    accelerator.register_for_checkpointing(blob)
    return accelerator, model, blob


def _states(url: str, options: dict[str, Any]) -> dict[str, str]:
    root = join(url, "checkpoints")
    storage = get_storage(root, options)
    storage.invalidate()
    return {i.name: i.state for i in list_checkpoints(storage, root)}


def _committed(url: str, options: dict[str, Any]) -> list[str]:
    return sorted(n for n, s in _states(url, options).items() if s == "committed")


def _flags(options: dict[str, Any]) -> list[str]:
    flags = []
    for key, value in options.items():
        if key == "config_kwargs":
            continue
        flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return flags


@pytest.mark.slow
def test_outage_during_replication_is_survived_and_completes_later(
    s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = s3_server.new_prefix()
    with FaultProxy(("127.0.0.1", s3_server.port), seed=1) as proxy:
        accelerator, _, blob = _run(str(tmp_path / "run"), remote, _options(s3_server, proxy))
        proxy.drop_fraction = 0.3
        accelerator.save_state()
        proxy.down_for(3.0)  # the remote tier is gone while the run saves twice
        for _ in range(2):
            blob.data += 1
            accelerator.save_state()  # returns: a local save never waits for the remote tier
        assert proxy.down
        assert not accelerator._checkpoints.wait_replicated(0.5)  # not yet: the outage
        assert accelerator._checkpoints.wait_replicated(60)  # after it: everything is there
        assert proxy.dropped > 0
        accelerator.end_training()
    options = _options(s3_server)
    assert _committed(remote, options) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    capsys.readouterr()
    assert cli(["ckpt", "verify", join(remote, "checkpoints"), *_flags(options)]) == 0
    assert capsys.readouterr().out.count("OK") == 3


@pytest.mark.slow
def test_hard_error_is_reported_once_and_training_goes_on(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    remote = s3_server.new_prefix()
    options = {**_options(s3_server), "secret": "not-the-secret"}
    accelerator, _, _ = _run(str(tmp_path / "run"), remote, options, replicate_deadline_seconds=5)
    with caplog.at_level(logging.WARNING, logger="accelkit.checkpointing.replication"):
        for _ in range(3):
            accelerator.save_state()  # never raises
        assert not accelerator._checkpoints.wait_replicated(20)
        accelerator.end_training()
    # this run's replicator only (a replicator of an earlier test may still be winding down)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and remote in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    message = errors[0].getMessage()
    assert "secret" in message and "Fix:" in message, message
    left = [r for r in caplog.records if "not replicated" in r.getMessage()]
    assert left and "accelkit ckpt sync" in left[-1].getMessage()
    # Every checkpoint is named, also those saved after the error stopped replication.
    assert "checkpoint_0, checkpoint_1, checkpoint_2" in left[-1].getMessage()
    local = _states(str(tmp_path / "run"), {})
    assert sorted(local) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


@pytest.mark.slow
def test_lost_local_tier_resumes_from_remote_bitwise(s3_server: S3Server, tmp_path: Path) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    options = _options(s3_server)
    accelerator, model, blob = _run(local, remote, options)
    accelerator.save_state()
    blob.data *= 2
    with torch.no_grad():
        model.weight += 1
    accelerator.save_state()
    accelerator.end_training()
    assert _committed(remote, options) == ["checkpoint_0", "checkpoint_1"]

    shutil.rmtree(local)  # a new machine: the local disk is gone
    fresh, fresh_model, fresh_blob = _run(local, remote, options, seed=7)
    loaded = fresh.load_state()
    assert loaded == join(remote, "checkpoints", "checkpoint_1")
    assert torch.equal(fresh_blob.data, blob.data)
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
        assert torch.equal(a, b)
    path = fresh.save_state()  # numbering continues past both tiers
    assert path == join(local, "checkpoints", "checkpoint_2")
    fresh.end_training()
    assert _committed(remote, options)[-1] == "checkpoint_2"
    # The new checkpoint says the job resumed from the remote tier (`ckpt ls`: RESUMED).
    manifest = read_manifest(get_storage(local), path)
    assert manifest is not None
    assert resumed_of(manifest) == {"tier": "remote", "checkpoint": "checkpoint_1", "step": 0}


def test_newest_on_either_tier_intact_local_preferred(s3_server: S3Server, tmp_path: Path) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    options = _options(s3_server)
    accelerator, _, _ = _run(local, remote, options)
    accelerator.save_state()
    accelerator.end_training()
    fresh, _, _ = _run(local, remote, options, seed=3)
    assert fresh.load_state() == join(local, "checkpoints", "checkpoint_0")  # local preferred
    manifest = read_manifest(get_storage(local), fresh.save_state())
    fresh.end_training()
    assert manifest is not None
    assert resumed_of(manifest) == {"tier": "local", "checkpoint": "checkpoint_0", "step": 0}


@pytest.mark.slow
def test_retention_per_tier(s3_server: S3Server, tmp_path: Path) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    options = _options(s3_server)
    accelerator, _, _ = _run(local, remote, options, total_limit=1, replicate_keep=2)
    for _ in range(4):
        accelerator.save_state()
        assert accelerator._checkpoints.wait_replicated(30)
    accelerator.save_state()
    accelerator.end_training()
    assert _committed(remote, options) == ["checkpoint_3", "checkpoint_4"]
    assert sorted(_states(local, {})) == ["checkpoint_4"]


@pytest.mark.slow
def test_local_retention_keeps_what_is_not_replicated(s3_server: S3Server, tmp_path: Path) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        accelerator, _, _ = _run(local, remote, _options(s3_server, proxy), total_limit=1)
        proxy.down_for(3600)
        for _ in range(3):
            accelerator.save_state()
        # total_limit=1, but none of them reached the remote tier: all are kept locally
        assert sorted(_states(local, {})) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
        proxy.up()
        assert accelerator._checkpoints.wait_replicated(60)
        accelerator.save_state()  # its retention may now delete the replicated ones
        accelerator.end_training()
    assert sorted(_states(local, {})) == ["checkpoint_3"]
    assert _committed(remote, _options(s3_server)) == [
        "checkpoint_0",
        "checkpoint_1",
        "checkpoint_2",
        "checkpoint_3",
    ]


_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch import nn
    from accelkit import Accelerator, ProjectConfiguration

    local, remote, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    config = ProjectConfiguration(project_dir=local, automatic_checkpoint_naming=True,
                                  replicate_to=remote, storage_options=options)
    accelerator = Accelerator(project_config=config, cpu=True)
    model = nn.Linear(8, 8)
    accelerator.prepare(model)

    class Big:
        def __init__(self):
            self.data = torch.arange(6_000_000, dtype=torch.float32)
        def state_dict(self):
            return {"data": self.data}
        def load_state_dict(self, state):
            self.data = state["data"]

    accelerator.register_for_checkpointing(Big())
    accelerator.save_state()
    print("saved", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_kill_during_upload_commits_nothing_remote_and_next_run_catches_up(
    s3_server: S3Server, tmp_path: Path
) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.bytes_per_second = 2_000_000  # a 24 MB upload takes ~12 s: the kill lands inside
        options = _options(s3_server, proxy)
        script = tmp_path / "child.py"
        script.write_text(_CHILD)
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        child = subprocess.Popen(
            [sys.executable, str(script), local, remote, json.dumps(options)],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"saved"
            target = join(remote, "checkpoints", "checkpoint_0")
            storage = get_storage(target, _options(s3_server))
            deadline = time.monotonic() + 60
            while not storage.exists(join(target, ".accelkit-save.json")):
                assert time.monotonic() < deadline, "the upload never started"
                time.sleep(0.05)
            time.sleep(1.0)  # some bytes of the big file are on their way
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        proxy.bytes_per_second = None
        proxy.cut_all()
        states = _states(remote, _options(s3_server))
        assert states.get("checkpoint_0") == "incomplete", states  # never committed
        assert _states(local, {}) == {"checkpoint_0": "committed"}

        # The next run: its replicator catches up on what the killed one left behind.
        accelerator, _, _ = _run(local, remote, options)
        assert accelerator._checkpoints.wait_replicated(60)
        accelerator.end_training()
    assert _committed(remote, _options(s3_server)) == ["checkpoint_0"]
    assert cli(["ckpt", "verify", join(remote, "checkpoints"), *_flags(_options(s3_server))]) == 0


@pytest.mark.slow
def test_ckpt_ls_tier_and_sync(
    s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    options = _options(s3_server)
    flags = _flags(options)
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        accelerator, _, _ = _run(local, remote, _options(s3_server, proxy))
        accelerator.save_state()
        assert accelerator._checkpoints.wait_replicated(30)
        proxy.down_for(3600)  # the run ends before its queue drains
        accelerator.save_state()
        accelerator.save_state()
        left = accelerator._checkpoints.close_replication(0.5)
        assert left == ["checkpoint_1", "checkpoint_2"]

    capsys.readouterr()
    assert cli(["ckpt", "ls", local, "--remote", remote, "--json", *flags]) == 0
    rows = {r["name"]: r["tier"] for r in json.loads(capsys.readouterr().out)}
    assert rows == {"checkpoint_0": "both", "checkpoint_1": "local", "checkpoint_2": "local"}

    assert cli(["ckpt", "sync", local, remote, "--json", *flags]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(c["name"] for c in result["copied"]) == ["checkpoint_1", "checkpoint_2"]
    assert result["left"] == [] and result["error"] is None

    shutil.rmtree(Path(local) / "checkpoints" / "checkpoint_0")
    assert cli(["ckpt", "ls", local, "--remote", remote, *flags]) == 0
    table = capsys.readouterr().out
    assert "TIER" in table
    tiers = ("local", "remote", "both")
    lines = {
        line.split()[0]: next(t for t in line.split() if t in tiers)
        for line in table.splitlines()[1:]
        if line
    }
    assert lines == {"checkpoint_0": "remote", "checkpoint_1": "both", "checkpoint_2": "both"}

    # sync again: nothing to copy
    assert cli(["ckpt", "sync", local, remote, *flags]) == 0
    assert "nothing to copy" in capsys.readouterr().out


def test_replication_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"replicate_keep has unknown keys \['keep'\]"):
        ProjectConfiguration(
            project_dir=str(tmp_path), replicate_to="memory://r", replicate_keep={"keep": 2}
        )
    with pytest.raises(ValueError, match=r"ProjectConfiguration: replicate_keep .*0"):
        ProjectConfiguration(project_dir=str(tmp_path), replicate_to="memory://r", replicate_keep=0)
    with pytest.raises(ValueError, match="location of its own"):
        ProjectConfiguration(project_dir=str(tmp_path), replicate_to=str(tmp_path))
    with pytest.raises(ValueError, match="replicate_queue_size"):
        ProjectConfiguration(project_dir=str(tmp_path), replicate_queue_size=0)
    policy = ProjectConfiguration(
        replicate_keep={"total_limit": 2, "keep_every": 10}
    ).remote_retention_policy()
    assert "KeepLast(count=2)" in repr(policy) and "KeepEvery(every=10)" in repr(policy)


def test_trackers_get_replication_seconds_and_lag(s3_server: S3Server, tmp_path: Path) -> None:
    from accelkit.trackers.backends.jsonl import read_jsonl
    from tests.trackers.readers import read_tensorboard

    remote = s3_server.new_prefix()
    local = tmp_path / "run"
    cfg = ProjectConfiguration(
        project_dir=str(local),
        automatic_checkpoint_naming=True,
        replicate_to=remote,
        storage_options=_options(s3_server),
    )
    accelerator = Accelerator(project_config=cfg, cpu=True, log_with=["jsonl", "tensorboard"])
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.prepare(nn.Linear(4, 4))
    accelerator.log({"loss": 1.0}, step=5)
    accelerator.save_state()
    assert accelerator._checkpoints.wait_replicated(30)
    accelerator.end_training()
    rows = [r for r in read_jsonl(str(local / "run")) if r.get("event") == "checkpoint_replicate"]
    assert len(rows) == 1, rows
    assert rows[0]["path"] == join(remote, "checkpoints", "checkpoint_0")
    assert rows[0]["step"] == 5
    values = rows[0]["values"]
    assert values["checkpoint/replication_seconds"] > 0
    assert values["checkpoint/replication_lag_seconds"] >= values["checkpoint/replication_seconds"]
    scalars, _ = read_tensorboard(str(local), "run")
    assert [step for step, _ in scalars["checkpoint/replication_seconds"]] == [5]


@pytest.mark.parametrize(
    ("policy", "queue_size", "left"),
    [
        # the remote keeps the newest 2: older waiting ones are skipped at once
        (KeepLast(2), 8, [4, 5]),
        # the remote keeps everything, but the queue holds 2: the oldest are skipped
        (KeepAll(), 2, [4, 5]),
        # keep_every=2 plus the newest: those are never skipped
        (AnyOf((KeepLast(1), KeepEvery(2))), 8, [0, 2, 4, 5]),
    ],
)
def test_queue_policy_skips_intermediates_never_the_newest_or_kept(
    tmp_path: Path, policy: Any, queue_size: int, left: list[int]
) -> None:
    # Not started: the queue is inspected as a stalled replicator (remote down) leaves it.
    replicator = Replicator(
        get_storage(str(tmp_path)),
        str(tmp_path),
        get_storage("memory://unused"),
        "memory://unused",
        policy,
        queue_size=queue_size,
    )
    for n in range(6):
        manifest = Manifest(iteration=n, step=n, world_size=1, files=[], created=1000.0 + n)
        replicator.submit(str(tmp_path / "checkpoints" / f"checkpoint_{n}"), manifest)
    assert replicator.left() == [f"checkpoint_{n}" for n in left]
    unreplicated = {str(tmp_path / "checkpoints" / f"checkpoint_{n}") for n in left}
    assert replicator.unreplicated() == unreplicated  # what local retention holds back


_EXITS = textwrap.dedent(
    """
    import json, sys
    from torch import nn
    from accelkit import Accelerator, ProjectConfiguration

    local, remote, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    config = ProjectConfiguration(project_dir=local, automatic_checkpoint_naming=True,
                                  replicate_to=remote, storage_options=options,
                                  replicate_deadline_seconds=float(sys.argv[4]))
    accelerator = Accelerator(project_config=config, cpu=True)
    accelerator.prepare(nn.Linear(8, 8))
    accelerator.save_state()
    accelerator.save_state()
    # no end_training(): the interpreter's exit drains the queue
    """
)


@pytest.mark.slow
def test_interpreter_exit_drains_the_queue_or_names_what_is_left(
    s3_server: S3Server, tmp_path: Path
) -> None:
    script = tmp_path / "exits.py"
    script.write_text(_EXITS)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    remote = s3_server.new_prefix()
    options = _options(s3_server)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "a"), remote, json.dumps(options), "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert _committed(remote, options) == ["checkpoint_0", "checkpoint_1"]

    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.down_for(3600)
        down = _options(s3_server, proxy)
        left = subprocess.run(
            [
                sys.executable,
                str(script),
                str(tmp_path / "b"),
                remote + "-b",
                json.dumps(down),
                "1",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert left.returncode == 0, left.stderr
    assert "not replicated: checkpoint_0, checkpoint_1" in left.stderr, left.stderr
    assert "accelkit ckpt sync" in left.stderr


def test_checkpoints_the_queue_skips_are_named_once_and_in_the_summary(
    s3_server: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The remote tier is unreachable for the whole run; the queue holds 4 and total_limit=2:
    # the oldest checkpoints are skipped, and local retention may then delete them.
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    caplog.set_level(logging.WARNING, "accelkit")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.down_for(3600)
        accelerator, _, _ = _run(
            local, remote, _options(s3_server, proxy), total_limit=2, replicate_queue_size=4
        )
        for _ in range(6):
            accelerator.save_state()
        left = accelerator._checkpoints.close_replication(0.5)
        accelerator.end_training()
    on_disk = sorted(_states(local, {}))
    assert "checkpoint_0" not in on_disk  # deleted locally, never replicated
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for name in ("checkpoint_0", "checkpoint_1"):
        said = [m for m in messages if m.startswith(f"Replication skips {name}:")]
        assert len(said) == 1, messages  # once, by name, with the reason
        assert "replicate_queue_size=4" in said[0] and "accelkit ckpt sync" in said[0]
    summary = [m for m in messages if m.startswith("Replication to ")]
    assert len(summary) == 1, messages
    # Still on the local tier: left behind, copied later by `ckpt sync`.
    assert left == [n for n in on_disk if n != "checkpoint_0"]
    assert "checkpoint_1 (skipped: the replication queue was full" in summary[0]
    assert f"accelkit ckpt sync {local} {remote}" in summary[0]
    # Gone from both tiers: said as such, with the reason.
    gone = summary[0].split("no longer on the local tier either:")[1]
    assert "checkpoint_0 (skipped: the replication queue was full" in gone


_STALLED = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch import nn
    from accelkit import Accelerator, ProjectConfiguration

    local, remote, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    config = ProjectConfiguration(project_dir=local, automatic_checkpoint_naming=True,
                                  replicate_to=remote, storage_options=options,
                                  replicate_deadline_seconds=float(sys.argv[4]))
    accelerator = Accelerator(project_config=config, cpu=True)
    accelerator.prepare(nn.Linear(8, 8))

    class Big:
        def __init__(self):
            self.data = torch.arange(12_000_000, dtype=torch.float32)
        def state_dict(self):
            return {"data": self.data}
        def load_state_dict(self, state):
            self.data = state["data"]

    accelerator.register_for_checkpointing(Big())
    accelerator.save_state()
    print("saved", flush=True)
    sys.stdin.readline()  # the parent pauses the server mid-upload
    started = time.monotonic()
    accelerator.end_training()
    print(f"ended {time.monotonic() - started:.1f}", flush=True)
    """
)


@pytest.mark.slow
def test_a_stalled_remote_does_not_hold_the_interpreter_at_exit(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # The server is paused (SIGSTOP: connections accepted, never answered) while a multipart
    # upload is in flight, with s3fs's own timeouts and retries (minutes per request): the
    # process must still exit soon after the drain deadline.
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    script = tmp_path / "stalled.py"
    script.write_text(_STALLED)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    deadline = 2.0
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        proxy.bytes_per_second = 4_000_000  # a 48 MB upload takes ~12 s: the pause lands inside
        options = {**s3_server.storage_options, "endpoint_url": proxy.endpoint_url}
        child = subprocess.Popen(
            [sys.executable, str(script), local, remote, json.dumps(options), str(deadline)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        paused = False
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == b"saved"
            marker = join(remote, "checkpoints", "checkpoint_0", ".accelkit-save.json")
            storage = get_storage(marker, _options(s3_server))
            limit = time.monotonic() + 60
            while not storage.exists(marker):
                assert time.monotonic() < limit, "the upload never started"
                time.sleep(0.05)
            time.sleep(1.0)  # parts of the big file are on their way
            s3_server.process.send_signal(signal.SIGSTOP)
            paused = True
            child.stdin.write(b"go\n")
            child.stdin.flush()
            try:
                out, err = child.communicate(timeout=deadline + 45)
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
                pytest.fail(f"still running {deadline + 45:.0f} s after the pause: {out!r}")
        finally:
            if paused:
                s3_server.process.send_signal(signal.SIGCONT)
            if child.poll() is None:
                child.kill()
                child.wait()
            proxy.bytes_per_second = None
            proxy.cut_all()
    assert child.returncode == 0, err.decode(errors="replace")[-3000:]
    assert out.startswith(b"ended"), out  # end_training() returned, then the process exited
    assert b"not replicated: checkpoint_0" in err, err.decode(errors="replace")[-3000:]


_SAVE_IN_FLIGHT_AT_EXIT = textwrap.dedent(
    """
    import os, sys, time, torch
    from accelkit import Accelerator, ProjectConfiguration
    from accelkit.checkpointing.commit import async_save

    config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True,
                                  replicate_to=sys.argv[2], async_save=True,
                                  async_writer="thread", replicate_deadline_seconds=60.0)
    accelerator = Accelerator(project_config=config, cpu=True, log_with="jsonl")
    accelerator.init_trackers("exit")
    model = accelerator.prepare(torch.nn.Linear(6000, 6000))
    accelerator.save_state()
    accelerator.wait_for_checkpoints()
    first = os.path.join(sys.argv[2], "checkpoints", "checkpoint_0", "accelkit.json")
    while not os.path.exists(first):  # replicated: the queue is idle again
        time.sleep(0.05)
    with torch.no_grad():
        model.weight += 1
    accelerator.save_state()
    # no end_training(): the interpreter exits with the second save still being written
    print("in flight:", any(t.is_alive() for t in list(async_save._IN_FLIGHT)))
    """
)


def test_a_save_in_flight_at_exit_is_replicated_and_reported(tmp_path: Path) -> None:
    # The exit drains run in order: the save in flight commits, then the replication queue
    # drains (with that checkpoint), then the trackers report both. Before, the replication
    # drain (registered later, so run first) closed an idle queue and the last checkpoint
    # stayed local without a word.
    script = tmp_path / "exits.py"
    script.write_text(_SAVE_IN_FLIGHT_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    local, remote = tmp_path / "local", tmp_path / "remote"
    done = subprocess.run(
        [sys.executable, str(script), str(local), str(remote)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "in flight: True" in done.stdout, "the save finished before the exit: a bigger state"
    names = sorted(p.name for p in (remote / "checkpoints").iterdir())
    assert names == ["checkpoint_0", "checkpoint_1"], done.stderr
    assert (remote / "checkpoints" / "checkpoint_1" / "accelkit.json").is_file()
    # the trackers drained last: both events of the last checkpoint reached them
    lines = (local / "exit" / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    last = [e["event"] for e in events if e.get("path", "").endswith("checkpoint_1")]
    assert last == ["checkpoint_save", "checkpoint_replicate"], lines
