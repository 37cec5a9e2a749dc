"""`accelkit launch` and `notebook_launcher`, run for real (2 gloo processes on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accelkit.launch.launcher import notebook_launcher
from tests.helpers.distributed import free_port as _free_port

# A script written for the reference documents, with only its imports renamed.
SEED_SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys
    import torch
    from accelkit import Accelerator
    from accelkit.logging import get_logger
    from accelkit.utils import gather_object

    logger = get_logger("seed")

    def record_group_at_exit():  # registered first, so it runs after accelkit's exit hook
        import torch.distributed as dist
        path = os.path.join(os.environ["OUT_DIR"], f"exit{os.environ.get('RANK', '0')}.txt")
        with open(path, "w") as f:
            f.write(str(dist.is_initialized()))

    def main():
        atexit.register(record_group_at_exit)
        accelerator = Accelerator()
        logger.warning("once from main")
        logger.warning("from every rank", main_process_only=False)
        rank = accelerator.process_index
        process_tensor = torch.arange(accelerator.num_processes) + 1 + (2 * rank)
        reduced = accelerator.reduce(process_tensor, reduction="sum")
        gathered = accelerator.gather(torch.tensor([accelerator.process_index]))
        with accelerator.split_between_processes(["A", "B", "C"]) as inputs:
            mine = inputs
        objects = gather_object([accelerator.process_index])
        accelerator.wait_for_everyone()
        out = {
            "rank": accelerator.process_index,
            "world": accelerator.num_processes,
            "local": accelerator.local_process_index,
            "reduced": reduced.tolist(),
            "gathered": gathered.tolist(),
            "split": mine,
            "objects": objects,
            "precision": accelerator.mixed_precision,
            "argv": sys.argv[1:],
            "device": str(accelerator.device),
        }
        path = os.path.join(os.environ["OUT_DIR"], f"rank{accelerator.process_index}.json")
        with open(path, "w") as f:
            json.dump(out, f)
        if os.environ.get("FAIL_RANK") == str(accelerator.process_index):
            raise RuntimeError("worker exploded on purpose")

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture(autouse=True)
def _no_user_config(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A config file in the developer's own ~/.cache/huggingface must not change these launches.
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def _accelkit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accelkit.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=180,
    )


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "seed_script.py"
    path.write_text(SEED_SCRIPT)
    return path


def test_launch_two_cpu_processes(tmp_path: Path, script: Path) -> None:
    proc = _accelkit(
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--mixed_precision",
        "bf16",
        str(script),
        "--lr",
        "0.1",
        env={"OUT_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for r in ranks:
        assert r["world"] == 2
        assert r["reduced"] == [4, 6]
        assert r["gathered"] == [0, 1]
        assert r["objects"] == [0, 1]
        assert r["precision"] == "bf16"
        assert r["argv"] == ["--lr", "0.1"]
        assert r["device"] == "cpu:0"  # several CPU processes: cpu:0, as in Accelerate
    assert [r["local"] for r in ranks] == [0, 1]
    # The process group accelkit created is destroyed at exit (gloo could abort otherwise).
    assert [(tmp_path / f"exit{i}.txt").read_text() for i in range(2)] == ["False", "False"]
    assert ranks[0]["split"] == ["A", "B"] and ranks[1]["split"] == ["C"]
    logs = proc.stdout + proc.stderr
    assert logs.count("once from main") == 1
    assert "[RANK 0] from every rank" in logs and "[RANK 1] from every rank" in logs


def test_launch_single_process_runs_directly(tmp_path: Path, script: Path) -> None:
    proc = _accelkit("launch", "--cpu", str(script), env={"OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["world"] == 1 and r["reduced"] == [1] and r["precision"] == "no"


def test_failing_worker_fails_the_launch(tmp_path: Path, script: Path) -> None:
    proc = _accelkit(
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        str(script),
        env={"OUT_DIR": str(tmp_path), "FAIL_RANK": "1"},
    )
    assert proc.returncode != 0
    assert "worker exploded on purpose" in proc.stderr


# Rank 1 raises; rank 0 then fails in a collective rank 1 never joins (gloo: its peer closed the
# connection) and raises too, milliseconds later, often in the same second.
PEER_FAILS = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from accelkit import Accelerator

    accelerator = Accelerator()
    accelerator.wait_for_everyone()
    if accelerator.process_index == 1:
        class RankOneExploded(Exception):
            pass

        raise RankOneExploded("the root cause 7f3a")
    dist.all_reduce(torch.ones(1))
    """
)


def _busy_loop() -> subprocess.Popen[bytes]:
    # A machine with more work than cores: the two ranks' failures land close together.
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.parametrize("monitor_interval", [None, "3"])
def test_the_last_line_names_the_rank_that_failed_first(
    tmp_path: Path, monitor_interval: str | None
) -> None:
    # With a long monitor interval torchrun sees both failures at once (rank 0 is not stopped
    # by it first); with its default one, the launch runs twice beside a busy loop.
    path = tmp_path / "peer_fails.py"
    path.write_text(PEER_FAILS)
    flags = ["--monitor_interval", monitor_interval] if monitor_interval else []
    busy = _busy_loop()
    try:
        for _ in range(1 if monitor_interval else 2):
            proc = _accelkit("launch", "--cpu", "--num_processes", "2", *flags, str(path))
            assert proc.returncode == 1, proc.stderr
            last = proc.stderr.strip().splitlines()[-1]
            assert last == "accelkit launch: rank 1 failed: RankOneExploded: the root cause 7f3a"
            # torchrun's own report above it names the same root cause.
            root = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
            assert root.split("rank      : ", 1)[1].startswith("1 (local_rank: 1)"), root
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num_processes", "0", "x.py"], "--num_processes/--num-processes: must be >= 1, got 0"),
        (["--mixed_precision", "fp16x", "x.py"], "Unknown mixed_precision 'fp16x'"),
        (["--mixed_precision", "fp8", "x.py"], "FP8 training is out of scope"),
        (["--bogus", "x.py"], "unrecognized argument --bogus"),
        (["--num_proceses", "2", "x.py"], "(did you mean --num_processes?)"),
        (["does_not_exist.py"], "does_not_exist.py' does not exist"),
        (["--num_processes", "3", "--num_machines", "2", "{script}"], "multiple of --num_machines"),
        (
            ["--num_machines", "2", "--machine_rank", "2", "{script}"],
            "must be below --num_machines",
        ),
    ],
)
def test_bad_launch_input(script: Path, args: list[str], message: str) -> None:
    proc = _accelkit("launch", "--cpu", *[a.format(script=script) for a in args])
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.startswith("usage: accelkit launch ")  # the launch usage, not the top one


