"""``accelkit ckpt ls / prune / verify / inspect`` on local, ``memory://`` and real S3 runs."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit.checkpointing.formats.manifest import read_manifest
from accelkit.checkpointing.storage import Storage, get_storage, join
from accelkit.cli._table import format_size
from accelkit.cli.main import main
from tests.cli.ckpt_fixtures import build_run, model_state, save_on_two_ranks
from tests.helpers.distributed import run_distributed

# --------------------------------------------------------------------------- fixtures


@dataclass
class Run:
    """A project dir holding checkpoints made by ``save_state`` on one storage backend."""

    url: str
    storage: Storage
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def ckpts(self) -> str:
        return join(self.url, "checkpoints")

    def ckpt(self, name: str) -> str:
        return join(self.ckpts, name)

    @property
    def cli_options(self) -> list[str]:
        """``-o KEY=VALUE`` flags that reach this storage."""
        out = []
        for key, value in self.options.items():
            text = value if isinstance(value, str) else json.dumps(value)
            out += ["-o", f"{key}={text}"]
        return out

    def tree(self) -> dict[str, int]:
        self.storage.invalidate()
        return self.storage.walk_files(self.url)


def _new_location(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Run:
    if kind == "local":
        url = str(tmp_path / "run")
        return Run(url, get_storage(url))
    if kind == "memory":
        url = f"memory://accelkit-cli-tests/{uuid.uuid4().hex[:12]}"
        return Run(url, get_storage(url))
    server = request.getfixturevalue("s3_server")
    url = server.new_prefix()
    return Run(url, get_storage(url, server.storage_options), server.storage_options)


@pytest.fixture(params=["local", "memory", "s3"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Run:
    """A run with (oldest first): committed 0 and 1, incomplete 2, committed 3 and 4,
    incomplete 5 (a save in flight), and a stray ``checkpoints/best`` folder."""
    where = _new_location(request.param, tmp_path, request)
    build_run(where.url, where.options)
    return where


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run ``accelkit ckpt ...`` in-process; returns the exit code and captured output."""

    def call(*argv: str) -> Result:
        capsys.readouterr()
        try:
            code = main(["ckpt", *argv])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return call


def corrupt_byte(storage: Storage, url: str) -> None:
    """Flip one byte near the end of a file, keeping its size."""
    data = bytearray(storage.read_bytes(url))
    data[-1] ^= 0xFF
    storage.write_bytes(url, bytes(data))


def parse_table(text: str) -> list[dict[str, str]]:
    """Rows of an aligned table (cells never hold two spaces in a row), up to its end."""
    lines = [line for line in text.splitlines() if line.strip()]
    names = re.split(r"\s{2,}", lines[0].strip())
    rows = []
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(names):
            break
        rows.append(dict(zip(names, cells)))
    return rows


# --------------------------------------------------------------------------- ls


