"""``accelkit.tracking`` against the installed ``accelerate.tracking``.

The names and signatures are read from the installed Accelerate, so a name it adds or a
parameter it renames shows up here. Custom trackers written for Accelerate (constructed as
Accelerate constructs them) run unchanged.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import accelkit.tracking
from accelkit import Accelerator
from accelkit.trackers import TrackerHub, register_tracker, registered_trackers

accelerate_tracking = pytest.importorskip("accelerate.tracking")
accelerate_utils = pytest.importorskip("accelerate.utils")

P = inspect.Parameter


def _public_names() -> list[str]:
    """Classes and functions ``accelerate.tracking`` defines (not those it imports), and
    ``LoggerType``, which scripts import from it."""
    names = ["LoggerType"]
    for name, value in vars(accelerate_tracking).items():
        defined_here = getattr(value, "__module__", None) == accelerate_tracking.__name__
        if not name.startswith("_") and defined_here and callable(value):
            names.append(name)
    return sorted(names)


def _calls(signature: inspect.Signature) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Calls the reference signature accepts: minimal, all positional, optionals by keyword."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is P.empty]
    keyword_only = [p for p in params if p.kind == P.KEYWORD_ONLY]
    required_kw = {p.name: object() for p in keyword_only if p.default is P.empty}
    extra = {"backend_option": 1} if any(p.kind == P.VAR_KEYWORD for p in params) else {}
    yield tuple(object() for _ in required), required_kw
    yield tuple(object() for _ in positional), required_kw
    optional = {
        p.name: object() for p in [*positional[len(required) :], *keyword_only]
        if p.kind != P.POSITIONAL_ONLY
    }  # fmt: skip
    yield tuple(object() for _ in required), {**required_kw, **optional, **extra}


def _assert_bindable(ours: Any, theirs: Any, what: str) -> None:
    ours_sig, theirs_sig = inspect.signature(ours), inspect.signature(theirs)
    for args, kwargs in _calls(theirs_sig):
        try:
            ours_sig.bind(*args, **kwargs)
        except TypeError as error:
            pytest.fail(
                f"{what}: accelerate accepts {theirs_sig} called with {len(args)} positional "
                f"and keywords {sorted(kwargs)}; accelkit's {ours_sig} does not ({error})"
            )


@pytest.mark.parametrize("name", _public_names())
def test_accelerate_tracking_name_exists_with_a_compatible_signature(name: str) -> None:
    theirs = getattr(accelerate_tracking, name)
    assert hasattr(accelkit.tracking, name), f"accelkit.tracking has no {name}"
    ours = getattr(accelkit.tracking, name)
    if name == "LoggerType":
        for member in theirs:
            assert ours[member.name].value == member.value, member
        return
    if inspect.isfunction(theirs):
        _assert_bindable(ours, theirs, name)
        return
    assert inspect.isclass(ours) and issubclass(ours, accelkit.tracking.GeneralTracker)
    _assert_bindable(ours, theirs, f"{name}()")
    assert ours.name == getattr(theirs, "name", ours.name)
    assert ours.requires_logging_directory == getattr(
        theirs, "requires_logging_directory", ours.requires_logging_directory
    )
    for attr, value in vars(theirs).items():
        if attr.startswith("_"):
            continue
        assert hasattr(ours, attr), f"{name}.{attr} is missing"
        if isinstance(value, property):
            assert isinstance(inspect.getattr_static(ours, attr), property), f"{name}.{attr}"
        elif inspect.isfunction(value):
            _assert_bindable(getattr(ours, attr), value, f"{name}.{attr}()")


def test_logger_type_behaves_like_accelerates() -> None:
    LoggerType = accelkit.tracking.LoggerType
    assert "wandb" in LoggerType and "nope" not in LoggerType
    assert set(accelerate_utils.LoggerType.list()) <= set(LoggerType.list())
    assert str(LoggerType.MLFLOW) == "mlflow"


def test_every_tracker_accelerate_ships_is_built_in() -> None:
    from accelkit.trackers.registry import get_tracker_class

    shipped = [m.value for m in accelerate_utils.LoggerType if m.value != "all"]
    for name in shipped:
        cls = get_tracker_class(name)
        assert cls.name == name and cls.__module__.startswith("accelkit.trackers.backends."), cls


class AccelerateStyleTracker(accelkit.tracking.GeneralTracker):
    """Written as Accelerate's docs show: no logging directory in ``__init__``."""

    name = "accelerate_style"
    requires_logging_directory = False

    def __init__(self, run_name: str) -> None:
        super().__init__()
        self.run_name = run_name
        self.records: list[Any] = []

    @property
    def tracker(self) -> list[Any]:
        return self.records

    @accelkit.tracking.on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.records.append(("config", dict(values)))

    @accelkit.tracking.on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.records.append((step, dict(values)))


