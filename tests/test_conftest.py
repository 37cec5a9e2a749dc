"""The suite's own ordering: the longest modules start first, and no test is lost on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import _TESTS, LONG_MODULES, longest_first

pytest_plugins = ["pytester"]

_TREE = {
    "a/test_short.py": "def test_one(): pass\ndef test_two(): pass\n",
    "b/test_long.py": (
        "import pytest\n"
        "def test_first(): pass\n"
        "class TestGroup:\n"
        "    def test_inside(self): pass\n"
        "@pytest.mark.parametrize('n', [3, 1, 2])\n"
        "def test_many(n): pass\n"
    ),
    "c/test_other.py": "def test_three(): pass\n",
    "d/test_middle.py": "def test_last(): pass\ndef test_early(): pass\n",
}
_SECONDS = {"d/test_middle.py": 50, "b/test_long.py": 90, "x/test_not_collected.py": 70}


def _collect(pytester: pytest.Pytester, reorder: bool) -> list[str]:
    """The ids of ``_TREE``'s tests, collected with or without ``longest_first``."""
    for name, source in _TREE.items():
        pytester.makepyfile(**{name.removesuffix(".py"): source})
    seen: list[str] = []

    class Plugin:
        @pytest.hookimpl(trylast=True)
        def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
            if reorder:
                items[:] = longest_first(items, pytester.path, _SECONDS)
            seen.extend(item.nodeid for item in items)

    result = pytester.inline_run(
        "--collect-only", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", plugins=[Plugin()]
    )
    assert result.ret == 0
    return seen


def test_the_listed_modules_come_first_longest_first_and_no_test_is_lost(
    pytester: pytest.Pytester,
) -> None:
    before = _collect(pytester, reorder=False)
    after = _collect(pytester, reorder=True)
    assert len(before) == 10
    assert len(after) == len(before) and sorted(after) == sorted(before)
    modules = [nodeid.split("::", 1)[0] for nodeid in after]
    assert modules == ["b/test_long.py"] * 5 + ["d/test_middle.py"] * 2 + [
        "a/test_short.py",
        "a/test_short.py",
        "c/test_other.py",
    ]
    # within a module (classes and parameters included), collection order is kept
    for module in ("b/test_long.py", "d/test_middle.py", "a/test_short.py"):
        assert [n for n in after if n.startswith(module)] == [
            n for n in before if n.startswith(module)
        ]


def test_this_session_ran_the_listed_modules_first(request: pytest.FixtureRequest) -> None:
    """The hook in tests/conftest.py is the one this very session ordered its items with."""
    items = request.session.items
    assert any(item.nodeid == request.node.nodeid for item in items)
    rank = {(_TESTS / module).resolve(): -seconds for module, seconds in LONG_MODULES.items()}
    ranks = [rank.get(item.path.resolve(), 0) for item in items]
    assert ranks == sorted(ranks)


def test_every_listed_module_exists() -> None:
    """A renamed or deleted module would silently drop out of the table."""
    missing = [module for module in LONG_MODULES if not (_TESTS / module).is_file()]
    assert missing == []
    assert all(Path(module).name.startswith("test_") for module in LONG_MODULES)
