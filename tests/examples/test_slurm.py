"""examples/slurm: the per-node launcher, run as two "nodes" on this machine (1 process each)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.examples.runner import EXAMPLES, OFFLINE_ENV, accelkit_command
from tests.helpers.distributed import free_port


def test_launch_node_script_joins_two_machines(tmp_path: Path) -> None:
    project = tmp_path / "run"
    port = free_port()
    nodes = []
    for node in (0, 1):
        env = {
            **os.environ,
            **OFFLINE_ENV,
            # What SLURM and train.sbatch would set on each node.
            "SLURM_NNODES": "2",
            "SLURM_NODEID": str(node),
            "MAIN_PROCESS_IP": "127.0.0.1",
            "MAIN_PROCESS_PORT": str(port),
            "PROCS_PER_NODE": "1",
            "LAUNCH_FLAGS": "--cpu",
            "ACCELKIT": " ".join(accelkit_command()),
        }
        command = [
            "bash",
            str(EXAMPLES / "slurm" / "launch_node.sh"),
            str(EXAMPLES / "quickstart.py"),
            "--project_dir",
            str(project),
            "--epochs",
            "1",
            "--samples",
            "128",
            "--batch_size",
            "16",
        ]
        nodes.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for process in nodes:
        out, _ = process.communicate(timeout=240)
        outputs.append(out)
    assert [p.returncode for p in nodes] == [0, 0], "\n\n".join(o[-4000:] for o in outputs)

    # One run of 2 processes on 2 "machines": a single checkpoint, written by both ranks.
    manifest = json.loads((project / "checkpoints" / "checkpoint_0" / "accelkit.json").read_text())
    assert manifest["world_size"] == 2
    files = {f["path"] for f in manifest["files"]}
    assert {"random_states_0.safetensors", "random_states_1.safetensors"} <= files
    # Each machine's local main process prints (accelerator.print is once per machine).
    assert all("epoch 1: mean loss" in out for out in outputs)


def test_sbatch_script_is_valid_bash_and_launches_every_node() -> None:
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm" / "train.sbatch")], check=True)
    assert "#SBATCH --nodes=" in script
    assert "srun" in script and "launch_node.sh" in script
