"""The documentation site builds strictly, and its API reference covers every public name.

``mkdocs build --strict`` fails on any warning: a link to a page or an anchor that does not
exist, a page left out of the navigation, a ``::: accelkit.Name`` that no longer resolves (a
renamed or removed API name), a docstring mkdocstrings cannot parse. The build writes into a
temporary folder and fetches nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import accelkit
import accelkit.utils

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


@pytest.mark.slow  # the whole site with its API reference: about 5 s
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    page = (tmp_path / "s" / "reference" / "accelkit" / "index.html").read_text()
    # The reference is generated from the docstrings: a sentence of Accelerator's is there.
    first_line = (accelkit.Accelerator.__doc__ or "").strip().splitlines()[0]
    assert first_line and first_line.split("``")[0].strip() in page


def _documented() -> set[str]:
    """The names the reference pages render (``::: module.name``), by their last part."""
    names = set()
    for page in REFERENCE.glob("*.md"):
        names |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: (\S+)", page.read_text(), re.M)}
        names |= set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", page.read_text()))
    return names


def test_every_public_name_has_a_reference_entry() -> None:
    public = set(accelkit.__all__) - {"__version__"}
    missing = public - _documented()
    assert not missing, f"docs/reference/accelkit.md lacks {sorted(missing)}"


def test_every_utils_name_has_a_reference_entry() -> None:
    missing = set(accelkit.utils.__all__) - _documented()
    assert not missing, (
        f"docs/reference/utils.md lacks {sorted(missing)} "
        "(regenerate the page's entries for the new names)"
    )
