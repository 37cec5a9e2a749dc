"""A real 2-node job on one machine: two ``accelkit launch --num_machines 2`` invocations.

Each "node" is one ``accelkit launch --machine_rank {0,1}`` process (torchrun agent) with 2
workers, rendezvousing on 127.0.0.1; each node has its own "local disk" folder. The first job
trains, checkpoints (``save_state`` to the shared project folder) and keeps training; a second
2-node job resumes from the checkpoint and must end with the same parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers.distributed import free_port

SCRIPT = textwrap.dedent(
    """
    import faulthandler, json, os, sys
    faulthandler.dump_traceback_later(100, exit=True)  # a hung rank prints its stacks (CI log)
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from accelkit import Accelerator, ProjectConfiguration

    mode, project, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    node_disk = os.environ["NODE_DISK"]
    config = ProjectConfiguration(
        project, automatic_checkpoint_naming=True, save_on_each_node=True
    )
    accelerator = Accelerator(project_config=config)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 4, generator=gen), torch.randn(32, 2, generator=gen)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def epoch():
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    saved = loaded = None
    if mode == "train":
        epoch()
        saved = accelerator.save_state()
    else:
        loaded = accelerator.load_state()
    epoch()
    # save_on_each_node: each node's local main process writes the node's own copy.
    accelerator.save({"writer": accelerator.process_index}, os.path.join(node_disk, "copy.pt"))
    accelerator.wait_for_everyone()
    weights = accelerator.unwrap_model(model).state_dict()
    record = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "local_rank": accelerator.local_process_index,
        "is_local_main": accelerator.is_local_main_process,
        "is_main": accelerator.is_main_process,
        "node_disk": node_disk,
        "saved": saved,
        "loaded": loaded,
        "weights": {k: v.tolist() for k, v in weights.items()},
    }
    with open(os.path.join(out_dir, f"{mode}-rank{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    """
)


def _two_nodes(tmp_path: Path, script: Path, mode: str, project: Path, out: Path) -> None:
    port = free_port()
    procs = []
    for machine_rank in (0, 1):
        disk = tmp_path / f"node{machine_rank}-disk"
        disk.mkdir(exist_ok=True)
        env = {**os.environ, "NODE_DISK": str(disk), "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "accelkit.cli.main",
            "launch",
            "--num_machines",
            "2",
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--num_processes",
            "4",
            "--cpu",
            str(script),
            mode,
            str(project),
            str(out),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = []
    deadline = time.monotonic() + 120  # one phase (about 8 s here); both within pytest's 300 s
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(stdout.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        # Keep what both nodes printed (the ranks' stack dumps among it): a bare timeout says
        # nothing of where the job stopped.
        texts = []
        for proc in procs:
            proc.kill()
            try:
                texts.append(proc.communicate(timeout=20)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:  # a worker still holds the pipe
                texts.append("(no output: the launcher's pipe stayed open after it was killed)")
        report = "\n".join(f"--- node {i} ---\n{t[-6000:]}" for i, t in enumerate(texts))
        raise AssertionError(f"the two-node job ({mode}) did not end in 120 s:\n{report}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    report = "\n".join(f"--- node {i} ---\n{t[-4000:]}" for i, t in enumerate(outputs))
    assert not failed, f"node(s) {failed} ({mode}) failed:\n{report}"


def _records(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(4)]


def test_two_node_job_checkpoints_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    project, out = tmp_path / "project", tmp_path / "out"
    out.mkdir()

    _two_nodes(tmp_path, script, "train", project, out)
    trained = _records(out, "train")
    # Ranks 0-1 are node 0, ranks 2-3 node 1; local indexes restart on each node.
    assert [(r["world"], r["local_rank"], r["is_local_main"]) for r in trained] == [
        (4, 0, True),
        (4, 1, False),
        (4, 0, True),
        (4, 1, False),
    ]
    assert [r["is_main"] for r in trained] == [True, False, False, False]
    # Each node's local main process wrote that node's copy on that node's disk.
    import torch

    for node, writer in ((0, 0), (1, 2)):
        copy = torch.load(tmp_path / f"node{node}-disk" / "copy.pt", weights_only=True)
        assert copy == {"writer": writer}
    checkpoint = trained[0]["saved"]
    assert checkpoint == str(project / "checkpoints" / "checkpoint_0")
    manifest = json.loads((Path(checkpoint) / "accelkit.json").read_text())
    assert manifest["world_size"] == 4
    listed = {f["path"] for f in manifest["files"]}
    assert {f"random_states_{r}.json" for r in range(4)} <= listed  # every rank's own file

    _two_nodes(tmp_path, script, "resume", project, out)
    resumed = _records(out, "resume")
    assert all(r["loaded"] == checkpoint for r in resumed)
    for before, after in zip(trained, resumed):
        assert after["weights"] == before["weights"]  # bit-identical after the resumed epoch
