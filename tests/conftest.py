"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.s3 import s3_server, s3_url

__all__ = ["s3_server", "s3_url"]


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run every test not marked ``cuda`` on the CPU, also on a machine with a GPU.

    The tests feed CPU tensors, compare with CPU arithmetic and start CPU worker processes
    (which inherit the variable); the ``cuda`` tests cover the GPU paths. Without this, a GPU
    machine moves every prepared model to the GPU and those comparisons fail for the wrong
    reason.
    """
    if request.node.get_closest_marker("cuda") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ACCELKIT_USE_CPU", "1")
        yield
