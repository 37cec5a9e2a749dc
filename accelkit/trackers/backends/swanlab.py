"""SwanLab tracker: offline run folders go under ``<logging_dir>/swanlog``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from typing_extensions import override

from accelkit.errors import UsageError
from accelkit.trackers.backends._images import hwc_uint8
from accelkit.trackers.backends._reference import continuable_id
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["SwanLabTracker"]

# What accelkit accepts as a SwanLab run id from a checkpoint: SwanLab's own ids and accelkit's
# run keys (letters and digits, '-', '_'); anything else starts a new run.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
RESUMED_AT_STEP = "accelkit/resumed_at_step"


class SwanLabTracker(GeneralTracker):
    """Log to SwanLab, as Accelerate's ``SwanLabTracker`` (online, offline or local).

    ``init_trackers(project_name, init_kwargs={"swanlab": {...}})`` calls ``swanlab.init(
    project=project_name, **init_kwargs)`` (``mode``, ``workspace``, ``name``, ``tags``, ...).
    Unlike Accelerate's, which fails without a SwanLab API key and a terminal to type one in,
    a run with no ``mode`` given (in ``init_kwargs`` or ``SWANLAB_MODE``) and no API key
    configured (``SWANLAB_API_KEY`` or ``swanlab login``) runs offline: nothing leaves the
    machine, and ``swanlab sync <run folder>`` uploads it later. Its run folders go to
    ``<logging_dir>/swanlog`` when a logging directory is set, instead of ``./swanlog``
    (``log_dir`` in ``init_kwargs`` or ``SWANLAB_LOG_DIR`` wins). Each folder holds the run's
    records (``run-<id>.swanlab``, read with SwanLab's ``DataStoreReader``) and
    ``files/config.yaml``.

    Numbers are logged as scalars and strings as ``swanlab.Text``; SwanLab's own media objects
    go as they are; anything else is logged as its text, with one warning per key. The
    configuration is stored as plain data (tensors to numbers or lists, paths to text).

    Experiment continuity: the run's id is accelkit's run key (:meth:`name_run`; an ``id`` in
    ``init_kwargs`` wins), so every checkpoint records ``{"run_id", "project"}`` from the
    first save. A job resumed from it opens the same run (``swanlab.init(id=...,
    resume="allow")``; offline, a new folder with the same id, which ``swanlab sync`` appends
    to the same experiment), only when the checkpoint's project is this tracker's (else a
    warning and a new run). SwanLab cannot forget the points logged after the checkpoint, so
    the run's config records where it was resumed (``accelkit/resumed_at_step``). A
    ``resume`` in ``init_kwargs`` wins over the checkpoint. SwanLab keeps one run per process:
    a run this process left open is finished first (``reinit=True``, unless ``init_kwargs``
    says otherwise).

    Args:
        run_name: the SwanLab project.
        logging_dir: the run's logging directory (the run folders go under it).
        **kwargs: passed to ``swanlab.init``.
    """

    name = "swanlab"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.run: Any = None
        self._key: str | None = None  # the run id a new run gets (see name_run)
        self._resume_step: int | None = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``swanlab.Run``."""
        return self.run

    @override
    def start(self) -> None:
        import swanlab

        kwargs = dict(self.init_kwargs)
        own_dir = any(k in kwargs for k in ("log_dir", "logdir")) or any(
            os.environ.get(k) for k in ("SWANLAB_LOG_DIR", "SWANLAB_LOGDIR")
        )
        if self.logging_dir is not None and not own_dir:
            kwargs["log_dir"] = os.path.join(self.logging_dir, "swanlog")
        chosen = "mode" in kwargs or os.environ.get("SWANLAB_MODE")
        if not chosen and swanlab.Settings().api_key is None:
            kwargs["mode"] = "offline"  # no key: nothing leaves the machine (`swanlab sync`)
        kwargs.setdefault("reinit", True)
        folder = kwargs.get("log_dir") or kwargs.get("logdir")
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        if self._key is not None and "id" not in kwargs:
            kwargs["id"] = self._key
        if kwargs.get("id") is not None:
            kwargs.setdefault("resume", "allow")  # SwanLab refuses an id with resume="never"
        step, self._resume_step = self._resume_step, None
        self.run = swanlab.init(project=self.run_name or None, **kwargs)
        if step is not None:
            self.run.config.update({RESUMED_AT_STEP: step})

    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        """Whether the run's files (every folder of this run id beside this run's) already
        hold the numbers of one journal entry at ``step`` (the tracker journal asks after a
        sender was killed mid-call; SwanLab keeps the first value it got for a step)."""
        self._require_run("journal_delivered")
        numbers = {key: float(value) for key, value in values.items() if is_number(value)}
        if not numbers:
            return False
        found: dict[str, float] = {}
        for path in Path(self.run.dir).parent.glob(f"run-*-{self.run.id}/run-*.swanlab"):
            for key, at, value in _scalars(path):
                if at == step and key in numbers:
                    found[key] = value
        return found == numbers

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._require_run("store_init_configuration")
        self.run.config.update(to_plain(values))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._require_run("log")
        import swanlab

        media = _media_types(swanlab)
        for key, value in values.items():
            if is_number(value) or isinstance(value, media):
                continue
            if not isinstance(value, str):
                self.warn_skipped(key, value, "logged to SwanLab as its text")
                value = str(value)
            values[key] = swanlab.Text(value)
        self.run.log(values, step=step, **kwargs)

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images: each value is an image or a list of images (a path, a PIL image, or a
        CHW or HWC tensor or array; floats in 0-1), as ``swanlab.Image``."""
        self._require_run("log_images")
        import swanlab

        images = {
            key: [swanlab.Image(hwc_uint8(v)) for v in value]
            if isinstance(value, list)
            else swanlab.Image(hwc_uint8(value))
            for key, value in values.items()
        }
        self.run.log(images, step=step, **kwargs)

    @override
    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """A new run's id is ``key`` (an ``id`` in ``init_kwargs`` wins).

        Args:
            key: the run key.
        """
        self._key = None
        if self.init_kwargs.get("mode") == "disabled":
            return None
        run_id = self.init_kwargs.get("id") or key
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            return None
        self._key = key
        return {"run_id": run_id, "project": _project(self.run_name)}

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"run_id", "project"}`` of the open run."""
        if self.run is None:
            return None
        return {"run_id": self.run.id, "project": _project(self.run_name)}

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` open the checkpoint's run, when it is in this project.

        Args:
            reference: what :meth:`run_reference` recorded (untrusted: checked here).
            step: the checkpoint's last logging step, recorded as ``accelkit/resumed_at_step``.
        """
        self._resume_step = None
        if reference is None or "resume" in self.init_kwargs or "id" in self.init_kwargs:
            return
        run_id = continuable_id(
            "swanlab",
            reference,
            id_key="run_id",
            id_name="a SwanLab run id",
            pattern=_RUN_ID,
            expected="1-128 letters, digits, '-' or '_'",
            project=reference.get("project"),
            own_project=_project(self.run_name),
            new="run",
        )
        if run_id is None:
            self._key = None
            return
        self._key = run_id
        self._resume_step = int(step)

    def _require_run(self, method: str) -> None:
        if self.run is None:
            raise UsageError(
                f"SwanLabTracker.{method}() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )


def _project(name: str) -> str:
    """The project a run named ``name`` logs to (SwanLab's own fallbacks for an empty name)."""
    return name or os.environ.get("SWANLAB_PROJ_NAME") or Path.cwd().name


def _media_types(swanlab: Any) -> tuple[type, ...]:
    """SwanLab's media classes (logged as they are)."""
    names = ("Audio", "ECharts", "Html", "Image", "Molecule", "Object3D", "Text", "Video")
    return tuple(t for t in (getattr(swanlab, n, None) for n in names) if isinstance(t, type))


def _scalars(path: Path) -> list[tuple[str, int, float]]:
    """``(key, step, value)`` of every scalar in a SwanLab run file, read with SwanLab's
    ``DataStoreReader`` up to a torn end (a job killed while writing)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreError, DataStoreReader

    reader = DataStoreReader()
    reader.open(path)
    found = []
    kind = Record.DESCRIPTOR.oneofs[0].name
    try:
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof(kind) == "scalar":
                scalar = record.scalar
                found.append((scalar.key, int(scalar.step), float(scalar.value.number)))
    except (DataStoreError, AssertionError):
        pass
    return found
