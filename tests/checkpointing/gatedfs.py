"""A real local filesystem, registered in fsspec as ``gatedfile://``, whose writes can be held
back or made to fail: the tool that makes a background save deterministically slow.

``gatedfile:///tmp/x/f`` is the local file ``/tmp/x/f``; every write to a file inside a
checkpoint (a path containing ``/checkpoints/``) first waits until
:attr:`GatedFileSystem.gate` is set, and raises ``OSError`` if the file's path contains
:attr:`GatedFileSystem.fail_on`. Other files (the project's save lock, and the save marker
``.accelkit-save.json`` that a save writes before it returns) are written at once.
Files are real files, so what a save left can be read back with plain local paths.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from accelkit.checkpointing.formats.layout import SAVE_MARKER_NAME

__all__ = ["PROTOCOL", "GatedFileSystem", "gated_url", "reset"]

PROTOCOL = "gatedfile"
_WAIT_LIMIT_S = 120.0


class GatedFileSystem(LocalFileSystem):
    """The local disk, with a gate in front of every write."""

    protocol = (PROTOCOL,)
    gate = threading.Event()
    """Writes wait until this is set."""
    fail_on: str | None = None
    """Writes to a path containing this substring raise ``OSError``."""
    writes_waiting = threading.Event()
    """Set once a write has reached the closed gate."""

    @classmethod
    def before_write(cls, path: str) -> None:
        if "/checkpoints/" not in path or path.endswith("/" + SAVE_MARKER_NAME):
            return
        if not cls.gate.is_set():
            cls.writes_waiting.set()
            if not cls.gate.wait(_WAIT_LIMIT_S):
                raise TimeoutError(f"gate for {path} never opened (test bug)")
        if cls.fail_on is not None and cls.fail_on in path:
            raise OSError(f"injected write failure on {path}")

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        file = super()._open(path, mode, block_size, **kwargs)
        if "w" in mode or "a" in mode:
            return _GatedFile(file, self._strip_protocol(path))
        return file


class _GatedFile:
    def __init__(self, file: Any, path: str) -> None:
        self._file = file
        self._path = path

    def write(self, data: Any) -> int:
        GatedFileSystem.before_write(self._path)
        written: int = self._file.write(data)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _GatedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file.close()


def gated_url(local_path: Any) -> str:
    """``gatedfile://`` URL of a local path."""
    return f"{PROTOCOL}://{local_path}"


def reset() -> None:
    """Open the gate and stop injecting failures."""
    GatedFileSystem.gate.set()
    GatedFileSystem.writes_waiting.clear()
    GatedFileSystem.fail_on = None


fsspec.register_implementation(PROTOCOL, GatedFileSystem, clobber=True)
reset()
