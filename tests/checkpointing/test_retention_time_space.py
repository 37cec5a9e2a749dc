"""Retention by time and space (``keep_every_seconds``, ``keep_recent_seconds``,
``max_total_bytes``) against the one pure planner, ``plan_retention``.

A property test drives random runs (saves at random times with random sizes, crashed saves,
folders accelkit did not write, damaged checkpoints, prunes, the clock moving on) through the
planner exactly as training's rotation (after every save, the new checkpoint spared) and
``accelkit ckpt prune`` (checksums checked, stale incomplete folders removed) call it, and checks
every plan against an oracle written independently of the planner: the newest intact
checkpoint is kept, each rule keeps what it says, the budget is met unless only protected
folders are left, and nothing accelkit did not write is ever removed.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelkit.checkpointing import ProjectConfiguration
from accelkit.checkpointing.catalog.retention import (
    KeepAll,
    KeepEverySeconds,
    KeepLast,
    KeepRecent,
    MaxTotalBytes,
    RetentionPlan,
    RetentionPolicy,
    build_policy,
    plan_retention,
)
from accelkit.checkpointing.formats.layout import MANIFEST_NAME


@dataclass(frozen=True)
class Folder:
    """A folder as the listing reports it (what ``CheckpointInfo`` carries for the plan)."""

    name: str
    iteration: int | None
    created: float
    size_bytes: int
    state: str = "committed"
    is_automatic: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    damaged: bool = False  # a flipped byte: only a checksum check (prune) sees it


@dataclass(frozen=True)
class Rules:
    keep_last: int | None
    keep_every: int | None
    every_seconds: float | None
    recent_seconds: float | None
    max_bytes: int | None

    def policy(self) -> RetentionPolicy:
        return build_policy(
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_every_seconds=self.every_seconds,
            keep_recent_seconds=self.recent_seconds,
            max_total_bytes=self.max_bytes,
        )


def _age(f: Folder) -> tuple[int, float, str]:
    return (-1 if f.iteration is None else f.iteration, f.created, f.name)


def _removable(f: Folder) -> bool:
    return f.state == "committed" and f.is_automatic


def check_plan(
    listed: Sequence[Folder],
    rules: Rules,
    plan: RetentionPlan[Folder],
    now: float,
    spare: set[str],
    checked: bool,
    prune: bool,
) -> None:
    """Every promise of the plan, checked without the planner's code."""
    deleted = {f.name for f in plan.delete}
    removed = deleted | {f.name for f in plan.incomplete}
    over = {f.name for f in plan.over_budget}
    assert len(deleted) == len(plan.delete) and over <= deleted
    # Only committed checkpoint_<n> folders (and, for prune, stale incomplete ones) go.
    for f in plan.delete:
        assert _removable(f), f"{f.name} ({f.state}) deleted"
    committed = sorted((f for f in listed if _removable(f)), key=_age)
    for f in plan.incomplete:
        assert prune and f.state == "incomplete" and f.iteration is not None
        assert committed and committed[-1].iteration is not None
        assert f.iteration < committed[-1].iteration
    if prune and committed:
        newest = committed[-1].iteration
        assert newest is not None
        stale = {
            f.name
            for f in listed
            if f.state == "incomplete" and f.iteration is not None and f.iteration < newest
        }
        assert {f.name for f in plan.incomplete} == stale
    assert not removed & spare
    # Damaged ones the check found are kept; the newest intact checkpoint is kept.
    if isinstance(rules.policy(), KeepAll):  # no rule: nothing committed is ever deleted
        assert not plan.delete and not plan.damaged and plan.over_by == 0
        return
    found = {f.name for f, _ in plan.damaged}
    assert not found & deleted
    assert all(f.damaged for f, _ in plan.damaged) and (checked or not found)
    intact = [f for f in committed if not (checked and f.damaged)]
    if intact:
        assert plan.intact is not None and plan.intact.name == intact[-1].name
        assert intact[-1].name not in removed
    else:
        assert plan.intact is None and not plan.delete
    # The rules, over the checkpoints the plan counted (the committed ones not found damaged).
    counted = [f for f in committed if f.name not in found]
    kept_by_rule: set[str] = set()
    if (rules.keep_last, rules.keep_every, rules.every_seconds, rules.recent_seconds) == (
        None,
    ) * 4:
        kept_by_rule = {f.name for f in counted}  # a budget alone keeps what fits
    if rules.keep_last is not None:
        kept_by_rule |= {f.name for f in counted[-rules.keep_last :]}
    if rules.keep_every is not None:
        kept_by_rule |= {
            f.name
            for f in counted
            if f.iteration is not None and f.iteration % rules.keep_every == 0
        }
    if rules.recent_seconds is not None:
        kept_by_rule |= {f.name for f in counted if f.created >= now - rules.recent_seconds}
    if rules.every_seconds is not None:
        windows: dict[int, list[Folder]] = {}
        for f in counted:
            windows.setdefault(math.floor(f.created / rules.every_seconds), []).append(f)
        for members in windows.values():
            survivors = [f for f in members if f.name not in deleted]
            # every window keeps one, unless the budget removed it
            assert survivors or any(f.name in over for f in members)
            kept_by_rule.add(min(members, key=lambda f: (f.created, _age(f))).name)
    for f in counted:
        if f.name in kept_by_rule:
            assert f.name not in deleted or f.name in over, f"{f.name} kept by a rule, deleted"
        elif f.name not in spare and f is not plan.intact and f.name not in deleted:
            # each rule keeps what it says, nothing more (a damaged one deleted unasked is
            # fine: it counted as intact and no rule kept it)
            pytest.fail(f"{f.name} is kept by no rule and was not deleted")
    # The budget: met, or only what may not be deleted is left; oldest removed first.
    left = sum(f.size_bytes for f in listed if f.name not in removed)
    if rules.max_bytes is None:
        assert not over and plan.over_by == 0
        return
    assert plan.over_by == max(0, left - rules.max_bytes)
    still_removable = [
        f for f in counted if f.name not in deleted and f.name not in spare and f is not plan.intact
    ]
    if left > rules.max_bytes:
        assert not still_removable, "over budget with removable checkpoints left"
    if over:
        youngest_over = max(_age(f) for f in plan.over_budget)
        assert all(_age(f) > youngest_over for f in still_removable), "budget removed a newer one"
        last = max(plan.over_budget, key=_age)
        assert left + last.size_bytes > rules.max_bytes, "budget removed more than needed"


