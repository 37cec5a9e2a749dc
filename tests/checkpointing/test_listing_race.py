"""A committed checkpoint listed while its manifest is rewritten atomically (as a tracker's run
reference arriving after the save once did) is committed in every listing: the atomic write's
temporary file, renamed away between the scan and its stat, is not listed instead of failing
the listing (which made the folder look empty, "incomplete", and ``load_state()`` refuse it;
seen in CI)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from accelkit import Accelerator, ProjectConfiguration
from accelkit.checkpointing.catalog.listing import COMMITTED, list_checkpoints
from accelkit.checkpointing.formats.manifest import read_manifest, write_manifest
from accelkit.checkpointing.storage import LocalStorage
from accelkit.checkpointing.storage.confined import confine


def test_a_checkpoint_stays_committed_while_its_manifest_is_rewritten(tmp_path: Path) -> None:
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True),
    )
    accelerator.prepare(torch.nn.Linear(4, 4))
    folder = accelerator.save_state()
    root = str(tmp_path / "checkpoints")
    storage = LocalStorage()
    manifest = read_manifest(storage, folder)
    assert manifest is not None
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            write_manifest(storage, folder, manifest)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        states = set()
        for _ in range(300):
            states |= {info.state for info in list_checkpoints(storage, root)}
            states |= {info.state for info in list_checkpoints(confine(storage, root), root)}
    finally:
        stop.set()
        writer.join()
    assert states == {COMMITTED}
    accelerator.load_state()  # the case CI saw: resolve found it "incomplete"
