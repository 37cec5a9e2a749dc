"""DVCLive tracker: a run is a DVCLive folder, ``<logging_dir>/<run_name>/dvclive``.

DVCLive keeps a run as plain files: one ``plots/metrics/<name>.tsv`` per metric (a header line,
then ``step<TAB>value`` rows), the latest values in ``metrics.json`` and the parameters in
``params.yaml``. A resumed job continues the same folder and drops the rows the abandoned
attempt logged after the checkpoint (see :class:`DVCLiveTracker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from typing_extensions import override

from accelkit._text import short
from accelkit.errors import UsageError
from accelkit.trackers.backends._files import TrackerFileError, same_path
from accelkit.trackers.backends._images import hwc_uint8
from accelkit.trackers.base import GeneralTracker
from accelkit.trackers.values import is_number, to_plain

__all__ = ["DVCLiveTracker"]

_ROLE = "the dvclive tracker rewrites its metrics"
# A metrics.json larger than this is not DVCLive's summary of one run: left alone.
_MAX_SUMMARY_BYTES = 64 * 2**20


class DVCLiveTracker(GeneralTracker):
    """Log to DVCLive, as Accelerate's ``DVCLiveTracker``.

    ``init_trackers(project_name, init_kwargs={"dvclive": {...}})`` creates
    ``dvclive.Live(**init_kwargs)`` (``dir``, ``report``, ``save_dvc_exp``, ``dvcyaml``, ...);
    ``DVCLiveTracker(live=Live(...))`` logs to a ``Live`` of your own. Unlike Accelerate's, whose
    files go to ``./dvclive`` and ``./dvc.yaml`` in the working directory, the folder is
    ``<logging_dir>/<project_name>/dvclive`` when a logging directory is set (a ``dir`` in
    ``init_kwargs`` wins). Inside a DVC repository (a ``.dvc`` folder at or above the working
    directory), DVCLive's own defaults apply: ``dvc.yaml`` at the repository's root and a DVC
    experiment saved at the end. Outside one, the repository is left alone: DVCLive by itself
    (and so Accelerate's tracker) turns any Git repository it runs in into a DVC repository
    (``dvc init`` at its root) and, at the end, stashes the working tree to commit an
    experiment; here its ``dvc.yaml`` goes into the run's folder, no DVC repository is made
    and no experiment is saved. ``save_dvc_exp=True`` in ``init_kwargs`` asks for DVCLive's
    own behaviour; ``dvcyaml`` there wins.

    ``log`` sets ``Live.step`` to ``step`` when one is given, logs each number with
    ``Live.log_metric`` (keyword arguments go to it), then calls ``Live.next_step()``, as
    Accelerate does; text and other values are skipped, with one warning per key. A name is a
    path under DVCLive's folder: a part of it that would leave the folder (``..``, an empty
    part, a leading ``/``) is written as ``_``. ``log_images`` writes each image (a path, a PIL
    image, a CHW or HWC tensor or array; floats in 0-1) as
    ``plots/images/<key>/<step>.png`` (``<key>/<step>_<i>.png`` for a list; without a step,
    ``<key>.png``), DVCLive's pattern for an image per step.

    Experiment continuity: the run is the folder (:meth:`run_reference` is ``{"dir": <its
    absolute path>}``). A job resumed from a checkpoint opens it with ``resume=True`` after
    dropping, from every ``plots/metrics/**.tsv``, the rows whose step is after the
    checkpoint's last logged step, and sets ``metrics.json``'s ``step`` back to it: each step
    appears once, with the resumed job's values. A reference naming another folder (a moved
    project, or a crafted manifest) is not followed: this job's own folder is continued. A new
    run in a folder that holds one already starts it over, as DVCLive does (``resume=False``
    removes its files); pass ``resume=True`` in ``init_kwargs`` to keep them.

    Args:
        run_name: the sub-folder of ``logging_dir`` that holds the ``dvclive`` folder.
        live: a ``dvclive.Live`` to log to instead of creating one (second, as in Accelerate).
        logging_dir: the run's logging directory.
        **kwargs: passed to ``dvclive.Live``.
    """

    name = "dvclive"
    requires_logging_directory = False
    main_process_only = True

    def __init__(
        self,
        run_name: str = "",
        live: Any = None,
        logging_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(run_name, logging_dir, **kwargs)
        self.live: Any = live
        self._keep_until: int | None = None

    @property
    @override
    def tracker(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live

    @property
    def dir(self) -> str:
        """The run's DVCLive folder (``Live.dir`` once started)."""
        if self.live is not None:
            return str(self.live.dir)
        given = self.init_kwargs.get("dir")
        if given is not None:
            return os.fspath(given)
        if self.logging_dir is not None:
            # The project name is a folder under the logging directory, never a way out of it
            # (a journal's run.json, read by `accelkit track sync`, may carry a crafted one).
            project = _inside(self.run_name) if self.run_name else ""
            return os.path.join(self.logging_dir, project, "dvclive")
        return "dvclive"  # DVCLive's own default, as under Accelerate

    @override
    def start(self) -> None:
        keep_until, self._keep_until = self._keep_until, None
        if self.live is not None:
            return
        from dvclive import Live

        kwargs = dict(self.init_kwargs)
        folder = kwargs.setdefault("dir", self.dir)
        if keep_until is not None:
            _forget_after(os.fspath(folder), keep_until)
            kwargs["resume"] = True
        if _in_dvc_repository() or kwargs.get("save_dvc_exp"):
            self.live = Live(**kwargs)
            return
        kwargs.setdefault("dvcyaml", os.path.join(folder, "dvc.yaml"))
        kwargs["save_dvc_exp"] = False
        self.live = _without_repository(Live, kwargs)

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._require_live("store_init_configuration")
        self.live.log_params(to_plain(values))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._require_live("log")
        if step is not None:
            self.live.step = step
        for key, value in values.items():
            if is_number(value):
                self.live.log_metric(_inside(key), value, **kwargs)
            else:
                self.warn_skipped(key, value, "skipped by DVCLive, which logs numbers only")
        self.live.next_step()

    @override
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images (see the class): each value is an image or a list of images."""
        self._require_live("log_images")
        for key, value in values.items():
            images = value if isinstance(value, list) else [value]
            for index, image in enumerate(images):
                if step is None:
                    name = key if len(images) == 1 else f"{key}_{index}"
                else:
                    name = f"{key}/{step}" if len(images) == 1 else f"{key}/{step}_{index}"
                self.live.log_image(f"{_inside(name)}.png", hwc_uint8(image))

    @override
    def finish(self) -> None:
        if self.live is not None:
            self.live.end()

    def journal_delivered(self, step: int, values: dict[str, Any]) -> bool:
        """Whether the run's files already hold the numbers of one journal entry at ``step``
        (the tracker journal asks after a sender was killed mid-call)."""
        self._require_live("journal_delivered")
        numbers = {key: float(value) for key, value in values.items() if is_number(value)}
        if not numbers:
            return False
        metrics = Path(self.dir, "plots", "metrics")
        for key, value in numbers.items():
            rows = _read_rows(metrics / f"{_inside(key)}.tsv")
            if rows is None or not any(at == step and got == value for at, got in rows[1]):
                return False
        return True

    @override
    def name_run(self, key: str) -> dict[str, Any] | None:
        """The run is this tracker's folder, known before it opens: :meth:`run_reference`.

        Args:
            key: the run key (not needed: the folder names the run).
        """
        return self.run_reference()

    @override
    def run_reference(self) -> dict[str, Any] | None:
        """``{"dir": <the absolute path of the DVCLive folder>}``."""
        return {"dir": os.path.abspath(self.dir)}

    @override
    def discard_run(self) -> bool:
        """Nothing to delete: the continued run is this tracker's folder."""
        return True

    @override
    def continue_run(self, reference: dict[str, Any] | None, step: int) -> None:
        """Make the next :meth:`start` continue this tracker's folder, without the rows logged
        after ``step``.

        Args:
            reference: what :meth:`run_reference` returned in the saving job, or ``None``.
            step: the checkpoint's last logged step (``-1``: drop every row).
        """
        recorded = reference.get("dir") if isinstance(reference, dict) else None
        if reference is not None and not same_path(recorded, self.dir):
            warnings.warn(
                f"Tracker 'dvclive': the checkpoint's run wrote to {short(recorded, 200)}, this "
                f"job writes to {os.path.abspath(self.dir)!r}; continuing in this job's folder "
                f"(dropping the rows logged after step {step}), the other one is left alone.",
                UserWarning,
                stacklevel=2,
            )
        self._keep_until = int(step)

    def _require_live(self, method: str) -> None:
        if self.live is None:
            raise UsageError(
                f"DVCLiveTracker.{method}() needs a started run: call "
                "accelerator.init_trackers(...) first."
            )


def _inside(name: str) -> str:
    """``name`` as a path that stays under DVCLive's folder (see the class)."""
    return "/".join(p if p not in ("", ".", "..") else "_" for p in name.split("/"))


# Live() looks its repository up through dvclive.live.get_dvc_repo, which runs `dvc init` at
# the root of the Git repository around the working directory when there is no DVC one. One
# Live at a time is created with that lookup answering "none".
_NO_REPOSITORY = threading.Lock()


def _without_repository(live_class: Any, kwargs: dict[str, Any]) -> Any:
    """``Live(**kwargs)`` that neither finds nor makes a DVC repository (see the class)."""
    import dvclive.live as module

    lookup = getattr(module, "get_dvc_repo", None)
    if lookup is None:  # another DVCLive: it makes no repository this way
        return live_class(**kwargs)
    with _NO_REPOSITORY:
        module.get_dvc_repo = lambda: None
        try:
            return live_class(**kwargs)
        finally:
            module.get_dvc_repo = lookup


def _in_dvc_repository() -> bool:
    """Whether the working directory is in a DVC repository (a ``.dvc`` folder at or above)."""
    here = Path.cwd()
    return any((folder / ".dvc").is_dir() for folder in (here, *here.parents))


def _read_rows(path: Path) -> tuple[str, list[tuple[int, float]]] | None:
    """The header and ``(step, value)`` rows of a DVCLive ``.tsv`` (``None``: no regular file
    there); a row that does not parse (a line cut short by a crash) is left out."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    header, *lines = text.split("\n")
    columns = header.split("\t")
    if "step" not in columns or len(columns) < 2:
        return header, []
    at = columns.index("step")
    rows = []
    for line in lines:
        cells = line.split("\t")
        if len(cells) != len(columns):
            continue
        try:
            rows.append((int(cells[at]), float(cells[-1])))
        except ValueError:
            continue
    return header, rows


def _forget_after(folder: str, step: int) -> None:
    """Drop the rows after ``step`` from every metric of the DVCLive folder ``folder`` and set
    its ``metrics.json``'s ``step`` to ``step``; each file is rewritten whole or not at all.

    Links are never followed: a link where the folder, ``plots``, a metric or ``metrics.json``
    is makes the resume raise a ``TrackerFileError`` naming it.
    """
    if not os.path.lexists(folder):
        return
    _refuse_link(folder)
    metrics = os.path.join(folder, "plots", "metrics")
    for path in (os.path.join(folder, "plots"), metrics):
        if os.path.lexists(path):
            _refuse_link(path)
    for root, folders, files in os.walk(metrics):
        for name in folders:
            _refuse_link(os.path.join(root, name))
        for name in files:
            if name.endswith(".tsv"):
                _keep_rows(os.path.join(root, name), step)
    summary = os.path.join(folder, "metrics.json")
    if os.path.lexists(summary):
        _refuse_link(summary)
        if os.path.getsize(summary) <= _MAX_SUMMARY_BYTES:
            with contextlib.suppress(ValueError, OSError):
                with open(summary, encoding="utf-8") as file:
                    latest = json.load(file)
                if isinstance(latest, dict) and "step" in latest:
                    latest["step"] = max(0, step)
                    _replace(summary, json.dumps(latest, indent=4) + "\n")


def _keep_rows(path: str, step: int) -> None:
    """Rewrite the metric file ``path`` without its rows after ``step``."""
    _refuse_link(path)
    with open(path, encoding="utf-8", errors="replace") as file:
        header, *lines = file.read().split("\n")
    columns = header.split("\t")
    if "step" not in columns:
        return
    at = columns.index("step")
    kept = [header]
    for line in lines:
        cells = line.split("\t")
        if len(cells) != len(columns):
            continue  # an empty last line, or one cut short by a crash
        try:
            if int(cells[at]) <= step:
                kept.append(line)
        except ValueError:
            continue
    _replace(path, "\n".join(kept) + "\n")


def _replace(path: str, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, synced, then rename it over it."""
    descriptor, temporary = tempfile.mkstemp(prefix=".accelkit-", dir=os.path.dirname(path))
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _refuse_link(path: str) -> None:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file or folder"
        raise TrackerFileError(
            f"{short(path, 300)} is {kind}: it is where {_ROLE} at a resume, and trackers "
            "never follow links. Replace it with the real file or folder, or start the run "
            "in another logging directory."
        )