def test_env_command_reports_versions() -> None:
    proc = _accelkit("env")
    assert proc.returncode == 0
    assert "torch" in proc.stdout and "CUDA available" in proc.stdout


def test_no_command_prints_help() -> None:
    proc = _accelkit()
    assert proc.returncode == 2 and "launch" in proc.stderr


def _notebook_fn(out_dir: str, tag: str) -> None:
    import torch

    from accelkit import Accelerator

    acc = Accelerator()
    total = acc.reduce(torch.tensor([acc.process_index + 1]), reduction="sum")
    Path(out_dir, f"{tag}{acc.process_index}.txt").write_text(
        f"{acc.num_processes} {int(total.item())} {acc.mixed_precision}"
    )


def test_notebook_launcher_starts_processes(tmp_path: Path) -> None:
    notebook_launcher(
        _notebook_fn,
        args=(str(tmp_path), "nb"),
        num_processes=2,
        mixed_precision="bf16",
        cpu=True,
    )
    assert (tmp_path / "nb0.txt").read_text() == "2 3 bf16"
    assert (tmp_path / "nb1.txt").read_text() == "2 3 bf16"


def test_notebook_launcher_rejects_zero_processes() -> None:
    with pytest.raises(ValueError, match="num_processes must be >= 1, got 0"):
        notebook_launcher(_notebook_fn, num_processes=0)
    with pytest.raises(ValueError, match="node_rank=2 with num_nodes=2"):
        notebook_launcher(_notebook_fn, num_processes=2, node_rank=2, num_nodes=2)
    with pytest.raises(ValueError, match="Unknown rdzv_backend 'tcp'"):
        notebook_launcher(_notebook_fn, num_processes=2, rdzv_backend="tcp")


def _fail_once_then_write(out_dir: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    from accelkit import PartialState

    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        # The first attempt fails before any process group exists: a worker stopped while
        # joining one leaves its stale address in the agent's store, and the next attempt's
        # gloo then waits 30 s on it (torch's behaviour, under Accelerate's launcher too).
        if os.environ["RANK"] == "0":
            raise RuntimeError("first attempt fails")
        time.sleep(60)  # stopped by the agent when rank 0 fails
        return
    state = PartialState()
    ranks = torch.tensor([state.process_index + 1])
    dist.all_reduce(ranks)  # both ranks of the restarted group take part
    Path(out_dir, f"rank{state.process_index}.txt").write_text(f"restarted {int(ranks)}")


def test_notebook_launcher_restarts_failed_workers(tmp_path: Path) -> None:
    notebook_launcher(_fail_once_then_write, (str(tmp_path),), 2, max_restarts=1, cpu=True)
    # Both ranks ran again after rank 0 failed: the agent restarted the whole group once.
    assert (tmp_path / "rank0.txt").read_text() == "restarted 3"
    assert (tmp_path / "rank1.txt").read_text() == "restarted 3"


def _even_fails_odd_sleeps(seconds: float) -> None:
    import time

    from accelkit import PartialState

    if PartialState().process_index % 2 == 0:
        raise RuntimeError("even ranks fail")
    time.sleep(seconds)


def test_notebook_launcher_stops_the_others_when_a_worker_fails() -> None:
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = time.monotonic()
    with pytest.raises(ChildFailedError, match="even ranks fail"):
        notebook_launcher(
            _even_fails_odd_sleeps,
            (120.0,),
            num_processes=2,
            monitor_interval=0.05,
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{_free_port()}",
            cpu=True,
        )
    # The sleeping rank was stopped, not waited for.
    assert time.monotonic() - started < 60


def _fails_until_third_attempt(attempts: list[str]) -> None:
    attempts.append(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if len(attempts) < 3:
        raise RuntimeError(f"attempt {len(attempts)} fails")
    assert os.environ["ACCELKIT_MIXED_PRECISION"] == "bf16"
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"  # the reference's spelling too


def test_notebook_launcher_on_one_process_restarts_and_raises_as_the_agent_does() -> None:
    """One process runs in this process, but fails, restarts and reports as on several."""
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    attempts: list[str] = []
    notebook_launcher(_fails_until_third_attempt, (attempts,), 1, "bf16", max_restarts=2, cpu=True)
    assert attempts == ["0", "1", "2"]

    attempts.clear()
    started = time.monotonic()
    with pytest.raises(ChildFailedError, match="RuntimeError: attempt 2 fails") as caught:
        notebook_launcher(
            _fails_until_third_attempt, (attempts,), 1, max_restarts=1, monitor_interval=0.01
        )
    assert time.monotonic() - started < 5  # at once, as the agent on several processes
    assert attempts == ["0", "1"]
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "_fails_until_third_attempt FAILED" in str(caught.value)
    assert "TORCHELASTIC_RESTART_COUNT" not in os.environ