# ------------------------------------------------------------------------- the random runs

_seconds = st.one_of(st.none(), st.sampled_from([30.0, 60.0, 100.0, 600.0, 3600.0]))
_rules = st.builds(
    Rules,
    keep_last=st.one_of(st.none(), st.integers(1, 4)),
    keep_every=st.one_of(st.none(), st.integers(2, 5)),
    every_seconds=_seconds,
    recent_seconds=_seconds,
    max_bytes=st.one_of(st.none(), st.integers(1, 400)),
)
# (kind, seconds since the last event, size or flag)
_events = st.lists(
    st.tuples(
        st.sampled_from(
            ["save", "save", "save", "save", "crash", "foreign", "prune", "wait", "damage"]
        ),
        st.integers(0, 200),
        st.integers(1, 60),
    ),
    max_size=25,
)
_OTHERS = (
    ("foreign", True),  # a checkpoint_<n> folder accelkit did not write
    ("accelerate", False),  # Hugging Face accelerate's step_<n>
    ("committed", False),  # saved by the script under its own name
    ("corrupt", True),
)


def _simulate(rules: Rules, events: list[tuple[str, int, int]]) -> None:
    policy = rules.policy()
    now = 1_700_000_000.0
    folders: dict[str, Folder] = {}
    number = 0

    def listed() -> list[Folder]:
        return sorted(folders.values(), key=_age)

    def apply(plan: RetentionPlan[Folder]) -> None:
        for f in [*plan.delete, *plan.incomplete]:
            del folders[f.name]

    asked: list[str] = []

    def damage(f: Folder) -> str | None:  # prune's checksum check
        asked.append(f.name)
        return "checksum differs" if f.damaged else None

    for kind, dt, value in events:
        now += dt
        if kind == "save":
            name = f"checkpoint_{number}"
            folders[name] = Folder(name, number, now, value)
            number += 1
            # training's rotation: trusts what the listing checked, spares the new one
            plan = plan_retention(listed(), policy, lambda f: None, now=now, spare={name})
            check_plan(listed(), rules, plan, now, {name}, checked=False, prune=False)
            apply(plan)
        elif kind == "crash":
            name = f"checkpoint_{number}"
            folders[name] = Folder(name, number, 0.0, value, state="incomplete")
            number += 1
        elif kind == "foreign":
            state, automatic = _OTHERS[value % len(_OTHERS)]
            name = f"checkpoint_{number}" if automatic else f"other_{number}"
            folders[name] = Folder(name, number, now, value, state, is_automatic=False)
            number += 1
        elif kind == "damage" and folders:
            victim = listed()[value % len(folders)]
            if victim.state == "committed":
                folders[victim.name] = Folder(
                    victim.name,
                    victim.iteration,
                    victim.created,
                    victim.size_bytes,
                    is_automatic=victim.is_automatic,
                    damaged=True,
                )
        elif kind == "prune":
            asked.clear()
            plan = plan_retention(listed(), policy, damage, now=now, remove_incomplete=True)
            assert len(asked) == len(set(asked)), "a checkpoint was checked twice"
            check_plan(listed(), rules, plan, now, set(), checked=True, prune=True)
            apply(plan)


