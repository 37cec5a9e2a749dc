"""Tracker names -> tracker classes.

Built-in trackers are looked up lazily: their module (and with it the backend's SDK) is imported
only when a run asks for them. Third-party trackers join through :func:`register_tracker` or the
entry-point group ``accelkit.trackers`` (``name = "package.module:TrackerClass"``); registered
names work in ``log_with`` lists and in ``"all"``. Every tracker Accelerate ships is built in,
under Accelerate's name.
"""

from __future__ import annotations

import builtins
import enum
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from accelkit.errors import ConfigurationError, DependencyError, WrongTypeError
from accelkit.trackers.base import GeneralTracker

__all__ = [
    "TRACKER_CLASSES",
    "TrackerClassTable",
    "LoggerType",
    "available_trackers",
    "get_tracker_class",
    "installed_trackers",
    "register_tracker",
    "registered_trackers",
    "constructor_arguments",
    "resolve_log_with",
    "unregister_tracker",
]

ENTRY_POINT_GROUP = "accelkit.trackers"

T = TypeVar("T", bound=type[GeneralTracker])


class _LoggerTypeMeta(enum.EnumMeta):
    """``"wandb" in LoggerType`` tests the values, as Accelerate's ``LoggerType`` does."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class LoggerType(str, enum.Enum, metaclass=_LoggerTypeMeta):
    """Tracker names, those of Accelerate's ``LoggerType`` (and accelkit's ``JSONL``)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def list(cls) -> builtins.list[str]:
        """Every member's value (as Accelerate's ``LoggerType.list()``)."""
        return [member.value for member in cls]


@dataclass(frozen=True)
class _Builtin:
    module: str
    attr: str
    packages: tuple[str, ...]


_BUILTINS: dict[str, _Builtin] = {
    "tensorboard": _Builtin(
        "accelkit.trackers.backends.tensorboard", "TensorBoardTracker", ("tensorboard",)
    ),
    "wandb": _Builtin("accelkit.trackers.backends.wandb", "WandBTracker", ("wandb",)),
    "comet_ml": _Builtin("accelkit.trackers.backends.comet_ml", "CometMLTracker", ("comet_ml",)),
    "mlflow": _Builtin("accelkit.trackers.backends.mlflow", "MLflowTracker", ("mlflow",)),
    "jsonl": _Builtin("accelkit.trackers.backends.jsonl", "JSONLTracker", ()),
    "trackio": _Builtin("accelkit.trackers.backends.trackio", "TrackioTracker", ("trackio",)),
    "swanlab": _Builtin("accelkit.trackers.backends.swanlab", "SwanLabTracker", ("swanlab",)),
    "clearml": _Builtin("accelkit.trackers.backends.clearml", "ClearMLTracker", ("clearml",)),
    "dvclive": _Builtin("accelkit.trackers.backends.dvclive", "DVCLiveTracker", ("dvclive",)),
    "aim": _Builtin("accelkit.trackers.backends.aim", "AimTracker", ("aim",)),
}

