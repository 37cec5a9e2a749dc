"""Everything accelkit raises on its own account is an ``AccelkitError`` (:mod:`accelkit.errors`).

The test reads every module of the package with :mod:`ast` and finds each ``raise X(...)`` (or
``raise X``) whose ``X`` is one of Python's own exception classes. Such a raise fails here
unless it is one Python's conventions ask for (a protocol method's ``AttributeError``,
``KeyError`` or ``TypeError``; ``StopIteration``, ``SystemExit``, ``KeyboardInterrupt``) or it
is listed in :data:`ALLOWED` with its reason. Re-raises (``raise``, ``raise exc``) are not
accelkit's own and pass. The fix for a new bare raise is a family class that also subclasses
the builtin, so ``except ValueError`` keeps working: ``ConfigurationError`` (a ``ValueError``:
the caller passed a bad setting or argument), ``StorageError`` (an ``OSError``), the
``CheckpointError`` family, ``TrackerError`` (a ``RuntimeError``).
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from pathlib import Path

import pytest

from accelkit.checkpointing import storage
from accelkit.checkpointing.errors import ResumeMismatchError
from accelkit.errors import (
    AccelkitError,
    ConfigurationError,
    DependencyError,
    UsageError,
    WrongTypeError,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "accelkit"

BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)

# Control flow, not failures: Python's own protocol asks for these very classes.
CONTROL_FLOW = frozenset({"StopIteration", "StopAsyncIteration", "SystemExit", "KeyboardInterrupt"})

# A protocol method answers with the builtin Python expects of it: ``getattr(obj, name,
# default)`` catches exactly ``AttributeError``, ``dict.get``-style callers ``KeyError``,
# a binary operator's caller ``TypeError``.
PROTOCOL_METHODS = {
    "__getattr__": {"AttributeError"},
    "__getattribute__": {"AttributeError"},
    "__setattr__": {"AttributeError", "TypeError"},
    "__delattr__": {"AttributeError"},
    "__dir__": {"AttributeError"},
    "__getitem__": {"KeyError", "IndexError", "TypeError"},
    "__setitem__": {"KeyError", "TypeError"},
    "__delitem__": {"KeyError"},
    "__eq__": {"TypeError"},
    "__hash__": {"TypeError"},
    "__reduce__": {"TypeError"},
    "__reduce_ex__": {"TypeError"},
    "__getstate__": {"TypeError"},
    "__init_subclass__": {"TypeError"},
    "__set_name__": {"TypeError"},
    "__iter__": {"TypeError"},
    "__len__": {"TypeError"},
}

# (module, function, exception) -> why accelkit raises the builtin itself there. The function
# is its qualified name in the module (``Class.method``; ``<module>`` at the top level).
_UNPICKLER_RULE = (
    "a rule of the restricted unpickler, a private check: the unpickler catches its ValueError "
    "(and only that) and refuses the file with a CorruptCheckpointError naming the global"
)
_TP = "accelkit/checkpointing/formats/_torch_pickle.py"
_AP = "accelkit/checkpointing/interop/accelerate_pickle.py"
_CONTRACT = "a shipped contract suite for pytest: its test injects or asserts with the builtin"
_ABSTRACT = "a method a subclass must override: Python's convention for an abstract method"
_CLOSED_FILE = "io's protocol: a write to a closed file is a ValueError, as for Python's own files"

# (module, function, exception) -> why accelkit raises the builtin itself there. The function
# is its qualified name in the module (``Class.method``; ``<module>`` at the top level). After a
# file moves, its entries move with it (the second test names any entry left behind).
ALLOWED: dict[tuple[str, str, str], str] = {
    (_TP, "tensor_extent", "ValueError"): _UNPICKLER_RULE + " (also accelerate_pickle's check)",
    (_TP, "_tensor_rule", "ValueError"): _UNPICKLER_RULE,
    (_TP, "_ordered_dict", "ValueError"): _UNPICKLER_RULE,
    (_TP, "_latin1", "ValueError"): _UNPICKLER_RULE,
    (_TP, "_set", "ValueError"): _UNPICKLER_RULE,
    (_TP, "_size", "ValueError"): _UNPICKLER_RULE,
    (_TP, "_device", "ValueError"): _UNPICKLER_RULE,
    (_AP, "_dtype_rule", "ValueError"): _UNPICKLER_RULE,
    (_AP, "_dtype_rule.complete", "ValueError"): _UNPICKLER_RULE,
    (_AP, "_array_rule", "ValueError"): _UNPICKLER_RULE,
    (_AP, "_array_rule.complete", "ValueError"): _UNPICKLER_RULE,
    ("accelkit/checkpointing/formats/jsonio.py", "_finite", "ValueError"): (
        "a json.loads hook (parse_float): json's protocol is a ValueError, which load_json "
        "turns into a CorruptCheckpointError"
    ),
    ("accelkit/checkpointing/formats/jsonio.py", "_constant", "ValueError"): (
        "a json.loads hook (parse_constant): json's protocol is a ValueError, which load_json "
        "turns into a CorruptCheckpointError"
    ),
    ("accelkit/trackers/delivery/journal.py", "_refuse", "TypeError"): (
        "a json.dumps default= hook: json's protocol is a TypeError for a value it cannot "
        "encode, which the caller catches"
    ),
    ("accelkit/checkpointing/storage/_localfile.py", "LocalFile.write", "ValueError"): (
        _CLOSED_FILE
    ),
    ("accelkit/checkpointing/storage/base.py", "HashingWriter.write", "ValueError"): (_CLOSED_FILE),
    ("accelkit/checkpointing/storage/_pools.py", "_DetachedPool.submit", "RuntimeError"): (
        "concurrent.futures.Executor's protocol: submit() after shutdown is a RuntimeError"
    ),
    ("accelkit/checkpointing/commit/async_save.py", "AsyncCheckpoint.exception", "TimeoutError"): (
        "concurrent.futures.Future's protocol: exception(timeout) raises TimeoutError"
    ),
    ("accelkit/checkpointing/commit/writer_process.py", "SharedArena._new_segment", "OSError"): (
        "the OS refused pinned memory (cudaHostRegister), like mmap's own ENOMEM beside it: "
        "the caller catches OSError and falls back on ordinary memory"
    ),
    ("accelkit/launch/config.py", "write_config_file", "NotADirectoryError"): (
        "os.makedirs' FileExistsError for a file in the folder's place, raised again as "
        "the OS reports that case (ENOTDIR, naming the folder), not as 'the file exists'"
    ),
    ("accelkit/trackers/backends/_files.py", "create_exclusive", "FileExistsError"): (
        "os.open(O_EXCL)'s own error once all 1,000 names are taken, kept as the docstring "
        "promises; the hub reports an OSError of a tracker once and skips it"
    ),
    ("accelkit/trackers/backends/tensorboard.py", "_read_before_new_files", "FileExistsError"): (
        "raised into the except clause right below it (the name is taken: the file stays)"
    ),
    ("accelkit/trackers/registry.py", "_shipped_class", "KeyError"): (
        "a private lookup (documented: 'KeyError if none'): the mapping view's __getitem__ "
        "passes it on as its protocol asks, the other callers catch it or checked the key"
    ),
    ("accelkit/trackers/registry.py", "unregister_tracker", "KeyError"): (
        "a mapping's protocol: unregistering a name never registered is del mapping[name]"
    ),
    ("accelkit/data/prepared.py", "_Position.restore", "KeyError"): (
        "a state dict without its key: torch's and Accelerate's load_state_dict raise KeyError"
    ),
    ("accelkit/training/local_sgd.py", "LocalSGD.__init__", "NotImplementedError"): (
        "Accelerate's LocalSGD raises NotImplementedError for these distributed types"
    ),
    ("accelkit/trackers/base.py", "GeneralTracker.log", "NotImplementedError"): _ABSTRACT,
    ("accelkit/trackers/base.py", "GeneralTracker.log_images", "NotImplementedError"): _ABSTRACT,
    ("accelkit/testing/storage.py", "StorageContract.storage_root", "NotImplementedError"): (
        _ABSTRACT
    ),
    ("accelkit/testing/trackers.py", "TrackerContract.read_back", "NotImplementedError"): (
        _ABSTRACT
    ),
    (
        "accelkit/testing/storage.py",
        "StorageContract.test_failed_streaming_write_leaves_no_file",
        "RuntimeError",
    ): _CONTRACT,
    (
        "accelkit/testing/trackers.py",
        "TrackerContract.test_recovery_contract.outage",
        "ConnectionError",
    ): (_CONTRACT),
    ("accelkit/test_utils/testing.py", "assert_exception", "AssertionError"): (
        "Accelerate's test helper: a failed assertion of a test is an AssertionError"
    ),
    ("accelkit/cli/_table.py", "format_size", "AssertionError"): (
        "a line that cannot run (the loop returns at the last unit), there for the type "
        "checker: reaching it is a bug in accelkit"
    ),
}


def _raises() -> Iterator[tuple[str, str, str, int]]:
    """``(module, function, exception, line)`` for each raise of a builtin exception class."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        yield from _walk(ast.parse(path.read_text(), str(path)), module, [])