# Hypothesis explores and shrinks a failure to a short run; its generation costs ~2-4 ms a run
# here, so it gets 1,500 of them, and the target of 10,000 runs is met by the sweep
# below (the same simulation and oracle, runs drawn from a fixed seed: ~0.4 ms a run).
@pytest.mark.slow
@settings(max_examples=1_500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=_rules, events=_events)
def test_random_runs_keep_every_promise(rules: Rules, events: list[tuple[str, int, int]]) -> None:
    _simulate(rules, events)


@pytest.mark.slow
def test_ten_thousand_seeded_runs_keep_every_promise() -> None:
    draw = random.Random(42)
    kinds = ["save"] * 4 + ["crash", "foreign", "prune", "wait", "damage"]
    seconds = [None, 30.0, 60.0, 100.0, 600.0, 3600.0]
    for _ in range(10_000):
        rules = Rules(
            keep_last=draw.choice([None, 1, 2, 3, 4]),
            keep_every=draw.choice([None, 2, 3, 5]),
            every_seconds=draw.choice(seconds),
            recent_seconds=draw.choice(seconds),
            max_bytes=draw.choice([None, draw.randint(1, 400)]),
        )
        events = [
            (draw.choice(kinds), draw.randint(0, 200), draw.randint(1, 60))
            for _ in range(draw.randint(0, 25))
        ]
        _simulate(rules, events)


# ------------------------------------------------------------------------- the rules, by hand


def _run(*specs: tuple[int, float, int]) -> list[Folder]:
    return [Folder(f"checkpoint_{i}", i, created, size) for i, created, size in specs]


def _names(folders: Sequence[Folder]) -> list[str]:
    return [f.name for f in folders]


_OK: Callable[[Folder], str | None] = lambda f: None  # noqa: E731


def test_keep_every_seconds_keeps_the_first_of_each_window() -> None:
    # windows of 100 s: [0, 100) holds 0, 1, 2; [100, 200) holds 3; [200, 300) holds 4, 5, 6
    run = _run((0, 10, 1), (1, 50, 1), (2, 99, 1), (3, 150, 1), (4, 210, 1), (5, 250, 1))
    run.append(Folder("checkpoint_6", 6, 290, 1))
    plan = plan_retention(run, KeepEverySeconds(100), _OK, now=300)
    # 6 is not the first of its window, but the newest checkpoint: kept all the same
    assert _names(plan.delete) == ["checkpoint_1", "checkpoint_2", "checkpoint_5"]
    assert plan.protected is run[6]
    # the same one is kept at every later save
    plan = plan_retention(run[:4], KeepEverySeconds(100), _OK, now=300)
    assert _names(plan.delete) == ["checkpoint_1", "checkpoint_2"]


def test_keep_recent_keeps_all_of_the_window_and_needs_now() -> None:
    run = _run((0, 100, 1), (1, 500, 1), (2, 900, 1), (3, 950, 1), (4, 1100, 1))
    plan = plan_retention(run, build_policy(keep_last=1, keep_recent_seconds=200), _OK, now=1100)
    assert _names(plan.delete) == ["checkpoint_0", "checkpoint_1"]
    with pytest.raises(ValueError, match="now="):
        plan_retention(run, KeepRecent(200), _OK)


