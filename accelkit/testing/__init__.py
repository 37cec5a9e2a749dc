"""Contract test suites for code that plugs into accelkit: storages and trackers.

accelkit runs its own backends through these suites; the author of a third-party storage or
tracker runs the same ones on theirs. Each is a pytest mixin class (the pattern of fsspec's
``fsspec/tests/abstract``): subclass it in a test module, give it what it asks for, and pytest
collects every contract test for your backend. Importing :mod:`accelkit` never imports this
package (nor pytest); import it from your tests only (it needs ``pytest``:
``pip install 'accelkit[testing]'``).

Testing your own storage
------------------------

The checkpoint code is typed with, and calls only the methods of,
:class:`accelkit.checkpointing.storage.Storage`: subclass it (implement its abstract primitives;
it writes the derived methods on them), or ``FsspecStorage`` from
:mod:`accelkit.checkpointing.storage.fsspec` to adjust an fsspec filesystem, and serve your URLs
with it::

    register_storage("myproto", lambda protocol, options: MyStorage(**options))

Then give the suite a fixture ``storage_root`` that returns the storage and the URL of a
fresh, empty folder on it::

    import uuid

    import pytest

    from accelkit.checkpointing.storage import get_storage
    from accelkit.testing import StorageContract


    class TestMyStorage(StorageContract):
        @pytest.fixture
        def storage_root(self):
            url = f"myproto://test-bucket/{uuid.uuid4().hex}"
            return get_storage(url), url

Testing your own tracker
------------------------

Name the tracker, the files it must write under the logging dir, and how to read back the
scalars and the configuration it stored (``{key: [(step, value), ...]}`` and a flat
``{key: value}`` dict, nested keys joined by ``/``)::

    from accelkit.testing import TrackerContract

    from mypackage import MyTracker, read_my_files


    class TestMyTracker(TrackerContract):
        log_with = "my_tracker"          # MyTracker.name
        register = MyTracker             # omit if an entry point registers it
        files = "conformance/*.log"      # a glob under the logging dir
        unwrapped = "MyRunObject"        # type(get_tracker(name, unwrap=True)).__name__

        def read_back(self, logging_dir, run):
            return read_my_files(logging_dir, run)

The suite drives the tracker through a real ``Accelerator`` (``init_trackers`` with a nested
configuration, five ``log`` calls mixing tensors, NumPy and Python numbers, text and an object
that cannot be logged, ``end_training``) and checks that nothing was written outside the
logging dir, that no call failed, and that every value reads back. Run it offline: the suite
sets no environment variable for you.

Public API: :class:`StorageContract` (:mod:`accelkit.testing.storage`),
:class:`TrackerContract` (:mod:`accelkit.testing.trackers`); both are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accelkit._lazy import lazy_getattr

if TYPE_CHECKING:
    from accelkit.testing.storage import StorageContract
    from accelkit.testing.trackers import TrackerContract

__all__ = ["StorageContract", "TrackerContract"]

__getattr__ = lazy_getattr(
    __name__,
    {
        "StorageContract": "accelkit.testing.storage",
        "TrackerContract": "accelkit.testing.trackers",
    },
)