def _walk(node: ast.AST, module: str, scope: list[str]) -> Iterator[tuple[str, str, str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _walk(child, module, [*scope, child.name])
            continue
        if isinstance(child, ast.Raise) and child.exc is not None:
            raised = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
            if isinstance(raised, ast.Name) and raised.id in BUILTIN_EXCEPTIONS:
                yield module, ".".join(scope) or "<module>", raised.id, child.lineno
        yield from _walk(child, module, scope)


def _allowed_by_convention(function: str, exception: str) -> bool:
    if exception in CONTROL_FLOW:
        return True
    return exception in PROTOCOL_METHODS.get(function.rsplit(".", 1)[-1], set())


def test_accelkit_raises_only_its_own_family() -> None:
    strays = [
        f"{module}:{line}: raise {exception} in {function}"
        for module, function, exception, line in _raises()
        if not _allowed_by_convention(function, exception)
        and (module, function, exception) not in ALLOWED
    ]
    assert not strays, (
        "accelkit raises Python's own exceptions here; raise a member of the AccelkitError "
        "family that also subclasses the builtin (ConfigurationError for a bad setting or "
        "argument, StorageError, the CheckpointError family, TrackerError), or add the raise "
        "to ALLOWED in tests/test_errors_family.py with the reason Python or Accelerate asks "
        "for the builtin itself:\n" + "\n".join(strays)
    )


def test_every_allowed_raise_still_exists_and_says_why() -> None:
    """An entry whose raise was converted or moved goes too: the list never hides a new raise
    behind a stale name."""
    found = {(module, function, exception) for module, function, exception, _ in _raises()}
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED entries with no such raise left: {stale}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("def f(x):\n    raise ValueError(f'bad {x}')\n", True),
        ("def f():\n    raise OSError\n", True),
        ("def f():\n    try:\n        g()\n    except OSError as exc:\n        raise exc\n", False),
        ("class A:\n    def __getattr__(self, name):\n        raise AttributeError(name)\n", False),
        ("def f():\n    raise ConfigurationError('bad')\n", False),
    ],
)
def test_the_walk_finds_a_bare_builtin_raise(source: str, caught: bool) -> None:
    found = [
        (function, exception)
        for _, function, exception, _ in _walk(ast.parse(source), "m.py", [])
        if not _allowed_by_convention(function, exception)
    ]
    assert bool(found) == caught, found


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (ConfigurationError, ValueError),
        (UsageError, RuntimeError),
        (WrongTypeError, TypeError),
        (DependencyError, ImportError),
        (storage.StorageNotFoundError, FileNotFoundError),
        (storage.StorageExistsError, FileExistsError),
        (storage.StorageIsADirectoryError, IsADirectoryError),
        (storage.StorageNotADirectoryError, NotADirectoryError),
        (storage.StoragePermissionError, PermissionError),
        (storage.StorageConnectionError, ConnectionError),
        (storage.StorageTimeoutError, TimeoutError),
        (ResumeMismatchError, RuntimeError),
    ],
)
def test_each_family_keeps_the_builtin_a_caller_catches(
    cls: type[BaseException], builtin: type[BaseException]
) -> None:
    assert issubclass(cls, AccelkitError) and issubclass(cls, builtin)
    # Only a bad argument is a ValueError (accelkit.errors' rule).
    assert issubclass(cls, ValueError) == (cls is ConfigurationError)


def test_a_backend_error_keeps_its_kind_and_errno() -> None:
    from accelkit.checkpointing.storage.base import as_storage_error

    cause = ConnectionResetError(104, "reset by peer")
    error = as_storage_error(cause, "read of s3://b/k")
    assert type(error) is storage.StorageConnectionError and error.errno == 104
    assert str(error) == "read of s3://b/k: [Errno 104] reset by peer"
    assert as_storage_error(error, "again") is error  # ours passes as it is
    assert type(as_storage_error(KeyError("x"), "list")) is storage.StorageError