@pytest.mark.slow
def test_ls_table_and_json_agree(run: Run, cli: Callable[..., Result]) -> None:
    as_json = cli("ls", run.url, "--json", *run.cli_options)
    assert as_json.code == 0, as_json.err
    items = json.loads(as_json.out)
    by_name = {i["name"]: i for i in items}
    # newest last, the stray "best" folder is not a checkpoint
    assert [i["name"] for i in items] == [f"checkpoint_{n}" for n in range(6)]
    assert [i["state"] for i in items] == [
        "committed",
        "committed",
        "incomplete",
        "committed",
        "committed",
        "incomplete",
    ]
    assert [i["iteration"] for i in items] == list(range(6))
    assert by_name["checkpoint_3"]["metrics"] == {"loss": pytest.approx(0.25)}
    manifest = read_manifest(run.storage, run.ckpt("checkpoint_3"))
    assert manifest is not None and by_name["checkpoint_3"]["step"] == manifest.step
    assert by_name["checkpoint_2"]["created"] is None
    tree = run.tree()
    for item in items:
        prefix = f"checkpoints/{item['name']}/"
        files = {k: v for k, v in tree.items() if k.startswith(prefix)}
        assert item["files"] == len(files)
        assert item["size_bytes"] == sum(files.values())
        assert item["path"] == run.ckpt(item["name"])

    table = cli("ls", run.url, *run.cli_options)
    assert table.code == 0, table.err
    rows = parse_table(table.out)
    assert [r["NAME"] for r in rows] == [i["name"] for i in items]
    for row, item in zip(rows, items):
        assert row["STATE"] == item["state"]
        assert row["ITER"] == str(item["iteration"])
        assert row["STEP"] == ("-" if item["step"] is None else str(item["step"]))
        assert row["SIZE"] == format_size(item["size_bytes"])
        assert row["FILES"] == str(item["files"])
        metrics = " ".join(f"{k}={v:.6g}" for k, v in item["metrics"].items()) or "-"
        assert row["METRICS"] == metrics

    # the checkpoints folder itself, and one checkpoint, are accepted too
    again = cli("ls", run.ckpts, "--json", *run.cli_options)
    assert json.loads(again.out) == items
    one = cli("ls", run.ckpt("checkpoint_3"), "--json", *run.cli_options)
    assert [i["name"] for i in json.loads(one.out)] == ["checkpoint_3"]


@pytest.mark.slow
def test_ls_shows_truncated_file_as_corrupt(run: Run, cli: Callable[..., Result]) -> None:
    url = join(run.ckpt("checkpoint_1"), "model.safetensors")
    run.storage.write_bytes(url, run.storage.read_bytes(url)[:-3])
    result = cli("ls", run.url, "--json", *run.cli_options)
    states = {i["name"]: (i["state"], i["error"]) for i in json.loads(result.out)}
    assert states["checkpoint_1"][0] == "corrupt"
    assert "model.safetensors" in states["checkpoint_1"][1]
    assert states["checkpoint_0"][0] == "committed"
    table = cli("ls", run.url, *run.cli_options)
    assert "checkpoint_1: corrupt" in table.err and "ckpt verify" in table.err

    run.storage.write_bytes(join(run.ckpt("checkpoint_4"), "accelkit.json"), b"{not json")
    listed = json.loads(cli("ls", run.url, "--json", *run.cli_options).out)
    assert {i["name"]: i["state"] for i in listed}["checkpoint_4"] == "corrupt"
    verify = cli("verify", run.ckpt("checkpoint_4"), *run.cli_options)
    assert verify.code == 1
    assert "FAIL  checkpoint_4" in verify.out and "accelkit.json" in verify.out
    assert "not valid JSON" in verify.out


@pytest.mark.slow
def test_missing_path_is_an_error(run: Run, cli: Callable[..., Result]) -> None:
    missing = join(run.url, "no-such-run")
    for action in (["ls"], ["verify"], ["inspect"], ["prune", "--keep", "1", "--yes"]):
        result = cli(*action, missing, *run.cli_options)
        assert result.code == 2, action
        assert missing in result.err and "does not exist" in result.err
        assert result.out == ""


@pytest.mark.slow
def test_folder_without_checkpoints_matches_nothing(run: Run, cli: Callable[..., Result]) -> None:
    result = cli("ls", run.ckpt("best"), *run.cli_options)
    assert result.code == 1
    assert "no checkpoint under" in result.err and "best" in result.err
    as_json = cli("ls", run.ckpt("best"), "--json", *run.cli_options)
    assert as_json.code == 1 and json.loads(as_json.out) == []


# --------------------------------------------------------------------------- verify


