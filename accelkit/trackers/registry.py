"""Tracker names -> tracker classes.

Built-in trackers are looked up lazily: their module (and with it the backend's SDK) is imported
only when a run asks for them. Third-party trackers join through :func:`register_tracker` or the
entry-point group ``accelkit.trackers`` (``name = "package.module:TrackerClass"``); registered
names work in ``log_with`` lists and in ``"all"``.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from accelkit.trackers.base import GeneralTracker

__all__ = [
    "LoggerType",
    "available_trackers",
    "get_tracker_class",
    "installed_trackers",
    "register_tracker",
    "registered_trackers",
    "resolve_log_with",
    "unregister_tracker",
]

ENTRY_POINT_GROUP = "accelkit.trackers"

T = TypeVar("T", bound=type[GeneralTracker])


class LoggerType(str, enum.Enum):
    """The names of the built-in trackers (and ``"all"``)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    JSONL = "jsonl"

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class _Builtin:
    module: str
    attr: str
    packages: tuple[str, ...]


_BUILTINS: dict[str, _Builtin] = {
    "tensorboard": _Builtin(
        "accelkit.trackers.tensorboard", "TensorBoardTracker", ("tensorboard",)
    ),
    "wandb": _Builtin("accelkit.trackers.wandb", "WandBTracker", ("wandb",)),
    "comet_ml": _Builtin("accelkit.trackers.comet_ml", "CometMLTracker", ("comet_ml",)),
    "mlflow": _Builtin("accelkit.trackers.mlflow", "MLflowTracker", ("mlflow",)),
    "jsonl": _Builtin("accelkit.trackers.jsonl", "JSONLTracker", ()),
}

_registered: dict[str, type[GeneralTracker]] = {}


def register_tracker(cls: T, *, overwrite: bool = False) -> T:
    """Make a `GeneralTracker` subclass usable by name in ``log_with`` (and in ``"all"``).

    Usable as a decorator. A registered class takes precedence over a built-in of the same name
    only with ``overwrite=True``.

    Args:
        cls: the tracker class; its ``name`` attribute is the name to register.
        overwrite: replace an existing registration or built-in of the same name.

    Returns:
        ``cls``, unchanged.

    Raises:
        TypeError: ``cls`` is not a `GeneralTracker` subclass.
        ValueError: ``cls.name`` is empty, or the name is taken and ``overwrite`` is false.
    """
    if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
        raise TypeError(
            f"register_tracker() takes a subclass of accelkit.GeneralTracker, got {cls!r}. "
            "Subclass GeneralTracker and set its `name`."
        )
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"Tracker class {cls.__qualname__} has no name (name={name!r}). Set a class "
            'attribute such as `name = "my_tracker"` before registering it.'
        )
    if name == LoggerType.ALL.value:
        raise ValueError('"all" is reserved for every available tracker; choose another name.')
    taken = name in _registered or name in _BUILTINS
    if taken and not overwrite and _registered.get(name) is not cls:
        raise ValueError(
            f"A tracker named {name!r} is already registered ({_describe(name)}). Pick another "
            "name or pass overwrite=True to replace it."
        )
    _registered[name] = cls
    return cls


def unregister_tracker(name: str) -> None:
    """Remove a registration made with :func:`register_tracker` (built-ins stay).

    Raises:
        KeyError: nothing is registered under ``name``.
    """
    if name not in _registered:
        raise KeyError(f"No tracker registered under {name!r}; registered: {sorted(_registered)}")
    del _registered[name]


def registered_trackers() -> Mapping[str, type[GeneralTracker]]:
    """A read-only view of the trackers registered with :func:`register_tracker`."""
    return MappingProxyType(_registered)


