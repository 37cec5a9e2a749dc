"""``accelkit ckpt ls`` shows each checkpoint's tier and replication lag from the project's
record of its remote tier (issue #26), and a crafted record never makes it contact a host."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.formats.tier_record import RECORD_NAME, public_location
from accelkit.cli.main import main as cli
from tests.checkpointing.test_replication import _options, _run
from tests.fixtures.s3 import S3Server
from tests.helpers.faultproxy import FaultProxy

pytest.importorskip("s3fs", reason="the remote tier is S3: pip install 'accelkit[s3]'")


def _ls_json(
    path: str, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[dict[str, dict], str]:
    capsys.readouterr()
    assert cli(["ckpt", "ls", path, "--json", *flags]) == 0
    out = capsys.readouterr()
    return {row["name"]: row for row in json.loads(out.out)}, out.err


@pytest.mark.slow
def test_ls_shows_recorded_tiers_and_lag_without_remote(
    s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = s3_server.new_prefix()
    local = str(tmp_path / "run")
    with FaultProxy(("127.0.0.1", s3_server.port)) as proxy:
        accelerator, _, _ = _run(local, remote, _options(s3_server, proxy))
        accelerator.save_state()
        assert accelerator._checkpoints.wait_replicated(30)
        proxy.down_for(3600)
        accelerator.save_state()  # never replicated: the remote tier is down
        assert accelerator._checkpoints.close_replication(0.5) == ["checkpoint_1"]

    record = (Path(local) / RECORD_NAME).read_text()
    assert json.loads(record)["replicate_to"] == remote
    # storage options (endpoint, key, secret) are never recorded
    assert set(json.loads(record)) == {"format", "replicate_to", "updated", "checkpoints"}
    assert s3_server.storage_options["secret"] not in record

    rows, err = _ls_json(local, capsys)
    assert rows["checkpoint_0"]["tier"] == "both"
    assert rows["checkpoint_0"]["tier_source"] == "record"
    lag = rows["checkpoint_0"]["lag_seconds"]
    assert lag is not None and 0 < lag < 30
    assert rows["checkpoint_0"]["waiting_seconds"] is None
    assert rows["checkpoint_1"]["tier"] == "local"
    assert rows["checkpoint_1"]["lag_seconds"] is None
    assert rows["checkpoint_1"]["waiting_seconds"] >= 0
    assert "not contacted" in err

    # the local copy of checkpoint_0 is gone: the record still knows the remote one
    shutil.rmtree(Path(local) / "checkpoints" / "checkpoint_0")
    capsys.readouterr()
    assert cli(["ckpt", "ls", local]) == 0
    out = capsys.readouterr()
    header, *lines = out.out.splitlines()
    assert header.split()[-2:] == ["TIER", "LAG"]
    cells = {line.split()[0]: line.split() for line in lines if line}
    assert "remote" in cells["checkpoint_0"] and "waiting" in cells["checkpoint_1"]
    assert remote in out.err

    # --remote lists the remote tier itself, and keeps the recorded lag
    flags = [f"-o{k}={v}" for k, v in s3_server.storage_options.items() if isinstance(v, str)]
    rows, _ = _ls_json(local, capsys, "--remote", remote, *flags)
    assert {n: r["tier"] for n, r in rows.items()} == {
        "checkpoint_0": "remote",
        "checkpoint_1": "local",
    }
    assert rows["checkpoint_0"]["tier_source"] == "listing"
    assert rows["checkpoint_0"]["lag_seconds"] == pytest.approx(lag, abs=1e-3)


def _local_project(tmp_path: Path, seed: int = 0) -> str:
    cfg = ProjectConfiguration(project_dir=str(tmp_path / "run"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=cfg, cpu=True)
    torch.manual_seed(seed)
    accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.save_state()
    accelerator.end_training()
    return str(tmp_path / "run")


def test_crafted_record_is_shown_never_contacted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = _local_project(tmp_path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        crafted = {
            "format": 1,
            "replicate_to": f"http://127.0.0.1:{port}/internal\x1b[31m",
            "storage_options": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "updated": 1.0,
            "checkpoints": {"checkpoint_7": {"committed": 1.0, "replicated": 2.0}},
        }
        (Path(project) / RECORD_NAME).write_text(json.dumps(crafted))
        rows, _ = _ls_json(project, capsys)
        capsys.readouterr()
        assert cli(["ckpt", "ls", project]) == 0
        out = capsys.readouterr()
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected to the recorded host
    assert rows["checkpoint_7"]["tier"] == "remote"
    assert rows["checkpoint_7"]["tier_source"] == "record"
    assert rows["checkpoint_0"]["tier"] == "local"
    assert "\x1b" not in out.out + out.err  # the recorded text is escaped
    assert f"127.0.0.1:{port}/internal" in out.err


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        json.dumps({"format": 2, "replicate_to": "s3://b/r"}).encode(),
        json.dumps({"format": 1, "replicate_to": "s3://b/r", "checkpoints": {"../x": {}}}).encode(),
        json.dumps(
            {"format": 1, "replicate_to": "s3://b/r", "checkpoints": {"checkpoint_1": {}}}
        ).encode(),
        json.dumps({"format": 1, "replicate_to": "x" * 5000}).encode(),
        # a name past Python's digit limit (int() raises), and one within it (printed uncut)
        json.dumps(
            {
                "format": 1,
                "replicate_to": "s3://b/r",
                "checkpoints": {"checkpoint_" + "9" * 5000: {"committed": 1.0, "replicated": 2.0}},
            }
        ).encode(),
        json.dumps(
            {
                "format": 1,
                "replicate_to": "s3://b/r",
                "checkpoints": {"checkpoint_" + "9" * 4000: {"committed": 1.0, "replicated": 2.0}},
            }
        ).encode(),
        b"[" * 100_000,
        "link",
    ],
)
def test_malformed_record_is_ignored_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | str
) -> None:
    project = _local_project(tmp_path)
    target = Path(project) / RECORD_NAME
    if content == "link":
        secret = tmp_path / "secret.json"
        secret.write_text(json.dumps({"format": 1, "replicate_to": "s3://b/r"}))
        os.symlink(secret, target)
    else:
        target.write_bytes(content)  # type: ignore[arg-type]
    capsys.readouterr()
    assert cli(["ckpt", "ls", project, "--json"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert [r["name"] for r in rows] == ["checkpoint_0"] and "tier" not in rows[0]
    assert "tier record ignored" in out.err
    assert len(out.err) < 2000  # the note quotes the record's text clipped
    capsys.readouterr()
    assert cli(["ckpt", "ls", project]) == 0
    table = capsys.readouterr()
    assert "tier record ignored" in table.err and len(table.out + table.err) < 3000


def test_recorded_location_drops_credentials() -> None:
    assert (
        public_location("s3://AKIA:hunter2@bucket/run?X-Amz-Signature=abc#x") == "s3://bucket/run"
    )
    assert public_location("az://container/run?sv=2024&sig=s3cr3t") == "az://container/run"
    assert public_location("/fast/local/run") == "/fast/local/run"


def test_a_remote_folder_of_the_same_name_is_compared_by_content(
    s3_server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another run's checkpoint_0 sits on the remote tier under the name of this run's.
    remote = s3_server.new_prefix()
    options = _options(s3_server)
    flags = [f for k, v in options.items() if k != "config_kwargs" for f in ("-o", _flag(k, v))]
    other = _local_project(tmp_path / "other", seed=1)
    capsys.readouterr()
    assert cli(["ckpt", "sync", other, remote, *flags]) == 0
    mine = _local_project(tmp_path / "mine", seed=2)

    rows, err = _ls_json(mine, capsys, "--remote", remote, *flags)
    assert rows["checkpoint_0"]["tier"] == "local"  # not "both": the remote one is another
    assert "other checkpoints under the names of local ones" in err and "checkpoint_0" in err

    capsys.readouterr()
    assert cli(["ckpt", "sync", mine, remote, "--json", *flags]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["copied"] == [] and result["left"] == ["checkpoint_0"]
    rows, _ = _ls_json(mine, capsys)  # the tier record sync wrote: not "both" either
    assert rows["checkpoint_0"]["tier"] == "local"

    # The same checkpoint under its own name is "both", and sync has nothing to copy.
    rows, _ = _ls_json(other, capsys, "--remote", remote, *flags)
    assert rows["checkpoint_0"]["tier"] == "both"
    capsys.readouterr()
    assert cli(["ckpt", "sync", other, remote, *flags]) == 0
    assert "nothing to copy" in capsys.readouterr().out


def _flag(key: str, value: object) -> str:
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"
