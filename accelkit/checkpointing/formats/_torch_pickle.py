"""torch.save's zip archive and the pickle inside it, checked before torch reads a byte.

A ``torch.save`` file is a zip archive whose records are stored, never compressed
(``<archive>/data.pkl`` the pickle, ``<archive>/data/<key>`` one record per storage, and a few
small ones: ``version``, ``byteorder``...). ``torch.load(weights_only=True)`` keeps a pickle
from running code, but not from amplifying: a deflated record inflates a thousandfold, a
tensor of stride 0 over four bytes claims gigabytes, an object shared through the pickle's memo
a million times becomes a million copies once converted, and NumPy's ``_reconstruct`` without
its ``BUILD`` hands out never-initialised memory. This module reads such a file as *data*:

- :func:`read_archive` checks the zip structurally: a local header at byte 0 (torch's own test
  for the format: anything else it reads as the legacy format), one archive folder, only the
  record names ``torch.save`` writes, each name once, every record ``ZIP_STORED`` with equal
  stored and real sizes, local headers agreeing with the central directory, records inside
  the file without overlapping, the end record last and without a comment. Two zip readers
  (Python's and torch's miniz) then cannot disagree on which bytes a record holds.
- :func:`scan_pickle` runs the pickle's opcodes on stand-ins (no object is built): only the
  opcodes of plain data, globals from an exact ``(module, name)`` table, each callable only
  with the arguments its rule accepts (:class:`Rules`), a storage reference naming a record of
  exactly the size it claims, a tensor's size/stride/offset inside its storage without a
  stride of 0 or overlapping elements, NumPy arrays only through ``_reconstruct(ndarray, (0,),
  b'b')`` completed by exactly one ``BUILD`` whose data has exactly the array's size, no
  container changed after it was placed inside another (so there are no cycles and sizes are
  final), and the value's *expanded* size (each tensor, string and item counted at every place
  it occurs) within a budget of the file's size.

Every refusal is a :class:`~accelkit.checkpointing.errors.CorruptCheckpointError` naming the
file and what was wrong. The stand-ins cost a bounded number of bytes per opcode, so the scan's
memory is a small multiple of the pickle's size.

Public names (of this private module): :class:`Archive`, :func:`read_archive`,
:class:`Rules`, :func:`torch_rules`, :func:`scan_pickle`, :func:`node` and :func:`is_node`
(for rules of other callables), :func:`tensor_extent`, :data:`LEGACY_MAGIC`.
"""

from __future__ import annotations

import io
import itertools
import math
import pickletools
import re
import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

from accelkit.checkpointing.errors import CorruptCheckpointError

__all__ = [
    "LEGACY_MAGIC",
    "Archive",
    "Rules",
    "is_node",
    "node",
    "read_archive",
    "scan_pickle",
    "tensor_extent",
    "torch_rules",
]

#: How the legacy (pre-zip) ``torch.save`` format begins: protocol 2 and the pickled magic
#: number ``0x1950a86a20f9469cfc6c`` (``LONG1`` of 10 bytes).
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"

_LOCAL = b"PK\x03\x04"
_END = b"PK\x05\x06"
_END_SIZE = 22
# The records torch.save writes inside its archive folder (torch 1.6 to 2.x).
_RECORD = re.compile(
    r"^(?:data\.pkl|version|\.format_version|\.storage_alignment|byteorder"
    r"|\.data/version|\.data/serialization_id|data/\d+)$"
)


class _Refused(Exception):
    """Internal: why the scan stopped (turned into a CorruptCheckpointError naming the file)."""


@dataclass(frozen=True)
class Archive:
    """What :func:`read_archive` found: the records of a ``torch.save`` archive.

    Attributes:
        prefix: the archive's folder (``optimizer`` for ``optimizer/data.pkl``).
        records: each record's name below the folder -> its size in bytes.
        pickle: the bytes of ``data.pkl``.
        size: the file's size.
    """

    prefix: str
    records: Mapping[str, int]
    pickle: bytes
    size: int


def _corrupt(url: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: {why}. accelkit reads torch.save files only as torch.save writes them "
        "(stored zip records, data of the size the pickle claims) and nothing else. If you "
        "trust this file, load it with torch and save it again with torch.save."
    )