class AccelerateStyleFileTracker(AccelerateStyleTracker):
    """Needs the directory: Accelerate passes it as the second positional argument."""

    name = "accelerate_style_files"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str) -> None:
        super().__init__(run_name)
        self.directory = logging_dir


def test_accelerate_style_custom_trackers_join_all(
    tmp_path: Path, mlflow_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db)
    accelkit.tracking.register_tracker_class(AccelerateStyleTracker)
    accelkit.tracking.register_tracker_class(AccelerateStyleFileTracker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(log_with="all", project_dir=str(tmp_path))
        accelerator.init_trackers("run", config={"lr": 0.5})
        accelerator.log({"loss": 1.5}, step=3)
        plain = accelerator.get_tracker("accelerate_style")
        with_dir = accelerator.get_tracker("accelerate_style_files")
        names = sorted(t.name for t in accelerator.trackers)
        accelerator.end_training()
    failures = [str(w.message) for w in caught if "failed in" in str(w.message)]
    assert failures == []
    assert {"accelerate_style", "accelerate_style_files", "jsonl", "tensorboard"} <= set(names)
    assert plain.run_name == "run" and with_dir.directory == str(tmp_path)
    for tracker in (plain, with_dir):
        assert tracker.records == [("config", {"lr": 0.5}), (3, {"loss": 1.5})]


def test_a_tracker_that_cannot_be_constructed_is_an_error_not_a_drop_out(tmp_path: Path) -> None:
    class NeedsAKeyword(AccelerateStyleTracker):
        name = "needs_keyword"

        def __init__(self, run_name: str, *, api_key: str) -> None:
            super().__init__(run_name)

    register_tracker(NeedsAKeyword)
    accelerator = Accelerator(log_with=["needs_keyword", "jsonl"], project_dir=str(tmp_path))
    with pytest.raises(
        TypeError, match=r"'needs_keyword'.*api_key.*init_kwargs\['needs_keyword'\]"
    ):
        accelerator.init_trackers("run")
    assert accelerator.trackers == []  # checked before any tracker started
    accelerator.init_trackers("run", init_kwargs={"needs_keyword": {"api_key": "k"}})
    assert sorted(t.name for t in accelerator.trackers) == ["jsonl", "needs_keyword"]
    accelerator.end_training()


def test_a_registered_tracker_missing_its_package_is_named_in_all(tmp_path: Path) -> None:
    class NeedsPackage(AccelerateStyleTracker):
        name = "needs_package"
        required_packages = ("surely_not_an_installed_package_42",)

    register_tracker(NeedsPackage)
    with pytest.warns(UserWarning, match=r"registered tracker 'needs_package'.*pip install"):
        hub = TrackerHub.create("all", logging_dir=str(tmp_path))
    assert "needs_package" not in hub.requested_names


def test_compat_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    LoggerType = accelkit.tracking.LoggerType
    instance = AccelerateStyleTracker("run")
    selected = accelkit.tracking.filter_trackers(["jsonl", instance, "jsonl"], str(tmp_path))
    assert selected == [LoggerType.JSONL, instance]
    with pytest.raises(ValueError, match=r"'tensorboard'.*logging directory"):
        accelkit.tracking.filter_trackers("tensorboard")
    available = accelkit.tracking.get_available_trackers()
    assert LoggerType.TENSORBOARD in available and LoggerType.JSONL in available
    with pytest.raises(ValueError, match=r"subclass of accelkit\.tracking\.GeneralTracker"):
        accelkit.tracking.register_tracker_class(dict)  # type: ignore[arg-type]

    class Shadow(AccelerateStyleTracker):
        name = "jsonl"

    with pytest.warns(UserWarning, match="'jsonl' already exists and is replaced"):
        accelkit.tracking.register_tracker_class(Shadow)
    assert accelkit.tracking.filter_trackers("jsonl") == [LoggerType.JSONL]
    # on_main_process: a main-process-only tracker does nothing elsewhere.
    tracker = AccelerateStyleTracker("run")
    monkeypatch.setenv("RANK", "1")
    tracker.log({"x": 1}, step=0)
    assert tracker.records == []
    monkeypatch.setenv("RANK", "0")
    tracker.log({"x": 1}, step=0)
    assert tracker.records == [(0, {"x": 1})]


def _candidate(base: type, case: str) -> Any:
    """The same tracker class for Accelerate's GeneralTracker (``base``) or accelkit's."""
    if case == "not a tracker":
        return dict
    attrs: dict[str, Any] = {"name": "candidate", "requires_logging_directory": False}
    if case == "no name":
        del attrs["name"]
    elif case == "no requires_logging_directory":
        del attrs["requires_logging_directory"]
    elif case == "shadows a tracker not built in":
        attrs["name"] = "aim"
    elif case == "shadows an uninstalled built-in":
        attrs["name"] = "comet_ml"
    return type("Candidate", (base,), attrs)


def _register_outcome(register: Any, tracker_class: Any) -> tuple[str, bool]:
    """What registering does: the builtin exception a caller catches (ours are AccelkitError
    subclasses of it), or "ok"; and whether it warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            register(tracker_class)
        except Exception as error:
            builtin = next(c for c in type(error).__mro__ if c.__module__ == "builtins")
            return builtin.__name__, bool(caught)
    return "ok", any(issubclass(w.category, UserWarning) for w in caught)


@pytest.mark.parametrize(
    "case",
    [
        "not a tracker",
        "no name",
        "no requires_logging_directory",
        "new name",
        "shadows a tracker not built in",
        "shadows an uninstalled built-in",
    ],
)
def test_register_tracker_class_accepts_refuses_and_warns_as_accelerate(case: str) -> None:
    table = accelerate_tracking.LOGGER_TYPE_TO_CLASS
    saved = dict(table)
    try:
        theirs = _register_outcome(
            accelerate_tracking.register_tracker_class,
            _candidate(accelerate_tracking.GeneralTracker, case),
        )
    finally:
        table.clear()
        table.update(saved)
    ours = _register_outcome(
        accelkit.tracking.register_tracker_class, _candidate(accelkit.tracking.GeneralTracker, case)
    )
    assert ours == theirs


def test_logger_type_to_class_lists_accelerates_names_and_registered_classes() -> None:
    table = accelkit.tracking.LOGGER_TYPE_TO_CLASS
    assert set(accelerate_tracking.LOGGER_TYPE_TO_CLASS) <= set(table)
    for name in accelerate_tracking.LOGGER_TYPE_TO_CLASS:
        assert issubclass(table[name], accelkit.tracking.GeneralTracker)
        assert table[name].name == name
    assert table["tensorboard"] is accelkit.tracking.TensorBoardTracker
    assert table["aim"] is accelkit.tracking.AimTracker
    assert "accelerate_style" not in table

    accelkit.tracking.register_tracker_class(AccelerateStyleTracker)
    assert table["accelerate_style"] is AccelerateStyleTracker
    assert accelkit.tracking.filter_trackers("accelerate_style") == ["accelerate_style"]
    del table["accelerate_style"]
    assert "accelerate_style" not in table
    with pytest.raises(ValueError, match="Unknown tracker 'accelerate_style'"):
        accelkit.tracking.filter_trackers("accelerate_style")

    # Assigning registers, as assigning into Accelerate's dict makes the name usable.
    table["accelerate_style"] = AccelerateStyleTracker
    assert accelkit.tracking.filter_trackers("accelerate_style") == ["accelerate_style"]
    with pytest.raises(ValueError, match=r"`name` is 'accelerate_style'.*name = 'other'"):
        table["other"] = AccelerateStyleTracker
    with pytest.raises(KeyError):
        table["no_such_tracker"]
    with pytest.raises(KeyError):
        del table["no_such_tracker"]


def test_logger_type_to_class_saved_cleared_and_restored_as_accelerates_tests_do(
    tmp_path: Path,
) -> None:
    """Accelerate's tests keep its dict around each test: copy(), clear(), update(saved)."""
    table = accelkit.tracking.LOGGER_TYPE_TO_CLASS
    accelkit.tracking.register_tracker_class(AccelerateStyleTracker)
    before = dict(table)
    saved = table.copy()
    assert type(saved) is dict and saved == before
    assert saved["jsonl"] is accelkit.tracking.JSONLTracker

    table.clear()
    assert len(table) == 0 and "jsonl" not in table and table.copy() == {}
    with pytest.raises(ValueError, match=r"'jsonl'.*deleted from .*LOGGER_TYPE_TO_CLASS"):
        Accelerator(log_with="jsonl", project_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'accelerate_style'"):
        accelkit.tracking.filter_trackers("accelerate_style")
    assert accelkit.tracking.get_available_trackers() == []  # "all" finds nothing

    # What a test does meanwhile: register by item assignment, build it by name, delete it.
    table["accelerate_style"] = AccelerateStyleTracker
    accelerator = Accelerator(log_with="accelerate_style", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    assert [type(t) for t in accelerator.trackers] == [AccelerateStyleTracker]
    accelerator.end_training()
    del table["accelerate_style"]
    assert "accelerate_style" not in table

    table.update(saved)
    assert dict(table) == before and list(table) == list(before)
    assert accelkit.tracking.filter_trackers("jsonl", str(tmp_path)) == ["jsonl"]
    assert accelkit.tracking.filter_trackers("accelerate_style") == ["accelerate_style"]
    # the built-ins came back as built-ins, not as registrations of their classes
    assert "jsonl" not in registered_trackers()

    # Deleting a built-in removes it (from log_with and "all"); assigning brings it back.
    del table["jsonl"]
    assert "jsonl" not in table
    assert "jsonl" not in accelkit.tracking.get_available_trackers()
    table["jsonl"] = accelkit.tracking.JSONLTracker
    assert table["jsonl"] is accelkit.tracking.JSONLTracker
    assert "jsonl" in accelkit.tracking.get_available_trackers()