def _describe(name: str) -> str:
    if name in _registered:
        cls = _registered[name]
        return f"{cls.__module__}.{cls.__qualname__}"
    return "built-in"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep for ep in found}


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type[GeneralTracker]:
    try:
        cls = ep.load()
    except Exception as error:
        raise ImportError(
            f"Tracker entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r} "
            f"failed to load: {type(error).__name__}: {error}. Fix or uninstall the package "
            "that provides it."
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
        raise ImportError(
            f"Tracker entry point {ep.name!r} ({ep.value}) is {cls!r}, not a subclass of "
            "accelkit.GeneralTracker."
        )
    return cls


def available_trackers() -> list[str]:
    """Every tracker name accelkit knows: built-ins, registered ones and entry points."""
    return sorted({*_BUILTINS, *_registered, *_entry_points()})


def _missing_packages(packages: tuple[str, ...]) -> list[str]:
    missing = []
    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


def _packages_of(name: str) -> tuple[str, ...]:
    if name in _registered:
        return tuple(getattr(_registered[name], "required_packages", ()))
    if name in _BUILTINS:
        return _BUILTINS[name].packages
    return ()


def installed_trackers() -> list[str]:
    """The names of :func:`available_trackers` whose packages are installed (what ``"all"`` uses).

    Entry points that fail to load are reported with a warning and left out.
    """
    names = []
    for name in available_trackers():
        if name not in _registered and name not in _BUILTINS:
            try:
                get_tracker_class(name)
            except ImportError as error:
                warnings.warn(f"Skipping tracker {name!r} in log_with='all': {error}", stacklevel=2)
                continue
        if not _missing_packages(_packages_of(name)):
            names.append(name)
    return names


def get_tracker_class(name: str | LoggerType) -> type[GeneralTracker]:
    """The tracker class registered under ``name``, importing its module if needed.

    Args:
        name: a tracker name (see :func:`available_trackers`).

    Returns:
        The `GeneralTracker` subclass.

    Raises:
        ValueError: no tracker has this name.
        ImportError: the tracker's package is not installed (the message has the pip command).
    """
    key = str(name)
    if key in _registered:
        missing = _missing_packages(_packages_of(key))
        if missing:
            raise ImportError(
                f"Tracker {key!r} needs {', '.join(missing)}, which is not installed. "
                f"Install it: pip install {' '.join(missing)}"
            )
        return _registered[key]
    if key in _BUILTINS:
        spec = _BUILTINS[key]
        missing = _missing_packages(spec.packages)
        if missing:
            raise ImportError(
                f"Tracker {key!r} needs the package {', '.join(missing)}, which is not "
                f"installed. Install it: pip install 'accelkit[{key}]'"
            )
        cls: type[GeneralTracker] = getattr(importlib.import_module(spec.module), spec.attr)
        return cls
    entry_points = _entry_points()
    if key in entry_points:
        return _load_entry_point(entry_points[key])
    raise ValueError(
        f"Unknown tracker {key!r}. Available: {', '.join(available_trackers())}. Register a "
        "custom tracker with accelkit.register_tracker(MyTracker) or pass an instance of it."
    )


def resolve_log_with(
    log_with: Any,
    logging_dir: str | os.PathLike[str] | None,
    *,
    remote_logging_dir: str | None = None,
) -> list[type[GeneralTracker] | GeneralTracker]:
    """Turn ``Accelerator(log_with=...)`` into tracker classes and instances, checking each.

    Args:
        log_with: ``None``, a name, a `LoggerType`, a `GeneralTracker` instance, ``"all"`` or a
            list of those.
        logging_dir: the run's logging directory, or ``None``.
        remote_logging_dir: the URL the logging directory was set to, if it is not local (only
            used to explain why there is no logging directory).

    Returns:
        Classes to construct in ``init_trackers`` and instances given by the user, in order,
        without duplicate names.

    Raises:
        ValueError: an unknown name, a duplicate name, or a tracker that needs a logging
            directory while none is set.
        ImportError: a known tracker whose package is missing.
        TypeError: an entry that is neither a name nor a `GeneralTracker`.
    """
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[type[GeneralTracker] | GeneralTracker] = []
    for entry in entries:
        if isinstance(entry, GeneralTracker):
            resolved.append(entry)
        elif isinstance(entry, (str, LoggerType)):
            if str(entry) == LoggerType.ALL.value:
                resolved.extend(get_tracker_class(n) for n in installed_trackers())
            else:
                resolved.append(get_tracker_class(entry))
        else:
            raise TypeError(
                f"log_with entries must be tracker names or GeneralTracker instances, got "
                f"{entry!r} ({type(entry).__name__}). Available names: "
                f"{', '.join(available_trackers())}."
            )
    unique: dict[str, type[GeneralTracker] | GeneralTracker] = {}
    for item in resolved:
        name = item.name
        if name in unique:
            if unique[name] is item or isinstance(unique[name], type):
                # "all" plus an explicit name (or an instance replacing the class): keep one.
                unique[name] = item if isinstance(item, GeneralTracker) else unique[name]
                continue
            raise ValueError(
                f"Two trackers in log_with are named {name!r}; give each tracker a unique name."
            )
        unique[name] = item
    if logging_dir is None:
        for item in unique.values():
            if not item.requires_logging_directory or isinstance(item, GeneralTracker):
                continue
            if remote_logging_dir is not None:
                raise ValueError(
                    f"Tracker {item.name!r} writes local files, but the logging directory is "
                    f"the URL {remote_logging_dir!r}. Set a local folder: "
                    "ProjectConfiguration(project_dir=..., logging_dir='<local folder>')."
                )
            raise ValueError(
                f"Tracker {item.name!r} writes files and needs a logging directory, but none "
                "is set. Pass Accelerator(project_dir=...) or "
                "project_config=ProjectConfiguration(project_dir=..., logging_dir=...)."
            )
    return list(unique.values())
