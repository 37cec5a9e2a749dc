"""Fixtures of the checkpointing tests: one storage root per backend (local, memory, S3)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from accelkit.checkpointing.storage import Storage, get_storage


@dataclass
class Root:
    """A fresh, empty folder on one storage backend."""

    url: str
    storage: Storage
    options: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(params=["local", "memory", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Any) -> Root:
    """The same test on a local disk, fsspec ``memory://`` and a real S3 server."""
    if request.param == "local":
        url = str(tmp_path / "root")
        return Root(url, get_storage(url))
    if request.param == "memory":
        url = f"memory://accelkit-tests/{uuid.uuid4().hex[:12]}"
        return Root(url, get_storage(url))
    server = request.getfixturevalue("s3_server")
    url = server.new_prefix()
    options = server.storage_options
    return Root(url, get_storage(url, options), options)


@pytest.fixture
def open_gate() -> Iterator[None]:
    """``gatedfile://`` writes go through at once and fail nowhere, before and after the test
    (a test that closes the gate or injects a failure cannot leak it into the next one)."""
    from tests.checkpointing import gatedfs

    gatedfs.reset()
    yield
    gatedfs.reset()
