"""Third-party-style trackers used by the tests (module level so worker processes import them)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from typing_extensions import override

from accelkit.trackers import GeneralTracker, register_tracker


class CSVTracker(GeneralTracker):
    """A custom file tracker: ``step,key,value`` lines in ``<logging_dir>/<run>/custom.csv``."""

    name = "csv_custom"
    requires_logging_directory = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run_dir = os.path.join(logging_dir or ".", run_name)
        self.file: Any = None

    @property
    @override
    def tracker(self) -> Any:
        return self.file

    @override
    def start(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        self.file = open(os.path.join(self.run_dir, "custom.csv"), "a")  # noqa: SIM115

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from accelkit.trackers.values import flatten

        with open(os.path.join(self.run_dir, "custom_config.json"), "w") as file:
            json.dump(flatten(values), file)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, (int, float)):
                self.file.write(f"{step},{key},{value!r}\n")
            else:
                self.warn_skipped(key, value, "skipped by the CSV tracker")

    @override
    def finish(self) -> None:
        self.file.close()


class RecordingTracker(GeneralTracker):
    """Keeps every call in memory; ``delay`` slows each ``log`` down; ``gate`` blocks it."""

    name = "recording"

    def __init__(
        self,
        name: str = "recording",
        delay: float = 0.0,
        gate: threading.Event | None = None,
        fail_in: str | None = None,
        main_process_only: bool = True,
    ) -> None:
        super().__init__(run_name="")
        self.name = name  # type: ignore[misc]
        self.main_process_only = main_process_only  # type: ignore[misc]
        self.delay = delay
        self.gate = gate
        self.fail_in = fail_in
        self.calls: list[tuple[str, Any, Any]] = []
        self.log_threads: set[str] = set()
        self.log_attempts = 0

    def _maybe_fail(self, method: str) -> None:
        if self.fail_in == method:
            raise RuntimeError(f"{self.name} broke in {method}")

    @override
    def start(self) -> None:
        self.calls.append(("start", None, None))
        self._maybe_fail("start")

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", values, None))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.log_threads.add(threading.current_thread().name)
        self.log_attempts += 1
        if self.gate is not None:
            self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        self._maybe_fail("log")
        self.calls.append(("log", values, step if not kwargs else (step, kwargs)))

    @override
    def finish(self) -> None:
        self.calls.append(("finish", None, None))
        self._maybe_fail("finish")

    def logged(self) -> list[tuple[Any, Any]]:
        return [(step, values) for kind, values, step in self.calls if kind == "log"]


class SlowStartTracker(GeneralTracker):
    """A tracker whose ``start()`` is slow, as an MLflow server's is under load (10-20 s):
    it waits for ``gate`` (at most ``limit`` seconds) before opening its run. Its runs are
    files ``<folder>/<run_id>.txt`` of ``step value`` lines, the run id being accelkit's run
    key (``name_run``); it continues the run a checkpoint names (``continue_run``)."""

    name = "slow_start"
    requires_logging_directory = False

    def __init__(
        self, folder: str, gate: threading.Event | None = None, limit: float = 60.0
    ) -> None:
        super().__init__(run_name="")
        self.folder = folder
        self.gate = gate
        self.limit = limit
        self.run_id: str | None = None
        self.key: str | None = None
        self.continued: dict[str, Any] | None = None
        self.started = threading.Event()

    @property
    @override
    def tracker(self) -> Any:
        return self.run_id

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        self.continued = reference

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        self.key = key  # the run this tracker opens: named before it opens
        return {"run_id": key}

    @override
    def start(self) -> None:
        import uuid

        if self.gate is not None:
            self.gate.wait(self.limit)
        self.run_id = (self.continued or {}).get("run_id") or self.key or uuid.uuid4().hex
        os.makedirs(self.folder, exist_ok=True)
        self.started.set()

    @override
    def run_reference(self) -> dict[str, Any] | None:
        return {"run_id": self.run_id}

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        with open(os.path.join(self.folder, f"{self.run_id}.txt"), "a") as file:
            for key, value in values.items():
                file.write(f"{step} {key} {value}\n")


def by_name(tracker: GeneralTracker) -> str:
    """Register ``tracker`` under its name and return the name, for ``log_with``: the hub
    builds it as it builds a named tracker (its run opens at its first use, in the
    background), where an instance given to ``log_with`` is started by ``init_trackers``, as
    Accelerate starts it. Building the registered class gives back ``tracker`` itself."""

    class Named(type(tracker)):  # type: ignore[misc]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return tracker  # not a Named: its __init__ is not called again

    register_tracker(Named, overwrite=True)
    return tracker.name