def test_budget_removes_the_oldest_kept_until_the_folder_fits() -> None:
    run = _run((0, 0, 40), (1, 10, 40), (2, 20, 40), (3, 30, 40))
    foreign = Folder("notes", None, 0.0, 30, state="foreign", is_automatic=False)
    # the rules keep all four (160 B) + 30 B foreign: 190 B over a 120 B budget
    plan = plan_retention([*run, foreign], MaxTotalBytes(KeepAll(), 120), _OK, now=30)
    assert _names(plan.over_budget) == ["checkpoint_0", "checkpoint_1"]
    assert _names(plan.delete) == ["checkpoint_0", "checkpoint_1"] and plan.over_by == 0
    # only the newest and the foreign folder left, still over: said, not forced
    plan = plan_retention([*run, foreign], MaxTotalBytes(KeepLast(4), 10), _OK, now=30)
    assert _names(plan.delete) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert plan.intact is run[3] and plan.over_by == 40 + 30 - 10


def test_budget_spares_the_checkpoint_just_committed_and_damaged_ones() -> None:
    run = _run((0, 0, 50), (1, 10, 50), (2, 20, 50))

    def damage(f: Folder) -> str | None:
        return "bad" if f.iteration == 2 else None

    plan = plan_retention(run, MaxTotalBytes(KeepLast(3), 60), damage, now=30)
    # 2 is damaged (kept, not counted): 1 is the newest intact, so only 0 may go
    assert _names(plan.delete) == ["checkpoint_0"] and plan.over_by == 40
    plan = plan_retention(run, MaxTotalBytes(KeepLast(3), 60), _OK, now=30, spare={"checkpoint_0"})
    assert _names(plan.delete) == ["checkpoint_1"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_every_seconds": 0}, "keep_every_seconds must be a finite number of seconds > 0"),
        ({"keep_every_seconds": float("nan")}, "keep_every_seconds must be a finite"),
        ({"keep_recent_seconds": "1h"}, "keep_recent_seconds must be a number of seconds"),
        ({"keep_recent_seconds": True}, "keep_recent_seconds must be a number of seconds"),
        ({"max_total_bytes": 0}, "max_total_bytes must be an int number of bytes >= 1"),
        ({"max_total_bytes": 1.5}, "max_total_bytes must be an int number of bytes >= 1"),
        ({"max_total_bytes": "5 parsecs"}, "Invalid max_total_bytes '5 parsecs'.*'10GB'"),
    ],
)
def test_configuration_refuses_bad_values_naming_them(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ProjectConfiguration(**kwargs)  # type: ignore[arg-type]


def test_configuration_takes_a_human_size() -> None:
    config = ProjectConfiguration(max_total_bytes="5GB", keep_recent_seconds=3600)
    assert config.max_total_bytes == 5 * 10**9
    policy = config.retention_policy()
    assert isinstance(policy, MaxTotalBytes) and policy.max_bytes == 5 * 10**9
    assert policy.policy == KeepRecent(3600)


# ------------------------------------------------------------------------- end to end


def _accelerator(project: Path, **config: Any) -> Any:
    from accelkit import Accelerator

    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, **config
        )
    )
    accelerator.prepare(torch.nn.Linear(4, 2))
    return accelerator


def _commit_time(folder: Path, created: float) -> None:
    """Move a checkpoint's commit time (what its manifest records): a fake clock, no sleep."""
    manifest = folder / MANIFEST_NAME
    payload = json.loads(manifest.read_text())
    payload["created"] = created
    manifest.write_text(json.dumps(payload))


def _present(project: Path) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir())


def test_save_state_rotation_keeps_one_an_hour_and_the_last_ten_minutes(tmp_path: Path) -> None:
    accelerator = _accelerator(
        tmp_path, total_limit=1, keep_every_seconds=3600, keep_recent_seconds=600
    )
    now = time.time()
    hour = math.floor(now / 3600) * 3600
    ages = [hour - 3 * 3600 + 5, hour - 3 * 3600 + 100, hour - 2 * 3600 + 5, now - 300]
    for i, created in enumerate(ages):
        accelerator.save_state()
        _commit_time(tmp_path / "checkpoints" / f"checkpoint_{i}", created)
    accelerator.save_state()
    # 1 is the second of its hour, not recent, not the newest: the only one rotated away
    assert _present(tmp_path) == [f"checkpoint_{i}" for i in (0, 2, 3, 4)]
    accelerator.project_configuration.keep_recent_seconds = None
    _commit_time(tmp_path / "checkpoints" / "checkpoint_3", hour + 1)
    _commit_time(tmp_path / "checkpoints" / "checkpoint_4", hour + 2)
    accelerator.save_state()  # 3 is the first of this hour, 5 the newest: 4 goes
    assert _present(tmp_path) == [f"checkpoint_{i}" for i in (0, 2, 3, 5)]


