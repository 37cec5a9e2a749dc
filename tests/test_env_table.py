"""One table of environment variables (``accelkit._env.VARIABLES``): the package reads no
variable outside it, the reference page prints every row as the table has it, and a value that
is not a number is refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from accelkit import _env
from accelkit.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "environment.md"


def _names_in_the_package() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "accelkit").rglob("*.py"):
        if path.name == "_env.py":  # the table itself
            continue
        names.update(re.findall(r"ACCELKIT_[A-Z][A-Z_]*", path.read_text()))
    return names


def test_the_package_reads_only_the_variables_of_the_table() -> None:
    families = tuple(name[:-1] for name in _env.VARIABLES if name.endswith("*"))
    outside = {
        name
        for name in _names_in_the_package()
        if name not in _env.VARIABLES and not name.startswith(families)
    }
    assert not outside, f"add these to accelkit._env.VARIABLES, documented: {sorted(outside)}"
    # and the table names nothing the package never reads
    read = _names_in_the_package() - {"ACCELKIT_"}
    unread = {
        name
        for name in _env.VARIABLES
        if not any(n == name or (name.endswith("*") and n.startswith(name[:-1])) for n in read)
    }
    assert not unread, unread


def test_the_reference_page_prints_the_table() -> None:
    rows = {
        m.group(1): (m.group(2), m.group(3))
        for m in re.finditer(
            r"^\| `([A-Z_*]+)` \| ([^|]+) \| [^|]+ \| ([^|]+) \|$", PAGE.read_text(), re.M
        )
    }
    assert set(rows) == set(_env.VARIABLES)
    for name, variable in _env.VARIABLES.items():
        default, setter = rows[name]
        assert default.strip() == (f"`{variable.default}`" if variable.default else "unset"), name
        assert setter.strip() == ("you" if variable.setter == "you" else "`accelkit launch`"), name


def test_a_number_that_is_not_one_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "soon")
    with pytest.raises(ConfigurationError, match=r"ACCELKIT_TRACKER_TIMEOUT='soon'.*default 60"):
        _env.number("ACCELKIT_TRACKER_TIMEOUT")
    for bad in ("-1", "inf", "nan"):
        monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", bad)
        with pytest.raises(ConfigurationError):
            _env.number("ACCELKIT_TRACKER_TIMEOUT")
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", " ")
    assert _env.number("ACCELKIT_TRACKER_TIMEOUT") == 60.0
    monkeypatch.setenv("ACCELKIT_TRACKER_TIMEOUT", "2.5")
    assert _env.number("ACCELKIT_TRACKER_TIMEOUT") == 2.5


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("0", False), ("OFF", False), ("false", False), ("1", True)]
)
def test_a_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv("ACCELKIT_DIRECT_IO", raising=False)
    else:
        monkeypatch.setenv("ACCELKIT_DIRECT_IO", value)
    assert _env.switch("ACCELKIT_DIRECT_IO") is on