def read_archive(f: BinaryIO, url: str) -> Archive:
    """Check the zip structure of the ``torch.save`` file ``f``; return its records.

    Args:
        f: the file, open for reading, seekable.
        url: its name, for messages.

    Returns:
        The :class:`Archive` (``data.pkl`` read into memory: it is at most the file's size).

    Raises:
        CorruptCheckpointError: naming ``url`` and the record or field at fault: not a zip
            archive (the legacy format named as such), a compressed, encrypted, duplicated or
            unexpected record, headers that disagree, records overlapping or outside the file.
    """
    f.seek(0, io.SEEK_END)
    size = f.tell()
    f.seek(0)
    head = f.read(len(LEGACY_MAGIC))
    if head == LEGACY_MAGIC:
        raise _corrupt(
            url,
            "it is in torch's legacy (pre-1.6, not zip) format, which Accelerate's save_state "
            "does not write on any torch it supports; it is not read",
        )
    if not head.startswith(_LOCAL):
        raise _corrupt(url, "not a torch.save archive (a zip file holding data.pkl)")
    if size < _END_SIZE:
        raise _corrupt(url, "the zip archive is cut short (no end record)")
    f.seek(size - _END_SIZE)
    if f.read(4) != _END:
        raise _corrupt(url, "the zip end record is not at the end of the file (trailing data)")
    try:
        f.seek(0)
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
        start_dir = archive.start_dir
    except Exception as exc:  # zipfile's errors for a bad directory are not one type
        raise _corrupt(
            url, f"its zip directory cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if archive.comment:
        raise _corrupt(url, "the zip archive has a comment (torch.save writes none)")
    if not infos:
        raise _corrupt(url, "the zip archive is empty (no data.pkl)")
    prefix = infos[0].filename.split("/", 1)[0]
    if not prefix or "\\" in prefix:
        raise _corrupt(url, f"the record {infos[0].filename!r} is not inside an archive folder")
    records: dict[str, int] = {}
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        name = info.filename
        inner = name[len(prefix) + 1 :] if name.startswith(prefix + "/") else ""
        if not _RECORD.match(inner):
            raise _corrupt(url, f"the record {name!r} is not one torch.save writes")
        if inner in records:
            raise _corrupt(
                url,
                f"the record {name!r} appears twice (which one a reader takes is ambiguous)",
            )
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise _corrupt(
                url,
                f"the record {name!r} is compressed (method {info.compress_type}, "
                f"{info.compress_size} bytes for {info.file_size}); torch.save stores records "
                "uncompressed",
            )
        if info.flag_bits & 0x1:
            raise _corrupt(url, f"the record {name!r} is encrypted")
        start = _data_start(f, info, url, size)
        spans.append((info.header_offset, start + info.file_size, name))
        records[inner] = info.file_size
    spans.sort()
    if spans[0][0] != 0:
        raise _corrupt(url, "the first zip record does not start the file")
    for (_, end, name), (nxt, _, other) in itertools.pairwise(spans):
        if end > nxt:
            raise _corrupt(url, f"the records {name!r} and {other!r} overlap")
    if spans[-1][1] > start_dir:
        raise _corrupt(url, f"the record {spans[-1][2]!r} runs into the zip directory")
    if "data.pkl" not in records:
        raise _corrupt(url, f"the archive has no {prefix}/data.pkl")
    info = archive.getinfo(f"{prefix}/data.pkl")
    f.seek(_data_start(f, info, url, size))
    data = f.read(info.file_size)
    return Archive(prefix, records, data, size)


def _data_start(f: BinaryIO, info: zipfile.ZipInfo, url: str, size: int) -> int:
    """Where the data of ``info`` begins, after checking its local header."""
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != _LOCAL:
        raise _corrupt(url, f"the record {info.filename!r} has no local header where listed")
    (method,) = struct.unpack("<H", header[8:10])
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    name = f.read(name_len)
    if method != zipfile.ZIP_STORED or name != info.orig_filename.encode(
        "utf-8" if info.flag_bits & 0x800 else "cp437"
    ):
        raise _corrupt(
            url, f"the local header of {info.filename!r} disagrees with the zip directory"
        )
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > size:
        raise _corrupt(url, f"the record {info.filename!r} runs past the end of the file")
    return start


# --------------------------------------------------------------------------- the pickle


class _Node:
    """A stand-in for one object the pickle builds: its kind, its expanded size (bytes of data
    and one per item, counted at every place it occurs), and whether it is placed inside
    another object yet (then it may not change)."""

    __slots__ = ("frozen", "info", "items", "kind", "size")

    def __init__(self, kind: str, size: int = 1, items: tuple[Any, ...] = (), info: Any = None):
        self.kind = kind
        self.size = size
        self.items = items
        self.info = info
        self.frozen = False


@dataclass
class Rules:
    """What a pickle may name and call: exact ``(module, name)`` pairs with a rule each.

    Attributes:
        storages: ``(module, name)`` of a storage type -> its element size in bytes (they
            appear only inside a storage reference, never called).
        calls: ``(module, name)`` of a callable -> its rule, ``rule(args, scan) -> result``
            (``args`` the stand-ins of its arguments); a rule raises ``ValueError`` with the
            reason when the arguments are not the ones it accepts.
        names: other ``(module, name)`` pairs that may appear as arguments only.
        budget: bytes of expanded value allowed per byte of the file (plus ``slack``).
        slack: bytes allowed on top of the budget (small files).
    """

    storages: Mapping[tuple[str, str], int] = field(default_factory=dict)
    calls: Mapping[tuple[str, str], Callable[[tuple[Any, ...], _Scan], Any]] = field(
        default_factory=dict
    )
    names: frozenset[tuple[str, str]] = frozenset()
    budget: int = 4
    slack: int = 1 << 20


def _size_of(value: Any) -> int:
    """The expanded size of a stand-in or constant: bytes for str/bytes, 1 for a scalar."""
    if isinstance(value, _Node):
        return value.size
    if isinstance(value, (str, bytes)):
        return max(1, len(value))
    return 1


def _freeze(value: Any) -> Any:
    """Mark ``value`` as placed inside another object (it may no longer change)."""
    if isinstance(value, _Node):
        if value.kind in ("array", "dtype") and not value.info.get("built"):
            raise _Refused(
                f"a NumPy {value.kind} is used before its BUILD completed it (its memory "
                "would be uninitialised)"
            )
        value.frozen = True
    return value


def node(kind: str, size: int = 1, items: tuple[Any, ...] = (), info: Any = None) -> _Node:
    """A new stand-in (for the rules of :class:`Rules`)."""
    return _Node(kind, size, items, info)


def is_node(value: Any, kind: str) -> bool:
    """Whether ``value`` is a stand-in of ``kind`` (``global``, ``tuple``, ``dict``...)."""
    return isinstance(value, _Node) and value.kind == kind


class _Scan:
    """One run of the opcodes on stand-ins; see :func:`scan_pickle`."""

    def __init__(self, archive: Archive, rules: Rules) -> None:
        self.archive = archive
        self.rules = rules
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.storages: dict[str, tuple[int, int]] = {}
        self.pending: list[_Node] = []  # NumPy stand-ins waiting for their BUILD

    def _fenced(self) -> bool:
        """Whether nothing is on the stack above the newest MARK (the unpickler's fence)."""
        return not self.stack or bool(self.marks and len(self.stack) <= self.marks[-1])

    def top(self, op: str) -> Any:
        if self._fenced():
            raise _Refused(f"{op} finds the stack empty")
        return self.stack[-1]

    def pop(self) -> Any:
        if self._fenced():
            raise _Refused("an opcode finds the stack empty")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _Refused("an opcode wants a MARK that is not there")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def target(self, kinds: tuple[str, ...], op: str) -> _Node:
        obj = self.top(op)
        if not isinstance(obj, _Node) or obj.kind not in kinds:
            raise _Refused(f"{op} applied to {_describe(obj)}")
        if obj.frozen:
            raise _Refused(
                f"{op} changes {_describe(obj)} after it was placed inside another object "
                "(torch.save never does; it would hide a cycle or a size)"
            )
        return obj

    def container(self, kind: str, items: list[Any]) -> _Node:
        for item in items:
            _freeze(item)
        size = 1 + sum(_size_of(i) for i in items)
        return _Node(kind, size, tuple(items) if kind == "tuple" else ())

    def storage(self, pid: Any) -> _Node:
        """A ``BINPERSID`` reference: ``('storage', type, key, location, numel)``."""
        items: tuple[Any, ...] = pid.items if is_node(pid, "tuple") else ()
        if len(items) != 5 or items[0] != "storage":
            raise _Refused(f"a persistent id {_describe(pid)} is not a storage reference")
        kind, key, location, numel = items[1:]
        itemsize = self.rules.storages.get(kind.info) if is_node(kind, "global") else None
        if itemsize is None:
            raise _Refused(f"the storage type {_describe(kind)} is not one torch.save writes")
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int:
            raise _Refused(f"the storage reference {key!r:.40} is malformed")
        if not re.fullmatch(r"[a-z]+(:\d+)?", location):
            raise _Refused(f"the storage {key!r:.40} has the location {location!r:.40}")
        record = f"data/{key}"
        have = self.archive.records.get(record)
        if have is None:
            raise _Refused(f"the storage {key!r:.40} has no record {record!r} in the archive")
        if numel < 0 or numel * itemsize != have:
            raise _Refused(
                f"the storage {key!r} claims {numel} element(s) of {itemsize} byte(s) but its "
                f"record holds {have} bytes"
            )
        seen = self.storages.setdefault(key, (itemsize, numel))
        if seen != (itemsize, numel):
            raise _Refused(f"the storage {key!r} is referenced with two different types")
        return _Node("storage", 1, info={"key": key, "itemsize": itemsize, "numel": numel})

    def reduce(self, func: Any, args: Any) -> Any:
        if not is_node(func, "global"):
            raise _Refused(f"REDUCE calls {_describe(func)}, not an allowed global")
        if not is_node(args, "tuple"):
            raise _Refused(f"REDUCE calls {_dotted(func.info)!r} with {_describe(args)}")
        rule = self.rules.calls.get(func.info)
        if rule is None:
            raise _Refused(f"the global {_dotted(func.info)!r} may not be called")
        for item in args.items:
            _freeze(item)
        try:
            result = rule(args.items, self)
        except ValueError as exc:
            raise _Refused(f"{_dotted(func.info)!r} with these arguments: {exc}") from None
        if isinstance(result, _Node) and result.kind in ("array", "dtype"):
            self.pending.append(result)
        return result

    def build(self, state: Any) -> None:
        obj = self.target(("array", "dtype"), "BUILD")
        if obj.info.get("built"):
            raise _Refused(f"BUILD completes {_describe(obj)} a second time")
        _freeze(state)
        complete = obj.info["build"]
        try:
            obj.size = complete(state)
        except ValueError as exc:
            raise _Refused(f"the BUILD of a NumPy {obj.kind}: {exc}") from None
        obj.info["built"] = True


def _dotted(pair: Any) -> str:
    module, name = pair
    return f"{module}.{name}"


def _describe(value: Any) -> str:
    if isinstance(value, _Node):
        return f"the global {_dotted(value.info)!r}" if value.kind == "global" else value.kind
    return type(value).__name__


# Opcodes that push a constant: their argument is the value.
_CONSTANTS = {
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "LONG4",
    "BINFLOAT",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
}
_FIXED = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def tensor_extent(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements spanned by a tensor after its offset; ``ValueError`` if two elements share
    memory (a stride of 0 over a dimension longer than 1, or overlapping dimensions)."""
    if any(s == 0 for s in size):
        return 0
    extent = 1
    for length, step in sorted(zip(size, stride), key=lambda p: p[1]):
        if length == 1:
            continue
        if step < extent:
            raise ValueError(
                f"size {list(size)} with stride {list(stride)} makes elements share memory "
                "(a stride of 0 or overlapping dimensions expand a small storage)"
            )
        extent = step * (length - 1) + extent
    return extent


def _tensor_rule(args: tuple[Any, ...], scan: _Scan) -> _Node:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
    backward_hooks)``: a dense tensor inside its storage, elements never sharing memory."""
    if len(args) != 6:
        raise ValueError(f"{len(args)} arguments, not 6 (storage, offset, size, stride, ...)")
    storage, offset, size, stride, grad, hooks = args
    if not is_node(storage, "storage"):
        raise ValueError(f"the storage is {_describe(storage)}")
    sizes = size.items if is_node(size, "tuple") else None
    strides = stride.items if is_node(stride, "tuple") else None
    if (
        sizes is None
        or strides is None
        or len(sizes) != len(strides)
        or not all(type(v) is int and v >= 0 for v in (*sizes, *strides))
        or type(offset) is not int
        or offset < 0
    ):
        raise ValueError("offset, size and stride must be whole numbers >= 0, one stride a size")
    if type(grad) is not bool or not (is_node(hooks, "dict") and hooks.size == 1):
        raise ValueError("requires_grad must be a bool and backward_hooks an empty dict")
    extent = tensor_extent(sizes, strides)
    numel = storage.info["numel"]
    if offset > numel or (extent and offset + extent > numel):
        raise ValueError(
            f"size {list(sizes)}, stride {list(strides)} at offset {offset} reach element "
            f"{offset + extent} of a storage of {numel}"
        )
    return _Node("tensor", max(1, math.prod(sizes) * storage.info["itemsize"]))


def _ordered_dict(args: tuple[Any, ...], scan: _Scan) -> _Node:
    if args:
        raise ValueError("torch.save pickles an OrderedDict as OrderedDict() and its items")
    return _Node("dict")


def _latin1(args: tuple[Any, ...], scan: _Scan) -> bytes:
    # Protocol 2 has no bytes opcode: bytes are pickled as _codecs.encode(text, 'latin1').
    if len(args) != 2 or not isinstance(args[0], str) or args[1] != "latin1":
        raise ValueError("only encode(text, 'latin1'), how protocol 2 pickles bytes")
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:
        raise ValueError("the text has characters outside latin-1") from None


def _set(args: tuple[Any, ...], scan: _Scan) -> _Node:
    # Protocol 2 has no set opcode: a set is pickled as set([items]).
    if args == ():
        return _Node("set")
    if len(args) != 1 or not is_node(args[0], "list"):
        raise ValueError("only set() or set(list), how protocol 2 pickles a set")
    return _Node("set", args[0].size)


def _size(args: tuple[Any, ...], scan: _Scan) -> _Node:
    dims: Any = args[0] if len(args) == 1 else None
    if not is_node(dims, "tuple") or not all(type(d) is int and d >= 0 for d in dims.items):
        raise ValueError("only torch.Size(tuple of whole numbers >= 0)")
    return _Node("tuple", dims.size, dims.items)


def _device(args: tuple[Any, ...], scan: _Scan) -> str:
    if not (
        1 <= len(args) <= 2
        and isinstance(args[0], str)
        and re.fullmatch(r"[a-z]+(:\d+)?", args[0])
        and all(type(a) is int and a >= 0 for a in args[1:])
    ):
        raise ValueError("only torch.device('type[:index]'[, index])")
    return args[0]


def torch_rules() -> Rules:
    """The globals of a ``torch.save`` of plain data: the typed storages (by their pickled
    names), ``_rebuild_tensor_v2``, ``OrderedDict()``, protocol 2's bytes and sets,
    ``torch.Size``, ``torch.device`` and the dtypes (by name, never called). Quantized and
    sparse tensors, parameters and tensor subclasses are not among them."""
    storages = {
        ("torch", name): dtype.itemsize
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if not name.startswith("Q")  # quantized storages: torch.save of a qtensor
    }
    calls: dict[tuple[str, str], Callable[[tuple[Any, ...], _Scan], Any]] = {
        ("torch._utils", "_rebuild_tensor_v2"): _tensor_rule,
        ("collections", "OrderedDict"): _ordered_dict,
        ("_codecs", "encode"): _latin1,
        ("builtins", "set"): _set,
        ("torch", "Size"): _size,
        ("torch", "device"): _device,
    }
    dtypes = frozenset(
        ("torch", name)
        for name in dir(torch)
        if isinstance(getattr(torch, name, None), torch.dtype)
        and not getattr(torch, name).is_complex
    )
    return Rules(storages=storages, calls=calls, names=dtypes)


def scan_pickle(archive: Archive, url: str, rules: Rules) -> None:
    """Run ``archive``'s pickle on stand-ins under ``rules``; refuse what torch.save would not
    write (see the module docstring).

    Raises:
        CorruptCheckpointError: naming ``url`` and the global, opcode, record or tensor at
            fault; a global outside ``rules`` is named as ``'module.name'``.
    """
    scan = _Scan(archive, rules)
    try:
        result = _run(scan, archive.pickle)
    except _Refused as exc:
        raise _corrupt(url, str(exc)) from None
    except Exception as exc:  # a malformed stream: genops' errors are not one type
        raise _corrupt(
            url, f"its pickle is malformed ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    unbuilt = [n for n in scan.pending if not n.info.get("built")]
    if unbuilt:
        raise _corrupt(
            url,
            f"a NumPy {unbuilt[0].kind} is never completed by its BUILD (its memory would be "
            "uninitialised)",
        )
    limit = rules.budget * archive.size + rules.slack
    expanded = _size_of(result)
    if expanded > limit:
        raise _corrupt(
            url,
            f"its value expands to {expanded} bytes (shared objects counted where they occur) "
            f"from a file of {archive.size}; at most {limit} are read",
        )


def _run(scan: _Scan, data: bytes) -> Any:
    stack = scan.stack
    arg: Any
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name in _CONSTANTS:
            stack.append(arg)
        elif name in _FIXED:
            stack.append(_FIXED[name])
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "MARK":
            scan.marks.append(len(stack))
        elif name in ("BINPUT", "LONG_BINPUT"):
            scan.memo[arg] = scan.top(name)
        elif name == "MEMOIZE":
            scan.memo[len(scan.memo)] = scan.top(name)
        elif name in ("BINGET", "LONG_BINGET"):
            if arg not in scan.memo:
                raise _Refused(f"{name} {arg} names nothing remembered")
            stack.append(scan.memo[arg])
        elif name == "POP":
            scan.pop()
        elif name == "POP_MARK":
            scan.pop_mark()
        elif name == "DUP":
            stack.append(scan.top(name))
        elif name == "EMPTY_TUPLE":
            stack.append(scan.container("tuple", []))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            items = [scan.pop() for _ in range(count)][::-1]
            stack.append(scan.container("tuple", items))
        elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            items = scan.pop_mark()
            kind = {"TUPLE": "tuple", "LIST": "list", "DICT": "dict", "FROZENSET": "set"}[name]
            if kind == "dict" and len(items) % 2:
                raise _Refused("DICT with an odd number of items")
            stack.append(scan.container(kind, items))
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            stack.append(_Node(name[6:].lower()))
        elif name in ("APPEND", "SETITEM"):
            items = [scan.pop() for _ in range(1 if name == "APPEND" else 2)]
            _extend(scan, ("list",) if name == "APPEND" else ("dict",), name, items)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = scan.pop_mark()
            kinds = {"APPENDS": ("list",), "SETITEMS": ("dict",), "ADDITEMS": ("set",)}[name]
            if name == "SETITEMS" and len(items) % 2:
                raise _Refused("SETITEMS with an odd number of items")
            _extend(scan, kinds, name, items)
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = arg.partition(" ")
                # Python 2 names, resolved as torch's weights-only unpickler resolves them
                # (torch.save's protocol 2 writes __builtin__ for builtins).
                if (module, attr) in NAME_MAPPING:
                    module, attr = NAME_MAPPING[(module, attr)]
                elif module in IMPORT_MAPPING:
                    module = IMPORT_MAPPING[module]
            else:
                attr, module = scan.pop(), scan.pop()
                if not isinstance(module, str) or not isinstance(attr, str):
                    raise _Refused("STACK_GLOBAL with names that are not strings")
            pair = (module, attr)
            rules = scan.rules
            if pair not in rules.calls and pair not in rules.storages and pair not in rules.names:
                raise _Refused(f"it wants the global {_dotted(pair)!r}")
            stack.append(_Node("global", 1, info=pair))
        elif name == "REDUCE":
            args = scan.pop()
            stack.append(scan.reduce(scan.pop(), args))
        elif name == "BUILD":
            scan.build(scan.pop())
        elif name == "BINPERSID":
            stack.append(scan.storage(_freeze(scan.pop())))
        elif name == "STOP":
            if len(stack) != 1 or scan.marks:
                raise _Refused("the pickle stops with a stack that is not one value")
            return _freeze(stack.pop())
        else:
            raise _Refused(f"it uses the opcode {name}, which torch.save never writes")
    raise _Refused("the pickle has no STOP")


def _extend(scan: _Scan, kinds: tuple[str, ...], op: str, items: list[Any]) -> None:
    for item in items:
        _freeze(item)
    target = scan.target(kinds, op)
    target.size += sum(_size_of(i) for i in items)