@pytest.mark.slow
def test_verify_intact_then_corrupted_byte_and_missing_file(
    run: Run, cli: Callable[..., Result]
) -> None:
    run.storage.write_bytes(join(run.ckpt("checkpoint_3"), "stale.bin"), b"left over")
    ok = cli("verify", run.ckpt("checkpoint_3"), *run.cli_options)
    assert ok.code == 0, ok.out + ok.err
    assert "OK    checkpoint_3" in ok.out
    assert "not in the manifest (ignored): stale.bin" in ok.out

    corrupt_byte(run.storage, join(run.ckpt("checkpoint_1"), "model.safetensors"))
    run.storage.remove(join(run.ckpt("checkpoint_4"), "optimizer.safetensors"))
    # a corrupted byte keeps the size: ls (sizes only) still says committed ...
    listed = {
        i["name"]: i["state"]
        for i in json.loads(cli("ls", run.url, "--json", *run.cli_options).out)
    }
    assert listed["checkpoint_1"] == "committed"
    # ... verify reads the checksums
    bad = cli("verify", run.url, *run.cli_options)
    assert bad.code == 1
    assert "FAIL  checkpoint_1" in bad.out
    assert re.search(r"model\.safetensors: checksum .* manifest says", bad.out)
    assert "FAIL  checkpoint_4" in bad.out and "optimizer.safetensors" in bad.out
    assert "missing" in bad.out
    assert "OK    checkpoint_0" in bad.out and "OK    checkpoint_3" in bad.out
    assert "SKIP  checkpoint_2" in bad.out
    assert "2 checkpoint(s)" in bad.err
    # nothing is shown as a progress bar when output is captured
    assert "verifying" not in bad.err

    single = cli("verify", run.ckpt("checkpoint_1"), *run.cli_options)
    assert single.code == 1 and "checkpoint_1" in single.out


@pytest.mark.slow
def test_verify_incomplete_checkpoint_fails(run: Run, cli: Callable[..., Result]) -> None:
    result = cli("verify", run.ckpt("checkpoint_2"), *run.cli_options)
    assert result.code == 1
    assert "checkpoint_2" in result.err and "accelkit.json" in result.err


# --------------------------------------------------------------------------- prune


@pytest.mark.slow
def test_prune_dry_run_deletes_nothing_then_prune_deletes_plan(
    run: Run, cli: Callable[..., Result]
) -> None:
    before = run.tree()
    dry = cli("prune", run.url, "--keep", "2", "--dry-run", *run.cli_options)
    assert dry.code == 0, dry.err
    assert run.tree() == before
    planned = parse_table(dry.out.split("Would remove (dry run):\n", 1)[1])
    doomed = ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert [r["NAME"] for r in planned[:3]] == doomed
    freed = sum(v for k, v in before.items() if k.split("/")[1] in doomed)
    assert f"Would free {format_size(freed)} ({freed} bytes)" in dry.out

    real = cli("prune", run.url, "--keep", "2", "--yes", *run.cli_options)
    assert real.code == 0, real.err
    assert f"Freed {format_size(freed)} ({freed} bytes)." in real.out
    after = run.tree()
    assert after == {k: v for k, v in before.items() if k.split("/")[1] not in doomed}
    # committed 3 and 4 kept, the newer incomplete 5 (a save in flight) and best/ untouched
    left = {k.split("/")[1] for k in after}
    assert left == {"checkpoint_3", "checkpoint_4", "checkpoint_5", "best"}

    again = cli("prune", run.url, "--keep", "2", "--yes", *run.cli_options)
    assert again.code == 0 and "Nothing to remove" in again.out
    assert run.tree() == after


