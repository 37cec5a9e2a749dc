"""The tracker registry: names, install hints, registration, entry points, "all"."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import accelkit
import accelkit.tracking
from accelkit import Accelerator, LoggerType, ProjectConfiguration
from accelkit.trackers import (
    GeneralTracker,
    TrackerHub,
    available_trackers,
    get_tracker_class,
    register_tracker,
    registered_trackers,
    unregister_tracker,
)
from accelkit.trackers.backends.jsonl import JSONLTracker, read_jsonl
from tests.trackers.custom import CSVTracker, RecordingTracker

BUILTINS = {
    *("tensorboard", "wandb", "comet_ml", "mlflow", "jsonl"),
    *("trackio", "swanlab", "clearml", "dvclive", "aim"),
}


def test_public_names() -> None:
    assert accelkit.tracking.GeneralTracker is accelkit.GeneralTracker is GeneralTracker
    assert accelkit.register_tracker is register_tracker
    assert str(LoggerType.COMETML) == "comet_ml" and LoggerType("jsonl") is LoggerType.JSONL
    assert get_tracker_class(LoggerType.JSONL) is JSONLTracker


@pytest.mark.slow
def test_unknown_name_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="Unknown tracker 'tensorbord'") as info:
        Accelerator(log_with="tensorbord")
    for name in BUILTINS:
        assert name in str(info.value)


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the package unimportable, as if not installed.
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(ImportError, match=r"pip install 'accelkit\[comet_ml\]'"):
        Accelerator(log_with=["jsonl", "comet_ml"], project_dir="unused")
    hub = TrackerHub.create("all", logging_dir="unused")
    assert "comet_ml" not in hub.requested_names
    assert {"jsonl", "tensorboard", "mlflow", "wandb"} <= set(hub.requested_names)


def test_tracker_needing_a_directory_names_project_dir() -> None:
    with pytest.raises(ValueError, match=r"'tensorboard'.*project_dir=.*logging_dir"):
        Accelerator(log_with="tensorboard")
    with pytest.raises(ValueError, match=r"'jsonl' writes local files.*'s3://bucket/run'"):
        TrackerHub.create("jsonl", logging_dir="s3://bucket/run")
    # Trackers that do not need one are fine without it.
    assert TrackerHub.create(["wandb", "mlflow", "comet_ml"]).requested_names == [
        "wandb",
        "mlflow",
        "comet_ml",
    ]


def test_bad_log_with_entry_is_refused() -> None:
    with pytest.raises(TypeError, match=r"got 3 \(int\)"):
        Accelerator(log_with=["jsonl", 3], project_dir="unused")


def test_project_configuration_logging_dir_is_used(tmp_path: Path) -> None:
    config = ProjectConfiguration(
        project_dir=str(tmp_path / "project"), logging_dir=str(tmp_path / "logs")
    )
    accelerator = Accelerator(log_with=LoggerType.JSONL, project_config=config)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1}, step=0)
    accelerator.end_training()
    assert read_jsonl(str(tmp_path / "logs" / "run"))[0]["values"] == {"x": 1}


def test_register_tracker_checks_its_input() -> None:
    with pytest.raises(TypeError, match=r"subclass of accelkit\.GeneralTracker"):
        register_tracker(dict)  # type: ignore[type-var]

    class Nameless(GeneralTracker):
        pass

    with pytest.raises(ValueError, match="Nameless has no name"):
        register_tracker(Nameless)

    assert register_tracker(CSVTracker) is CSVTracker
    register_tracker(CSVTracker)  # the same class again is harmless

    class Impostor(CSVTracker):
        name = "csv_custom"

    with pytest.raises(ValueError, match=r"'csv_custom' is already registered.*overwrite=True"):
        register_tracker(Impostor)
    register_tracker(Impostor, overwrite=True)
    assert get_tracker_class("csv_custom") is Impostor

    class MyJsonl(JSONLTracker):
        name = "jsonl"

    with pytest.raises(ValueError, match="'jsonl' is already registered \\(built-in\\)"):
        register_tracker(MyJsonl)
    unregister_tracker("csv_custom")
    assert "csv_custom" not in registered_trackers()
    with pytest.raises(KeyError):
        unregister_tracker("csv_custom")


def test_registered_trackers_join_all_with_given_instances(tmp_path: Path) -> None:
    @register_tracker
    class NeedsMissing(RecordingTracker):
        name = "needs_missing"
        required_packages = ("surely_not_an_installed_package_42",)

    register_tracker(CSVTracker)
    instance = RecordingTracker("given")
    with pytest.warns(UserWarning, match=r"registered tracker 'needs_missing'.*pip install"):
        hub = TrackerHub.create(["all", instance], logging_dir=str(tmp_path))
    assert set(hub.requested_names) == BUILTINS | {"csv_custom", "given"}
    with pytest.raises(ImportError, match="pip install surely_not_an_installed_package_42"):
        get_tracker_class("needs_missing")
    # "all" plus an explicit name keeps one tracker of that name.
    assert TrackerHub.create(["all", "jsonl"], logging_dir="x").requested_names.count("jsonl") == 1
    with pytest.raises(ValueError, match="Two trackers in log_with are named 'given'"):
        TrackerHub.create([instance, RecordingTracker("given")])


def _write_distribution(site: Path, entry_points: str) -> None:
    (site / "acme_tracker.py").write_text(
        textwrap.dedent(
            """
            from accelkit.trackers.backends.jsonl import JSONLTracker

            class AcmeTracker(JSONLTracker):
                name = "acme"

            NotATracker = 42
            """
        )
    )
    dist = site / "acme_tracker-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tracker\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(entry_points)


def test_entry_point_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _write_distribution(
        site,
        "[accelkit.trackers]\nacme = acme_tracker:AcmeTracker\nbogus = acme_tracker:NotATracker\n",
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "acme_tracker", raising=False)
    assert {"acme", "bogus"} <= set(available_trackers())

    accelerator = Accelerator(log_with="acme", project_dir=str(tmp_path / "logs"))
    accelerator.init_trackers("run")
    accelerator.log({"x": 7}, step=1)
    accelerator.end_training()
    assert read_jsonl(str(tmp_path / "logs" / "run"))[0]["values"] == {"x": 7}

    with pytest.raises(ImportError, match=r"'bogus' .*not a subclass of accelkit\.GeneralTracker"):
        get_tracker_class("bogus")
    with pytest.warns(UserWarning, match="Skipping tracker 'bogus'"):
        hub = TrackerHub.create("all", logging_dir=str(tmp_path))
    assert "acme" in hub.requested_names and "bogus" not in hub.requested_names


def test_config_conversion_helpers() -> None:
    import enum
    from argparse import Namespace
    from dataclasses import dataclass

    import numpy as np
    import torch

    from accelkit.trackers.values import flatten, to_plain

    class Color(enum.Enum):
        RED = "red"

    @dataclass
    class Opt:
        lr: float = 0.1

    config: dict[str, Any] = {
        "t": torch.tensor([1, 2]),
        "s": torch.tensor(2.5),
        "n": np.float32(0.5),
        "a": np.array([[1, 2]]),
        "p": Path("/x/y"),
        "e": Color.RED,
        "d": Opt(),
        "ns": Namespace(k=1),
        "set": {3, 1},
        "empty": {},
        "none": None,
        "deep": {"a": {"b": [1, {"c": None}]}},
        "dtype": torch.float16,
    }
    assert to_plain(config) == {
        "t": [1, 2], "s": 2.5, "n": 0.5, "a": [[1, 2]], "p": "/x/y", "e": "red",
        "d": {"lr": 0.1}, "ns": {"k": 1}, "set": [1, 3], "empty": {}, "none": None,
        "deep": {"a": {"b": [1, {"c": None}]}}, "dtype": "torch.float16",
    }  # fmt: skip
    flat = flatten(config)
    assert flat["deep/a/b"] == [1, {"c": None}] and flat["d/lr"] == 0.1 and flat["empty"] == {}
