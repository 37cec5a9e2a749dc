"""Find the installed reference package's test scripts and port them by renaming imports."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

__all__ = ["port_script", "reference_root"]

# ``from accelerate.x import y`` / ``import accelerate.x`` at any indentation; nothing else in a
# script is touched (the rule of the README: "once its imports say accelkit").
_IMPORT = re.compile(r"^(\s*)(from|import)(\s+)accelerate(?=[\s.,]|$)", re.MULTILINE)


def reference_root() -> Path | None:
    """The installed ``accelerate`` package folder (without importing it), or None."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def port_script(source: Path, target_dir: Path) -> Path:
    """Copy ``source`` into ``target_dir`` with its ``accelerate`` imports renamed to accelkit.

    Raises:
        AssertionError: if the script does not import accelerate at all (then the rename proves
            nothing), or if an ``accelerate`` import survives the rename.
    """
    text = source.read_text()
    ported, count = _IMPORT.subn(r"\1\2\3accelkit", text)
    assert count > 0, f"{source} has no accelerate import to rename"
    left = [
        line for line in ported.splitlines() if re.match(r"\s*(from|import)\s+accelerate\b", line)
    ]
    assert not left, f"imports left unported in {source.name}: {left}"
    target = target_dir / source.name
    target.write_text(ported)
    return target
