"""Every in-scope public name of the installed Accelerate exists in accelkit, bindable the same way.

The lists are generated from the installed ``accelerate`` (``accelerate/__init__.py``,
``accelerate.utils``, the ``Accelerator`` class and the state classes), so a new Accelerate
release shows its new names here as failures: port them, or declare them out of scope with the
reason (a refusing stand-in in ``accelkit/out_of_scope.py``, or ``NOT_PROVIDED`` below). A name
a new release drops goes into ``REMOVED`` with that release, so the out-of-scope lists keep
serving scripts written for the older one without hiding a name that is still exported.
Signatures are compared with :func:`incompatibilities` (positional order, names,
``*args``/``**kwargs``, nothing extra required). Differences owned by other areas, or kept on
purpose, are strict xfails with their reason in ``KNOWN_DIFFERENCES``.
"""

from __future__ import annotations

import enum
import inspect
import types
from typing import Any

import pytest
from packaging.version import Version

import accelkit
import accelkit.state
import accelkit.utils
from accelkit.out_of_scope import OUT_OF_SCOPE as STAND_INS
from accelkit.out_of_scope import OutOfScopeError
from tests.compat._signatures import incompatibilities

accelerate = pytest.importorskip("accelerate", reason="accelerate (a dev dependency) is missing")
reference_state = pytest.importorskip("accelerate.state")
reference_utils = pytest.importorskip("accelerate.utils")
reference_modeling = pytest.importorskip("accelerate.utils.modeling")

# Out of scope, part 1: names accelkit provides as refusing stand-ins (importable; using one
# raises OutOfScopeError with the reason). The commented table lives in accelkit/out_of_scope.py.
REFUSED = dict(STAND_INS)

# Out of scope, part 2: names accelkit does not provide at all: constants of the reference's
# internals, and Accelerator / state members of engines accelkit does not drive.
_DEEPSPEED = "DeepSpeed is out of scope"
_PARALLELISM = "tensor / context / pipeline parallelism (ParallelismConfig) is out of scope"
NOT_PROVIDED: dict[str, str] = {
    # constants of the reference launcher / operations / profiler internals
    "TORCH_LAUNCH_PARAMS": "the reference launcher's torchrun flag list",
    "TORCH_DISTRIBUTED_OPERATION_TYPES": "the reference's internal list of collective names",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "profiling of MTIA, a device accelkit lacks",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "profiling of XPUs, a device accelkit lacks",
    # Accelerator / AcceleratorState members
    "get_deepspeed_plugin": _DEEPSPEED,  # on AcceleratorState: present, but refuses
    "select_deepspeed_plugin": _DEEPSPEED,  # idem
    "deepspeed_ulysses_dl_adapter": _DEEPSPEED,
    "verify_device_map": "big-model inference (device maps) is out of scope",
    "lomo_backward": "LOMO optimizers (lomo_optim) are not supported",
    "context_parallel_rank": _PARALLELISM,
    "data_parallel_rank": _PARALLELISM,
    "data_parallel_shard_rank": _PARALLELISM,
    "pipeline_parallel_rank": _PARALLELISM,
    "tensor_parallel_rank": _PARALLELISM,
    "is_composable_parallelism_enabled": _PARALLELISM,
    "maybe_context_parallel": _PARALLELISM,
}
OUT_OF_SCOPE = {**REFUSED, **NOT_PROVIDED}

# Out-of-scope names a newer Accelerate no longer has: name -> (where the older one exported
# it, the first release without it). They stay out of scope (the stand-ins still import and
# refuse, for scripts written for the older release); the installed reference must have the name
# before that release and must not from it on.
REMOVED: dict[str, tuple[str, str]] = {
    "FP8RecipeKwargs": ("accelerate.utils", "1.16.0"),
    "MSAMPRecipeKwargs": ("accelerate.utils", "1.16.0"),
    "prepare_pippy": ("accelerate", "1.16.0"),
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": ("accelerate.utils", "1.16.0"),
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": ("accelerate.utils", "1.16.0"),
}

# (where, name) -> why it differs today; each is a strict xfail, so fixing it flips the test.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {}


def _public(module: types.ModuleType) -> list[str]:
    return sorted(
        name
        for name in dir(module)
        if not name.startswith("_") and not isinstance(getattr(module, name), types.ModuleType)
    )


def _members(cls: type) -> list[str]:
    return sorted(name for name, _ in inspect.getmembers(cls) if not name.startswith("_"))


def _is_enum(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, enum.Enum)


def _problems(theirs: Any, ours: Any) -> list[str]:
    if _is_enum(theirs):
        if not _is_enum(ours):
            return ["not an enum"]
        missing = sorted(set(theirs.__members__) - set(ours.__members__))
        return [f"missing members {missing}"] if missing else []
    if inspect.isclass(theirs) or inspect.isroutine(theirs):
        if not callable(ours):
            return ["not callable"]
        return incompatibilities(theirs, ours)
    if isinstance(theirs, (str, int, float, bool, tuple)) and theirs != ours:
        return [f"value {ours!r}, the reference's is {theirs!r}"]
    return []


