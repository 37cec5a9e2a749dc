"""``ProjectConfiguration`` grouped by concern: Accelerate's fields, a few options objects, and
the flat names of the 0.x releases as aliases that read and write the options (issue #38)."""

from __future__ import annotations

import dataclasses

import pytest

from accelkit import ProjectConfiguration
from accelkit.checkpointing import (
    AsyncOptions,
    PreemptionOptions,
    ReplicationOptions,
    RetentionOptions,
    SaveOptions,
)
from accelkit.checkpointing.config import FLAT_ALIASES
from accelkit.errors import ConfigurationError

ACCELERATE_FIELDS = [
    "project_dir",
    "logging_dir",
    "automatic_checkpoint_naming",
    "total_limit",
    "iteration",
    "save_on_each_node",
]

# One value per flat name, unlike its default, that passes validation.
FLAT_VALUES = {
    "keep_every": 10,
    "keep_best": 2,
    "best_metric": "loss",
    "best_mode": "max",
    "keep_every_seconds": 3600.0,
    "keep_recent_seconds": 60.0,
    "max_total_bytes": 2**30,
    "save_every_steps": 5,
    "save_every_seconds": 30.0,
    "verify_checksums": False,
    "storage_retry_seconds": 7.0,
    "async_save": True,
    "async_writer": "thread",
    "async_snapshot": "overlapped",
    "replicate_to": "memory://remote-tier",
    "replicate_keep": 3,
    "replicate_deadline_seconds": 9.0,
    "replicate_queue_size": 2,
    "replicate_local_budget_bytes": 0,
    "replicate_preemption_seconds": 4.0,
    "preemption_signals": ("SIGUSR1",),
    "preemption_exit_code": 3,
    "memory_snapshot_every_steps": 100,
}


def test_one_options_field_per_concern_accelerates_first() -> None:
    # Accelerate's 6 fields, 3 of accelkit's own, one options object per concern (retention,
    # saving, asynchronous saves, replication, preemption, the memory tier): a new setting
    # joins its concern's object instead of adding a flat field.
    names = [f.name for f in dataclasses.fields(ProjectConfiguration)]
    assert len(names) <= 15, names
    assert names[:6] == ACCELERATE_FIELDS
    assert not set(names) & set(FLAT_ALIASES)  # aliases are attributes, never fields
    assert set(FLAT_VALUES) == set(FLAT_ALIASES)


def test_accelerates_positional_order_still_works() -> None:
    config = ProjectConfiguration("/tmp/run", "/tmp/logs", True, 3, 7, True)
    assert (config.project_dir, config.logging_dir, config.total_limit) == (
        "/tmp/run",
        "/tmp/logs",
        3,
    )
    assert (config.automatic_checkpoint_naming, config.iteration, config.save_on_each_node) == (
        True,
        7,
        True,
    )


@pytest.mark.parametrize("flat", sorted(FLAT_ALIASES))
def test_each_flat_name_is_an_alias_of_its_option(flat: str) -> None:
    group, option = FLAT_ALIASES[flat]
    value = FLAT_VALUES[flat]
    extra = {"best_metric": "loss"} if flat == "keep_best" else {}
    config = ProjectConfiguration(project_dir="/tmp/run", **{flat: value}, **extra)
    assert getattr(getattr(config, group), option) == value
    assert getattr(config, flat) == value
    # written through the alias, read from the option
    fresh = ProjectConfiguration(project_dir="/tmp/run")
    setattr(fresh, flat, value)
    assert getattr(getattr(fresh, group), option) == value
    assert dataclasses.replace(config, iteration=1) == dataclasses.replace(config, iteration=1)


def test_options_objects_and_mappings() -> None:
    retention = RetentionOptions(keep_best=2, best_metric="loss")
    config = ProjectConfiguration(
        retention=retention,
        saving=SaveOptions(every_steps=100),
        asynchronous={"enabled": True, "writer": "thread"},
        replication=ReplicationOptions(to="memory://remote-tier", keep=5),
        preemption=PreemptionOptions(signals=("SIGTERM",)),
        keep_best=4,  # a flat name overrides its option ...
    )
    assert config.keep_best == 4 and config.best_metric == "loss"
    assert retention.keep_best == 2  # ... on a copy: the caller's object is never changed
    assert config.async_save and config.async_writer == "thread"
    assert config.save_every_steps == 100 and config.replicate_keep == 5
    assert config.preemption_signal_numbers()
    assert config.asynchronous == AsyncOptions(enabled=True, writer="thread")


def test_bad_keywords_and_options_are_named() -> None:
    with pytest.raises(
        TypeError, match=r"unexpected keyword arguments \['keep_last'\].*keep_every"
    ):
        ProjectConfiguration(keep_last=3)
    with pytest.raises(TypeError, match=r"retention must be a RetentionOptions.*got int"):
        ProjectConfiguration(retention=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"saving has unknown keys \['every'\]"):
        ProjectConfiguration(saving={"every": 3})


def test_bad_values_in_options_get_the_flat_names_errors() -> None:
    with pytest.raises(ConfigurationError, match=r"async_writer must be one of .*'proc'"):
        ProjectConfiguration(asynchronous=AsyncOptions(writer="proc"))
    with pytest.raises(ValueError, match=r"replicate_queue_size must be an int >= 1"):
        ProjectConfiguration(replication=ReplicationOptions(queue_size=0))
    with pytest.raises(ValueError, match=r"keep_best needs.*best_metric"):
        ProjectConfiguration(retention=RetentionOptions(keep_best=2))
    with pytest.raises(ConfigurationError, match="save_every_steps"):
        ProjectConfiguration(saving=SaveOptions(every_steps=0))