def test_save_state_rotation_fits_the_byte_budget_never_removing_the_newest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    accelerator = _accelerator(tmp_path)
    ckpts = tmp_path / "checkpoints"
    accelerator.save_state(str(ckpts / "best"))  # named by the script: counted, never removed
    size = sum(p.stat().st_size for p in (ckpts / "best").iterdir())
    accelerator.project_configuration.max_total_bytes = int(3.5 * size)
    for _ in range(5):
        accelerator.save_state()
    # (best took number 0: every save_state moves the counter on, as in Accelerate)
    assert _present(tmp_path) == ["best", "checkpoint_4", "checkpoint_5"]
    accelerator.project_configuration.max_total_bytes = size // 2
    with caplog.at_level(logging.WARNING):
        accelerator.save_state()
    assert _present(tmp_path) == ["best", "checkpoint_6"]
    assert "exceed max_total_bytes by" in caplog.text


def test_ckpt_prune_time_and_size_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from accelkit.cli.main import main

    def prune(*flags: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(["ckpt", "prune", str(tmp_path), *flags])
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    accelerator = _accelerator(tmp_path)
    now = time.time()
    day = math.floor(now / 86400) * 86400
    # The two recent ones stay inside today even when the test runs just after midnight UTC
    # (otherwise checkpoint_3 joins yesterday's day and --keep-one-every keeps checkpoint_2).
    recent = max(now - 1800, day + 1)
    ages = [
        day - 2 * 86400 + 1,
        day - 2 * 86400 + 2,
        day - 86400 + 1,
        recent,
        max(now - 60, recent),
    ]
    for i, created in enumerate(ages):
        accelerator.save_state()
        _commit_time(tmp_path / "checkpoints" / f"checkpoint_{i}", created)
    (tmp_path / "checkpoints" / "checkpoint_5").mkdir()  # a foreign checkpoint_<n>: never removed
    (tmp_path / "checkpoints" / "checkpoint_5" / "mine.txt").write_text("not accelkit's")

    code, out, err = prune("--keep-one-every", "1d", "--keep-recent", "1h", "--dry-run")
    assert code == 0, err
    assert (
        "checkpoint_1" in out and "not kept by --keep-one-every 86400s --keep-recent 3600s" in out
    )
    assert len(_present(tmp_path)) == 6  # a dry run
    code, out, err = prune("--keep-one-every", "1d", "--keep-recent", "1h", "--yes")
    assert code == 0, err
    left = [f"checkpoint_{i}" for i in (0, 2, 3, 4, 5)]
    assert _present(tmp_path) == left
    assert "Keeping checkpoint_5" in err

    size = sum(p.stat().st_size for p in (tmp_path / "checkpoints" / "checkpoint_4").iterdir())
    budget = f"{2.5 * size / 1000:.3f}KB"  # fits the foreign folder and two checkpoints
    code, out, err = prune("--keep-one-every", "1d", "--max-bytes", budget, "--yes")
    assert code == 0, err
    assert "oldest over --max-bytes" in out
    assert _present(tmp_path) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    code, out, err = prune("--keep", "5", "--max-bytes", "1", "--yes")
    assert code == 0, err
    assert _present(tmp_path) == ["checkpoint_4", "checkpoint_5"]
    assert "over --max-bytes after this prune" in err

    code, _, err = prune("--max-bytes", "5 parsecs")
    assert code == 2 and "Invalid --max-bytes '5 parsecs'" in err and "'10GB'" in err
    code, _, err = prune("--keep-recent", "0s")
    assert code == 2 and "--keep-recent must be a finite duration > 0" in err
    code, _, err = prune("--dry-run")
    assert code == 2 and "prune needs a rule: --keep N" in err