_OURS = {"accelerate": accelkit, "accelerate.utils": accelkit.utils}
_THEIRS = {"accelerate": accelerate, "accelerate.utils": reference_utils}


def _cases() -> list[Any]:
    cases = []
    for where, module in _THEIRS.items():
        for name in _public(module):
            if name in OUT_OF_SCOPE:
                continue
            marks = []
            if (where, name) in KNOWN_DIFFERENCES:
                marks.append(pytest.mark.xfail(reason=KNOWN_DIFFERENCES[where, name], strict=True))
            cases.append(pytest.param(where, name, marks=marks, id=f"{where}.{name}"))
    return cases


@pytest.mark.parametrize(("where", "name"), _cases())
def test_public_name_exists_and_binds_the_same_way(where: str, name: str) -> None:
    theirs = getattr(_THEIRS[where], name)
    assert hasattr(_OURS[where], name), f"{where}.{name} has no accelkit counterpart"
    assert _problems(theirs, getattr(_OURS[where], name)) == []


_CLASS_PAIRS = {
    "Accelerator": (accelerate.Accelerator, accelkit.Accelerator),
    "PartialState": (reference_state.PartialState, accelkit.state.PartialState),
    "AcceleratorState": (reference_state.AcceleratorState, accelkit.state.AcceleratorState),
    "GradientState": (reference_state.GradientState, accelkit.state.GradientState),
}


@pytest.fixture(scope="module")
def instances() -> dict[str, Any]:
    """One accelkit object of each class, for members that are instance attributes."""
    accelkit.state.AcceleratorState._reset_state()
    accelerator = accelkit.Accelerator(cpu=True)
    return {
        "Accelerator": accelerator,
        "PartialState": accelkit.state.PartialState(cpu=True),
        "AcceleratorState": accelerator.state,
        "GradientState": accelerator.gradient_state,
    }


def _member_cases() -> list[Any]:
    return [
        pytest.param(cls, name, id=f"{cls}.{name}")
        for cls, (theirs, _) in _CLASS_PAIRS.items()
        for name in _members(theirs)
        if name not in OUT_OF_SCOPE
    ]


@pytest.mark.parametrize(("cls", "name"), _member_cases())
def test_class_member_exists_and_binds_the_same_way(
    cls: str, name: str, instances: dict[str, Any]
) -> None:
    theirs_cls, ours_cls = _CLASS_PAIRS[cls]
    assert hasattr(instances[cls], name), f"{cls}.{name} has no accelkit counterpart"
    theirs = inspect.getattr_static(theirs_cls, name)
    ours = inspect.getattr_static(ours_cls, name, None)
    if inspect.isfunction(theirs) and ours is not None:
        assert inspect.isfunction(ours), f"{cls}.{name} is a method in the reference"
        assert incompatibilities(theirs, ours) == []


@pytest.mark.parametrize("name", sorted(OUT_OF_SCOPE))
def test_out_of_scope_names_still_exist_in_the_reference(name: str) -> None:
    """A name dropped by the reference leaves this list, or goes into ``REMOVED`` with the
    release that dropped it, so it never hides a new one."""
    modules = [*_THEIRS.values(), reference_modeling]  # accelkit.utils.modeling refuses its own
    found = any(hasattr(module, name) for module in modules) or any(
        hasattr(theirs, name) for theirs, _ in _CLASS_PAIRS.values()
    )
    if name not in REMOVED:
        assert found, (
            f"{name} is not in accelerate {accelerate.__version__}: remove it from OUT_OF_SCOPE, "
            "or add it to REMOVED with the first release without it"
        )
        return
    where, removed_in = REMOVED[name]
    if Version(accelerate.__version__) < Version(removed_in):
        assert hasattr(_THEIRS[where], name), f"{where}.{name} is missing before {removed_in}"
    else:
        assert not found, f"{name} is back in accelerate {accelerate.__version__}: unlist it"


def _refused_cases() -> list[Any]:
    exported = {(where, name) for where, module in _THEIRS.items() for name in _public(module)}
    exported |= {(where, name) for name, (where, _) in REMOVED.items()}  # for older scripts
    return [
        pytest.param(where, name, id=f"{where}.{name}")
        for where, name in sorted(exported)
        if name in REFUSED
    ]


@pytest.mark.parametrize(("where", "name"), _refused_cases())
def test_out_of_scope_name_imports_and_refuses_when_used(where: str, name: str) -> None:
    stand_in = getattr(_OURS[where], name)
    with pytest.raises(OutOfScopeError, match=rf"^{name}: .*not"):
        stand_in()
    if inspect.isclass(stand_in):
        assert not isinstance(object(), stand_in)