def test_prune_says_why_it_keeps_checkpoints_the_script_named(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    # A script's own step_<n> folders (save_state(output_dir=...)): committed accelkit
    # checkpoints that retention never counts; prune keeps them and says so, and why.
    from accelkit import Accelerator

    accelerator = Accelerator()
    accelerator.prepare(torch.nn.Linear(2, 2))
    folder = tmp_path / "ckpts"
    for step in (10, 20, 30):
        accelerator.save_state(str(folder / f"step_{step}"))
    result = cli("prune", str(folder), "--keep", "2", "--yes")
    assert result.code == 0, result.err
    assert f"Nothing to remove under {folder} (3 kept: 3 named by the script)." in result.out
    [line] = [line for line in result.err.splitlines() if line.startswith("Keeping")]
    assert line.startswith("Keeping step_10, step_20, step_30: accelkit checkpoints saved under ")
    assert "only checkpoint_<n> folders" in line and "automatic_checkpoint_naming=True" in line
    assert sorted(p.name for p in folder.iterdir()) == ["step_10", "step_20", "step_30"]


@pytest.mark.slow
def test_prune_keep_best_and_keep_every(run: Run, cli: Callable[..., Result]) -> None:
    # losses: 1/(i+1), except checkpoint_0 which saved the best loss 0.01
    result = cli(
        "prune", run.ckpts, "--keep", "1", "--keep-best", "1", "--metric", "loss",
        "--keep-every", "3", "--dry-run", *run.cli_options,
    )  # fmt: skip
    assert result.code == 0, result.err
    plan = [r["NAME"] for r in parse_table(result.out.split("(dry run):\n", 1)[1])[:2]]
    # kept: 4 (newest), 0 (best loss), 3 (multiple of 3); removed: 1 and incomplete 2
    assert plan == ["checkpoint_1", "checkpoint_2"]
    assert "Kept: checkpoint_0, checkpoint_3, checkpoint_4, checkpoint_5" in result.out


@pytest.mark.slow
def test_prune_refuses_without_confirmation_when_not_a_terminal(
    run: Run, cli: Callable[..., Result]
) -> None:
    before = run.tree()
    result = cli("prune", run.url, "--keep", "1", *run.cli_options)
    assert result.code == 2
    assert "--yes" in result.err and "checkpoints" in result.err
    assert run.tree() == before


def test_prune_truncated_corrupt_checkpoint_is_kept(run: Run, cli: Callable[..., Result]) -> None:
    url = join(run.ckpt("checkpoint_0"), "model.safetensors")
    run.storage.write_bytes(url, b"short")
    result = cli("prune", run.url, "--keep", "1", "--yes", *run.cli_options)
    assert result.code == 0, result.err
    assert "Keeping corrupt checkpoint_0" in result.err
    left = {k.split("/")[1] for k in run.tree()}
    assert left == {"checkpoint_0", "checkpoint_4", "checkpoint_5", "best"}


# --------------------------------------------------------------------------- inspect


def test_inspect_checkpoint_table_and_json(run: Run, cli: Callable[..., Result]) -> None:
    expected = model_state()
    as_json = cli("inspect", run.ckpt("checkpoint_3"), "--json", *run.cli_options)
    assert as_json.code == 0, as_json.err
    payload = json.loads(as_json.out)
    model = {t["name"]: t for t in payload["tensors"] if t["file"] == "model.safetensors"}
    assert set(model) == set(expected)
    for name, tensor in expected.items():
        assert model[name]["shape"] == list(tensor.shape)
        assert model[name]["dtype"] == "F32"
        assert model[name]["size_bytes"] == tensor.numel() * 4
    table = cli("inspect", run.ckpt("checkpoint_3"), *run.cli_options)
    assert table.code == 0
    rows = parse_table(table.out.rsplit("\n", 2)[0])
    assert [(r["NAME"], r["DTYPE"], r["SHAPE"], r["FILE"]) for r in rows] == [
        (t["name"], t["dtype"], json.dumps(t["shape"]), t["file"]) for t in payload["tensors"]
    ]
    assert f"{len(rows)} tensors" in table.out


def test_inspect_refuses_hostile_header(run: Run, cli: Callable[..., Result]) -> None:
    url = join(run.url, "evil", "model.safetensors")
    run.storage.write_bytes(url, struct.pack("<Q", 2**62) + b"{}")
    result = cli("inspect", join(run.url, "evil"), *run.cli_options)
    assert result.code == 1
    assert "model.safetensors" in result.err and "header length" in result.err


# --------------------------------------------------------------------------- local only


def test_usage_errors(tmp_path: Path, cli: Callable[..., Result]) -> None:
    build_run(str(tmp_path))
    base = ["prune", str(tmp_path), "--keep"]
    assert cli(*base, "0").code == 2
    no_metric = cli(*base, "1", "--keep-best", "2")
    assert no_metric.code == 2 and "--metric" in no_metric.err
    one = cli(*base, "1", "--yes")
    assert one.code == 0
    single = cli("prune", str(tmp_path / "checkpoints" / "checkpoint_4"), "--keep", "1")
    assert single.code == 2 and "one checkpoint" in single.err
    a_file = cli("ls", str(tmp_path / "checkpoints" / "checkpoint_4" / "accelkit.json"))
    assert a_file.code == 2 and "is a file" in a_file.err
    bad_option = cli("ls", str(tmp_path), "-o", "novalue")
    assert bad_option.code == 2
    assert cli().code == 2
    helped = cli("prune", "--help")
    assert helped.code == 0
    assert "--yes" in helped.out and "not a terminal" in " ".join(helped.out.split())


def test_prune_asks_on_a_terminal(
    tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    build_run(str(tmp_path))
    before = sorted(os.listdir(tmp_path / "checkpoints"))

    class Terminal:
        def __init__(self, answer: str) -> None:
            self.answer = answer

        def isatty(self) -> bool:
            return True

        def readline(self) -> str:
            return self.answer

    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    declined = cli("prune", str(tmp_path), "--keep", "1")
    assert declined.code == 1 and "[y/N]" in declined.err and "nothing was deleted" in declined.err
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    accepted = cli("prune", str(tmp_path), "--keep", "1")
    assert accepted.code == 0
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["best", "checkpoint_4", "checkpoint_5"]


def test_symlinks_are_never_followed(tmp_path: Path, cli: Callable[..., Result]) -> None:
    run_dir = tmp_path / "run"
    build_run(str(run_dir))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"keep me")
    ckpts = run_dir / "checkpoints"
    # a checkpoint name that is a link to a folder outside, and a link inside a checkpoint
    (ckpts / "checkpoint_0").rename(tmp_path / "moved_0")
    (ckpts / "checkpoint_0").symlink_to(outside, target_is_directory=True)
    target = ckpts / "checkpoint_1" / "optimizer.safetensors"
    target.unlink()
    target.symlink_to(outside / "precious.bin")

    verify = cli("verify", str(ckpts / "checkpoint_1"))
    assert verify.code == 1 and "optimizer.safetensors" in verify.out
    assert "symbolic link" in verify.out
    listed = [i["name"] for i in json.loads(cli("ls", str(run_dir), "--json").out)]
    assert "checkpoint_0" not in listed
    pruned = cli("prune", str(run_dir), "--keep", "1", "--yes")
    assert pruned.code == 0, pruned.err
    assert (outside / "precious.bin").read_bytes() == b"keep me"
    assert (ckpts / "checkpoint_0").is_symlink()


@pytest.mark.slow
def test_console_script_subprocess(tmp_path: Path) -> None:
    build_run(str(tmp_path))
    script = Path(sys.executable).with_name("accelkit")
    done = subprocess.run(
        [str(script), "ckpt", "ls", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    names = [i["name"] for i in json.loads(done.stdout)]
    assert names == [f"checkpoint_{n}" for n in range(6)]
    assert done.stderr == ""  # no progress bar when piped


def test_inspect_save_model_folder(tmp_path: Path, cli: Callable[..., Result]) -> None:
    from accelkit.checkpointing import save_model

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    save_model(model, str(tmp_path / "m"), max_shard_size="10KB")
    index = tmp_path / "m" / "model.safetensors.index.json"
    assert index.exists()
    names = set(json.loads(index.read_text())["weight_map"])
    for target in (tmp_path / "m", index):
        result = cli("inspect", str(target), "--json")
        assert result.code == 0, result.err
        tensors = json.loads(result.out)["tensors"]
        assert {t["name"] for t in tensors} == names == set(model.state_dict())
        assert len({t["file"] for t in tensors}) > 1
        assert {t["name"]: t["shape"] for t in tensors} == {
            k: list(v.shape) for k, v in model.state_dict().items()
        }


def _run_on_terminal(argv: list[str], answer: bytes) -> tuple[int, str]:
    """Run the console script with stdin/stdout/stderr on a real pseudo-terminal."""
    import fcntl
    import pty
    import select
    import termios

    script = Path(sys.executable).with_name("accelkit")
    master, slave = pty.openpty()
    # a real terminal has a size; tqdm draws nothing on a 0-column one
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([str(script), *argv], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    os.write(master, answer)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            if not ready:
                proc.kill()
                break
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_prune_on_a_real_terminal_asks_and_shows_progress(tmp_path: Path) -> None:
    build_run(str(tmp_path))
    code, output = _run_on_terminal(["ckpt", "prune", str(tmp_path), "--keep", "1"], b"y\n")
    assert code == 0, output
    assert "[y/N]" in output
    assert "removing" in output  # the tqdm bar, shown because stderr is a terminal
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["best", "checkpoint_4", "checkpoint_5"]


class _TerminalErr(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.slow
def test_progress_bars_only_on_a_terminal(
    run: Run, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet_ls = cli("ls", run.url, *run.cli_options)
    quiet_verify = cli("verify", run.url, *run.cli_options)
    assert quiet_ls.err == "" and quiet_verify.err == ""
    terminal = _TerminalErr()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["ckpt", "ls", run.url, *run.cli_options]) == 0
    assert main(["ckpt", "verify", run.url, *run.cli_options]) == 0
    shown = terminal.getvalue()
    assert "listing" in shown and "ckpt" in shown
    assert "verifying" in shown


def test_s3_wrong_credentials_is_one_clear_error(
    s3_server: Any, cli: Callable[..., Result]
) -> None:
    url = s3_server.new_prefix()
    build_run(url, s3_server.storage_options)
    options = {
        **s3_server.storage_options,
        "key": "intruder",
        "secret": "wrong-secret",
        "config_kwargs": {"retries": {"max_attempts": 1}},  # fail fast, no retry back-off
    }
    flags = Run(url, get_storage(url), options).cli_options
    result = cli("ls", url, *flags)
    assert result.code == 2
    assert result.err.startswith("accelkit ckpt ls: error:")
    assert url in result.err and "credentials" in result.err
    assert "Traceback" not in result.err


def test_checkpoint_saved_by_two_processes(tmp_path: Path, cli: Callable[..., Result]) -> None:
    paths = run_distributed(save_on_two_ranks, str(tmp_path), world_size=2)
    assert paths[0] == paths[1] == str(tmp_path / "checkpoints" / "checkpoint_0")
    listed = json.loads(cli("ls", str(tmp_path), "--json").out)
    assert [(i["name"], i["state"], i["world_size"]) for i in listed] == [
        ("checkpoint_0", "committed", 2)
    ]
    ok = cli("verify", paths[0])
    assert ok.code == 0, ok.out
    manifest = read_manifest(get_storage(paths[0]), paths[0])
    assert manifest is not None
    rank_files = sorted(e.path for e in manifest.files if e.path.startswith("random_states_1"))
    assert rank_files  # rank 1 wrote its own files, and verify checked them
    corrupt_byte(get_storage(paths[0]), os.path.join(paths[0], rank_files[-1]))
    bad = cli("verify", paths[0])
    assert bad.code == 1 and rank_files[-1] in bad.out


@pytest.mark.slow
def test_closed_pipe_is_not_reported_as_an_error(tmp_path: Path) -> None:
    project = str(tmp_path / "run")
    build_run(project)
    # `true` exits without reading, so every write of `ls` meets a closed pipe.
    proc = subprocess.run(
        f"{sys.executable} -m accelkit.cli.main ckpt ls {project} | true; "
        'echo "status=${PIPESTATUS[0]}"',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "status=0" in proc.stdout
    assert "error" not in proc.stderr.lower(), proc.stderr