_registered: dict[str, type[GeneralTracker]] = {}
# Built-in names deleted from TRACKER_CLASSES: gone from the table, from log_with and from "all"
# until assigned again. Not a second table: TRACKER_CLASSES is _BUILTINS, less these, plus
# _registered.
_removed: set[str] = set()


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
        raise WrongTypeError(
            f"register_tracker() takes a subclass of accelkit.GeneralTracker, got {cls!r}. "
            "Subclass GeneralTracker and set its `name`."
        )
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(
            f"Tracker class {cls.__qualname__} has no name (name={name!r}). Set a class "
            'attribute such as `name = "my_tracker"` before registering it.'
        )
    if name == LoggerType.ALL.value:
        raise ConfigurationError(
            '"all" is reserved for every available tracker; choose another name.'
        )
    taken = name in _registered or (name in _BUILTINS and name not in _removed)
    if taken and not overwrite and _registered.get(name) is not cls:
        raise ConfigurationError(
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
        raise DependencyError(
            f"Tracker entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r} "
            f"failed to load: {type(error).__name__}: {error}. Fix or uninstall the package "
            "that provides it."
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
        raise DependencyError(
            f"Tracker entry point {ep.name!r} ({ep.value}) is {cls!r}, not a subclass of "
            "accelkit.GeneralTracker."
        )
    return cls


def available_trackers() -> list[str]:
    """Every tracker name accelkit knows: built-ins, registered ones and entry points."""
    return sorted({*(_BUILTINS.keys() - _removed), *_registered, *_entry_points()})


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

    Entry points that fail to load, and registered trackers whose ``required_packages`` are
    missing, are reported with a warning and left out (never silently).
    """
    names = []
    for name in available_trackers():
        if name not in _registered and name not in _BUILTINS:
            try:
                get_tracker_class(name)
            except ImportError as error:
                warnings.warn(f"Skipping tracker {name!r} in log_with='all': {error}", stacklevel=2)
                continue
        missing = _missing_packages(_packages_of(name))
        if not missing:
            names.append(name)
        elif name in _registered:
            # A built-in whose SDK is absent is simply not "available"; a tracker the user
            # registered is one they mean to use, so its absence is said.
            warnings.warn(
                f"Skipping registered tracker {name!r} in log_with='all': it needs "
                f"{', '.join(missing)}, which is not installed. Install it: "
                f"pip install {' '.join(missing)}",
                stacklevel=2,
            )
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
            raise DependencyError(
                f"Tracker {key!r} needs {', '.join(missing)}, which is not installed. "
                f"Install it: pip install {' '.join(missing)}"
            )
        return _registered[key]
    if key in _removed:
        raise ConfigurationError(
            f"Unknown tracker {key!r}: it was deleted from accelkit.tracking."
            f"LOGGER_TYPE_TO_CLASS. Put it back (LOGGER_TYPE_TO_CLASS[{key!r}] = <its class>) "
            "or register a tracker under that name."
        )
    if key in _BUILTINS:
        spec = _BUILTINS[key]
        missing = _missing_packages(spec.packages)
        if missing:
            raise DependencyError(
                f"Tracker {key!r} needs the package {', '.join(missing)}, which is not "
                f"installed. Install it: pip install 'accelkit[{key}]'"
            )
        return _shipped_class(key)
    entry_points = _entry_points()
    if key in entry_points:
        return _load_entry_point(entry_points[key])
    raise ConfigurationError(
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
            raise WrongTypeError(
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
            raise ConfigurationError(
                f"Two trackers in log_with are named {name!r}; give each tracker a unique name."
            )
        unique[name] = item
    if logging_dir is None:
        for item in unique.values():
            if not item.requires_logging_directory or isinstance(item, GeneralTracker):
                continue
            if remote_logging_dir is not None:
                raise ConfigurationError(
                    f"Tracker {item.name!r} writes local files, but the logging directory is "
                    f"the URL {remote_logging_dir!r}. Set a local folder: "
                    "ProjectConfiguration(project_dir=..., logging_dir='<local folder>')."
                )
            raise ConfigurationError(
                f"Tracker {item.name!r} writes files and needs a logging directory, but none "
                "is set. Pass Accelerator(project_dir=...) or "
                "project_config=ProjectConfiguration(project_dir=..., logging_dir=...)."
            )
    return list(unique.values())


class TrackerClassTable(MutableMapping[str, type[GeneralTracker]]):
    """Tracker name -> class, the table Accelerate calls ``tracking.LOGGER_TYPE_TO_CLASS``.

    A live view of this registry, not a copy: the built-in trackers and the classes registered
    with :func:`register_tracker` (which shadow a built-in of the same name).
    Entry-point trackers are not listed: loading them runs third-party code, which a membership
    test should not do. Reading a built-in's class imports its accelkit module, never the
    backend's SDK.

    It behaves as Accelerate's dict, so that code (and Accelerate's tests) that saves and
    restores it keeps the registry as it was::

        saved = LOGGER_TYPE_TO_CLASS.copy()  # a plain dict
        LOGGER_TYPE_TO_CLASS.clear()
        ...
        LOGGER_TYPE_TO_CLASS.update(saved)

    Setting ``table[name] = cls`` registers ``cls`` (replacing any tracker of that name, and
    bringing back a deleted one), as assigning into Accelerate's dict makes ``log_with=name``
    build ``cls``; assigning a name its shipped class (``table["tensorboard"] =
    TensorBoardTracker``) restores the built-in. ``del table[name]`` removes the name entirely
    (a registration and the built-in it shadows): ``log_with=name`` and ``"all"`` no longer
    find it until it is assigned again. (:func:`unregister_tracker` removes a registration
    only, and a shadowed built-in comes back.)
    """

    def _names(self) -> list[str]:
        shipped = [n for n in _BUILTINS if n not in _removed]
        return list(dict.fromkeys([*shipped, *_registered]))

    def __getitem__(self, name: str) -> type[GeneralTracker]:
        key = str(name)
        if key in _registered:
            return _registered[key]
        if key in _removed:
            raise KeyError(key)
        return _shipped_class(key)

    def __contains__(self, name: object) -> bool:
        # Without this, Mapping's __contains__ would import a built-in's module to answer.
        return isinstance(name, str) and name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __setitem__(self, name: str, cls: type[GeneralTracker]) -> None:
        if isinstance(cls, type) and getattr(cls, "name", None) != name:
            # The registry keys a class by its `name`; a different key would be a second
            # name that log_with could not resolve to the same class.
            raise ConfigurationError(
                f"Cannot store {cls!r} under {name!r}: its `name` is "
                f"{getattr(cls, 'name', None)!r}. Set `name = {name!r}` on the class, or use "
                "accelkit.tracking.register_tracker_class(cls)."
            )
        try:
            shipped = _shipped_class(name)
        except KeyError:
            shipped = None
        if cls is shipped:
            _registered.pop(name, None)  # the built-in itself, as shipped
        else:
            register_tracker(cls, overwrite=True)
        _removed.discard(name)

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        _registered.pop(name, None)
        if name in _BUILTINS:
            _removed.add(name)

    def copy(self) -> dict[str, type[GeneralTracker]]:
        """A plain ``dict`` of the table as it is now (as ``dict.copy`` gives in Accelerate)."""
        return dict(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._names()})"


def _shipped_class(key: str) -> type[GeneralTracker]:
    """The class accelkit ships under ``key`` (a built-in); KeyError if none.

    Imports a built-in's accelkit module (in ``backends/``), never the backend's SDK.
    """
    if key in _BUILTINS:
        spec = _BUILTINS[key]
        cls: type[GeneralTracker] = getattr(importlib.import_module(spec.module), spec.attr)
        return cls
    raise KeyError(key)


TRACKER_CLASSES = TrackerClassTable()
"""Every tracker name and its class (see :class:`TrackerClassTable`)."""


def constructor_arguments(
    cls: type[GeneralTracker], project_name: str, logging_dir: str | None, kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How ``init_trackers`` calls a tracker class, as Accelerate does, checked beforehand.

    A tracker with ``requires_logging_directory = True`` is called as
    ``cls(project_name, logging_dir, **kwargs)``, any other as ``cls(project_name, **kwargs)``
    (so a custom tracker written for Accelerate, ``__init__(self, run_name)``, works). A class
    whose ``__init__`` names a ``logging_dir`` parameter also gets it as a keyword (accelkit's
    wandb, Comet and MLflow trackers keep their files there), unless ``kwargs`` sets it.

    Args:
        cls: the tracker class.
        project_name: the name given to ``init_trackers``.
        logging_dir: the run's logging directory, or ``None``.
        kwargs: ``init_kwargs[cls.name]``.

    Returns:
        The positional and keyword arguments.

    Raises:
        TypeError: the class cannot be called that way (a misconfiguration, not a failing
            service: it is raised, never skipped), naming the class, the call and the fix.
    """
    named = dict(kwargs)
    if cls.requires_logging_directory:
        args: tuple[Any, ...] = (project_name, logging_dir)
        call = "cls(project_name, logging_dir, **init_kwargs)"
    else:
        args = (project_name,)
        call = "cls(project_name, **init_kwargs)"
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a C type): let the call decide
        return args, named
    parameter = signature.parameters.get("logging_dir")
    takes_dir = parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    if not cls.requires_logging_directory and takes_dir and "logging_dir" not in named:
        named["logging_dir"] = logging_dir
    try:
        signature.bind(*args, **named)
    except TypeError as error:
        raise WrongTypeError(
            f"Tracker {cls.name!r} ({cls.__module__}.{cls.__qualname__}{signature}) cannot be "
            f"called as {call} with init_kwargs={dict(kwargs)!r}: {error}. accelkit calls "
            "tracker classes as Accelerate does: the logging directory is the second positional "
            "argument only when requires_logging_directory = True. Fix the class's __init__ or "
            f"init_kwargs[{cls.name!r}]."
        ) from error
    return args, named
