"""The README's commands are the ones CI and new users actually run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command() -> None:
    commands = [b.strip() for b in _bash_blocks() if "pytest" in b]
    assert commands, "README.md has no bash block running pytest"
    assert commands[0] in (ROOT / ".ci" / "run").read_text()


def test_readme_main_job_points_at_an_existing_example() -> None:
    main_job = next(b for b in _bash_blocks() if "accelkit launch" in b)
    script = re.search(r"(examples/\S+\.py)", main_job)
    assert script is not None and (ROOT / script.group(1)).is_file()


def test_readme_is_a_first_visit_with_links_that_resolve() -> None:
    """The README stays short (the guides hold the reference) and its relative links name
    files of the repository (the site's strict build checks the pages' own links)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert "docs/getting-started.md" in links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
