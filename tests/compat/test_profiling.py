"""Accelerator.profile(): a real torch.profiler run on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from accelkit import Accelerator, ProfileKwargs


def _work() -> None:
    a = torch.randn(64, 64)
    for _ in range(3):
        a = torch.mm(a, a).tanh()


def test_profile_records_the_block() -> None:
    with Accelerator(cpu=True).profile() as prof:
        _work()
    names = {event.key for event in prof.key_averages()}
    assert "aten::mm" in names


def test_handler_from_kwargs_handlers_writes_one_trace_per_process(tmp_path: Path) -> None:
    handler = ProfileKwargs(output_trace_dir=str(tmp_path / "traces"), record_shapes=True)
    with Accelerator(cpu=True, kwargs_handlers=[handler]).profile():
        _work()
    trace = json.loads((tmp_path / "traces" / "profile_0.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


def test_schedule_calls_on_trace_ready_once_per_active_window() -> None:
    ready: list[Any] = []
    handler = ProfileKwargs(
        schedule_option={"wait": 1, "warmup": 1, "active": 1, "repeat": 2},
        on_trace_ready=ready.append,
    )
    accelerator = Accelerator(cpu=True)
    with accelerator.profile(handler) as prof:  # an explicit handler wins
        for _ in range(8):
            _work()
            prof.step()
    assert len(ready) == 2 and all(p is prof for p in ready)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activities": ["tpu"]}, "Unknown or unavailable profiler activity 'tpu'"),
        (
            {"schedule_option": {"wait": 1, "every": 2}},
            r"Unknown schedule_option key\(s\) \['every'\]",
        ),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProfileKwargs(**kwargs).build()
