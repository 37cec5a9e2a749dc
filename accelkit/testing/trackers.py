"""The tracker contract as a pytest suite: :class:`TrackerContract`.

Subclass it in a test module, name the tracker and say how to read back what it wrote; the
test then trains nothing but drives the tracker through a real :class:`~accelkit.Accelerator`:
``init_trackers`` with a nested configuration (tensors, paths, ``None``), five ``log`` calls
mixing tensors, NumPy and Python scalars, text and an unloggable object, ``end_training``.
A second test saves a checkpoint and resumes from it in a new ``Accelerator``: what the tracker
records in the manifest (``name_run``, ``run_reference``) must be JSON, and a tracker that
records its run must continue that same run (its reference then has every field the manifest
recorded). A third makes the tracker's first ``log`` calls fail and checks
that every point still arrives exactly once (the tracker journal). See :mod:`accelkit.testing`
for an example.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from accelkit.trackers import GeneralTracker, TrackerWarning
from accelkit.trackers.registry import register_tracker, registered_trackers, unregister_tracker

__all__ = [
    "FAILING_CALLS",
    "RECOVERY_STEPS",
    "RUN",
    "STEPS",
    "Scalars",
    "TrackerContract",
    "contract_config",
    "contract_values",
]

RUN = "conformance"
"""The project (run) name the contract passes to ``init_trackers``."""
STEPS = 5
"""How many ``log`` calls the contract makes (steps ``0 .. STEPS-1``)."""
FAILING_CALLS = 8
"""How many ``log`` calls fail in the recovery contract before the backend answers again."""
RECOVERY_STEPS = 20
"""How many points the recovery contract logs (steps ``0 .. RECOVERY_STEPS-1``)."""

Scalars = dict[str, list[tuple[int, float]]]
"""What a reader returns for the scalars: key -> ``[(step, value), ...]`` in step order."""


def contract_config() -> dict[str, Any]:
    """The configuration the contract stores (a fresh copy each call)."""
    import torch

    return {
        "lr": 0.001,
        "layers": [64, 32],
        "optimizer": {"name": "adam", "betas": torch.tensor([0.5, 0.25])},
        "scheduler": None,
        "output": Path("/tmp/out"),
        "epochs": torch.tensor(3),
    }


def contract_values(step: int) -> dict[str, Any]:
    """What the contract logs at ``step``: three scalars a tracker must keep, a string and an
    object it may skip (with at most one warning about it)."""
    import numpy as np
    import torch

    return {
        "loss": torch.tensor(1.0 / (step + 1)),
        "lr": 0.1 * step,
        "count": np.int64(step),
        "note": "free text",
        "blob": object(),
    }


class TrackerContract:
    """What accelkit expects of a tracker, as a pytest test.

    Class attributes of a subclass:
        log_with: the tracker's name, as given to ``Accelerator(log_with=...)``.
        files: a glob, relative to the logging dir, that the tracker must have written.
        unwrapped: the class name of ``get_tracker(log_with, unwrap=True)`` (``None``: not
            checked).
        register: a :class:`~accelkit.trackers.GeneralTracker` subclass to register for the
            test (and unregister after), for a tracker not registered otherwise.
        flattens_config: the tracker stores a nested configuration under flat keys
            (``optimizer/name``); ``False``: it keeps the top-level keys, nested values as text.

    Methods a subclass provides:
        read_back(logging_dir, run): ``(scalars, config)`` as the tracker stored them, read
            with the backend's own reader; config keys may be flattened with ``/`` or ``|``.

    Fixtures a subclass may override:
        logging_dir: the project dir given to the ``Accelerator`` (default: a fresh
            ``project`` folder, not created).
    """

    log_with: ClassVar[str]
    files: ClassVar[str]
    unwrapped: ClassVar[str | None] = None
    register: ClassVar[type[GeneralTracker] | None] = None
    flattens_config: ClassVar[bool] = True

    def read_back(self, logging_dir: str, run: str) -> tuple[Scalars, dict[str, Any]]:
        """Override: read what the tracker wrote under ``logging_dir`` for ``run``."""
        raise NotImplementedError(
            f"{type(self).__name__} must define read_back(logging_dir, run) -> (scalars, config)"
        )

    @pytest.fixture
    def logging_dir(self, tmp_path: Path) -> Path:
        """The project dir of the run (override to prepare it)."""
        return tmp_path / "project"

    @pytest.fixture
    def registered(self) -> Any:
        """Registers :attr:`register` for the test, if set, and removes it afterwards."""
        before = set(registered_trackers())
        if self.register is not None:
            register_tracker(self.register)
        yield
        for name in set(registered_trackers()) - before:
            unregister_tracker(name)

    def test_tracker_contract(
        self,
        logging_dir: Path,
        registered: Any,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from accelkit.accelerator import Accelerator

        workdir = tmp_path / "cwd"  # a backend writing outside the logging dir shows up here
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        name = self.log_with
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator = Accelerator(log_with=name, project_dir=str(logging_dir))
            accelerator.init_trackers(RUN, config=contract_config())
            for step in range(STEPS):
                accelerator.log(contract_values(step), step=step)
            assert accelerator.get_tracker(name).name == name
            if self.unwrapped is not None:
                unwrapped = accelerator.get_tracker(name, unwrap=True)
                assert type(unwrapped).__name__ == self.unwrapped
            accelerator.end_training()

        failures = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
        assert failures == [], failures
        about_blob = [str(w.message) for w in caught if "'blob'" in str(w.message)]
        assert len(about_blob) <= 1, about_blob

        assert list(logging_dir.glob(self.files)), f"{name} wrote no {self.files}"
        assert sorted(p.name for p in workdir.iterdir()) == [], "written outside logging_dir"

        scalars, config = self.read_back(str(logging_dir), RUN)
        expected = {
            "loss": [1.0 / (s + 1) for s in range(STEPS)],
            "lr": [0.1 * s for s in range(STEPS)],
            "count": [float(s) for s in range(STEPS)],
        }
        for key, values in expected.items():
            assert [step for step, _ in scalars[key]] == list(range(STEPS)), (key, scalars[key])
            assert [v for _, v in scalars[key]] == pytest.approx(values, rel=1e-6)

        config = {key.replace("|", "/"): value for key, value in config.items()}
        assert float(config["lr"]) == pytest.approx(0.001)
        assert str(config["output"]) == "/tmp/out"
        assert int(float(config["epochs"])) == 3
        assert "scheduler" in config
        assert "64" in str(config["layers"]) and "32" in str(config["layers"])
        if self.flattens_config:
            assert config["optimizer/name"] == "adam"
            assert "0.25" in str(config["optimizer/betas"])
        else:
            assert "adam" in str(config["optimizer"]) and "0.25" in str(config["optimizer"])

    def test_checkpoint_contract(
        self,
        logging_dir: Path,
        registered: Any,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        import json

        from accelkit.accelerator import Accelerator
        from accelkit.checkpointing.config import ProjectConfiguration

        monkeypatch.chdir(tmp_path)
        name = self.log_with

        def job() -> Accelerator:
            config = ProjectConfiguration(
                project_dir=str(logging_dir), automatic_checkpoint_naming=True
            )
            return Accelerator(log_with=name, project_config=config)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = job()
            first.init_trackers(RUN, config={"lr": 0.001})
            for step in range(STEPS):
                first.log({"loss": 1.0 / (step + 1)}, step=step)
            checkpoint = Path(first.save_state())
            first.end_training()
            record = json.loads((checkpoint / "accelkit.json").read_text())["experiment"]
            resumed = job()
            resumed.init_trackers(RUN, config={"lr": 0.001})
            resumed.load_state()
            resumed.log({"loss": 0.5})
            continued = resumed.get_tracker(name).run_reference()
            resumed.end_training()

        problems = [
            str(w.message)
            for w in caught
            if issubclass(w.category, TrackerWarning) or "checkpoint records" in str(w.message)
        ]
        assert problems == [], problems
        assert record["step"] == STEPS - 1
        assert record.get("key") and "pending" not in record  # named at the save
        saved = record["runs"].get(name)
        if saved is not None:  # the tracker records its run: the resumed job continues it
            assert json.loads(json.dumps(saved)) == saved
            # A run named before it opened (name_run) may gain fields once open (MLflow's
            # run_id): the resumed run has every field the checkpoint recorded.
            assert continued is not None, (continued, saved)
            assert {key: continued.get(key) for key in saved} == saved, (continued, saved)

    def test_recovery_contract(
        self,
        logging_dir: Path,
        registered: Any,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A tracker whose backend fails for a while receives every point exactly once after
        it recovers (the tracker journal, #27): its first :data:`FAILING_CALLS` ``log`` calls
        raise ``ConnectionError``; the journal retries and catches up, in order, with the
        original steps."""
        from accelkit.accelerator import Accelerator
        from accelkit.trackers.registry import get_tracker_class

        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("ACCELKIT_TRACKER_RETRY_MAX_S", "0.01")
        name = self.log_with
        original = get_tracker_class(name)
        failing = [FAILING_CALLS]

        def outage() -> None:
            if failing[0] > 0:
                failing[0] -= 1
                raise ConnectionError("the contract's outage: connection refused")

        def log(self: Any, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            outage()
            original.log(self, values, step, **kwargs)

        def log_batch(self: Any, batch: Sequence[tuple[dict[str, Any], int, float]]) -> None:
            outage()
            original.log_batch(self, batch)

        # A tracker with a log_batch of its own receives the backlog there: it fails there too.
        methods: dict[str, Any] = {"log": log}
        if original.log_batch is not GeneralTracker.log_batch:
            methods["log_batch"] = log_batch
        Outage = type(original.__name__, (original,), methods)
        register_tracker(Outage, overwrite=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TrackerWarning)
                accelerator = Accelerator(log_with=name, project_dir=str(logging_dir))
                accelerator.init_trackers(RUN, config={"lr": 0.001})
                for step in range(RECOVERY_STEPS):
                    accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
                accelerator.end_training()
        finally:
            register_tracker(original, overwrite=True)
        assert failing[0] == 0, "the outage never happened"
        scalars, _ = self.read_back(str(logging_dir), RUN)
        assert [step for step, _ in scalars["loss"]] == list(range(RECOVERY_STEPS))
        assert [v for _, v in scalars["loss"]] == pytest.approx(
            [1.0 / (s + 1) for s in range(RECOVERY_STEPS)], rel=1e-6
        )
