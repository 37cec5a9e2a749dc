"""State dicts without pickle: tensors in safetensors, structure in JSON.

An object's state ``S`` (optimizer, scheduler, grad scaler, dataloader position, registered
object, RNG states) is stored under a stem ``X`` as:

- ``X.json`` -- the structure, with type tags where JSON has no type: ``{"__tensor__": "t0"}``
  (a tensor in ``X.safetensors``; one tensor shared under several keys is stored once),
  ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (non-string keys, or keys
  that look like tags), ``{"__float__": "inf" | "-inf" | "nan"}``, ``{"__ndarray__": "t1"}``,
  ``{"__npscalar__": [dtype, value]}``, ``{"__bytes__": base64}``, ``{"__dtype__": "float32"}``,
  ``{"__device__": "cuda:0"}``, ``{"__size__": [..]}``, ``{"__set__": [...]}``;
- ``X.safetensors`` -- the tensors, if any;
- ``X.pt`` -- only for values none of the above can hold, written with ``torch.save`` and read
  back with ``torch.load(weights_only=True)``, which refuses arbitrary classes.

Public API:

- :func:`encode_state(state) <encode_state>` -> ``(tree, tensors, extras)`` and
  :func:`decode_state(tree, tensors, extras, source) <decode_state>`.
- :func:`write_state(storage, folder, stem, state) <write_state>` -> ``{relative name:
  WrittenFile}``; :func:`write_encoded` writes what :func:`encode_state` returned (an
  asynchronous save encodes first, copies the tensors, and writes later).
- :func:`read_state(storage, folder, stem, expected) <read_state>` -> the state, verified
  against manifest entries (relative name -> entry) when given.
- :func:`state_files(stem) <state_files>` -- the names a stem may use.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from accelkit.checkpointing.errors import CorruptCheckpointError
from accelkit.checkpointing.formats.jsonio import load_json
from accelkit.checkpointing.formats.layout import STRUCTURE_SUFFIX, TENSORS_SUFFIX, TORCH_SUFFIX
from accelkit.checkpointing.formats.safetensors_io import (
    read_safetensors,
    supports_dtype,
    write_safetensors,
)
from accelkit.checkpointing.storage import Storage, WrittenFile, join
from accelkit.checkpointing.storage.verified import read_verified_bytes

__all__ = [
    "decode_state",
    "encode_state",
    "read_state",
    "state_files",
    "write_encoded",
    "write_state",
]

_FORMAT = "accelkit-state"
_VERSION = 1
_TAGS = frozenset(
    {
        "__tensor__",
        "__tuple__",
        "__dict__",
        "__float__",
        "__ndarray__",
        "__npscalar__",
        "__bytes__",
        "__dtype__",
        "__device__",
        "__size__",
        "__set__",
        "__torch__",
    }
)
_DTYPE_NAMES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def state_files(stem: str) -> tuple[str, str, str]:
    """``(X.json, X.safetensors, X.pt)`` for stem ``X``."""
    return stem + STRUCTURE_SUFFIX, stem + TENSORS_SUFFIX, stem + TORCH_SUFFIX


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.extras: list[Any] = []
        self._by_id: dict[int, str] = {}

    def _tensor(self, t: torch.Tensor) -> str:
        key = self._by_id.get(id(t))
        if key is None:
            key = f"t{len(self.tensors)}"
            self._by_id[id(t)] = key
            self.tensors[key] = t.detach()
        return key

    def __call__(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or not supports_dtype(obj.dtype):
                return self._extra(obj)
            out: dict[str, Any] = {"__tensor__": self._tensor(obj)}
            if obj.device.type != "cpu":
                out["device"] = str(obj.device)
            return out
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in "biuf" and obj.dtype.byteorder in ("=", "|", "<"):
                return {"__ndarray__": self._tensor(torch.from_numpy(np.ascontiguousarray(obj)))}
            return self._extra(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return {"__npscalar__": [obj.dtype.str, self(obj.item())]}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, tuple) and type(obj) is tuple:
            return {"__tuple__": [self(v) for v in obj]}
        if isinstance(obj, list) and type(obj) is list:
            return [self(v) for v in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in obj):
                return {k: self(v) for k, v in obj.items()}
            return {"__dict__": [[self(k), self(v)] for k, v in obj.items()]}
        if isinstance(obj, (set, frozenset)):
            return {"__set__": [self(v) for v in obj]}
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, int):  # int subclasses (enums...): keep the value only if plain
            return self._extra(obj)
        return self._extra(obj)

    def _extra(self, obj: Any) -> dict[str, int]:
        self.extras.append(obj)
        return {"__torch__": len(self.extras) - 1}


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor], list[Any]]:
    """Split ``state`` into a JSON-able tree, its tensors, and values only torch can save."""
    encoder = _Encoder()
    tree = encoder(state)
    return tree, encoder.tensors, encoder.extras


def _bad(source: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {why}. The file is damaged or was not written by accelkit: load another "
        "checkpoint."
    )


def decode_state(
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    extras: list[Any],
    source: str = "state",
    map_location: torch.device | str | None = None,
) -> Any:
    """Rebuild the object :func:`encode_state` split; tensors go back to their saved device
    (or ``map_location``; the CPU when that device is not available)."""

    def device_of(saved: str | None) -> torch.device | None:
        if map_location is not None:
            return torch.device(map_location)
        if saved is None:
            return None
        device = torch.device(saved)
        if device.type == "cuda" and not torch.cuda.is_available():
            return None
        return device

    def tensor(key: Any) -> torch.Tensor:
        if not isinstance(key, str) or key not in tensors:
            raise _bad(source, f"refers to tensor {key!r}, which is not stored")
        return tensors[key]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            if isinstance(node, float) and not math.isfinite(node):
                raise _bad(source, "contains a bare non-finite float")
            return node
        tags = [k for k in node if k in _TAGS]
        if not tags:
            return {k: walk(v) for k, v in node.items()}
        tag = tags[0]
        try:
            return tagged(tag, node[tag], node)
        except CorruptCheckpointError:
            raise
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError, RecursionError):
            raise _bad(source, f"has an invalid {tag} value {node[tag]!r:.80}") from None

    def tagged(tag: str, value: Any, node: dict[str, Any]) -> Any:
        if tag == "__tensor__":
            t = tensor(value)
            device = device_of(node.get("device"))
            return t.to(device) if device is not None and device != t.device else t
        if tag == "__tuple__" and isinstance(value, list):
            return tuple(walk(v) for v in value)
        if tag == "__dict__" and isinstance(value, list):
            out = {}
            for pair in value:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _bad(source, "has a malformed __dict__ entry")
                out[walk(pair[0])] = walk(pair[1])
            return out
        if tag == "__float__" and value in ("inf", "-inf", "nan"):
            return float(value)
        if tag == "__ndarray__":
            return tensor(value).numpy().copy()
        if tag == "__npscalar__" and isinstance(value, list) and len(value) == 2:
            dtype = np.dtype(value[0])
            if dtype.kind not in "biuf":
                raise _bad(source, f"has an invalid {tag} value {value!r:.80}")
            return dtype.type(walk(value[1]))
        if tag == "__bytes__" and isinstance(value, str):
            return base64.b64decode(value, validate=True)
        if tag == "__dtype__" and isinstance(value, str) and value in _DTYPE_NAMES:
            return _DTYPE_NAMES[value]
        if tag == "__device__" and isinstance(value, str):
            return torch.device(value)
        if tag == "__size__" and isinstance(value, list):
            return torch.Size(value)
        if tag == "__set__" and isinstance(value, list):
            return {walk(v) for v in value}
        if tag == "__torch__" and type(value) is int and 0 <= value < len(extras):
            return extras[value]
        raise _bad(source, f"has an invalid {tag} value {value!r:.80}")

    return walk(tree)


def write_state(storage: Storage, folder: str, stem: str, state: Any) -> dict[str, WrittenFile]:
    """Write ``state`` as ``<stem>.json`` (+ ``.safetensors``, + ``.pt`` if needed).

    Returns:
        Relative file name -> :class:`~accelkit.checkpointing.storage.WrittenFile`.
    """
    return write_encoded(storage, folder, stem, *encode_state(state))


def write_encoded(
    storage: Storage,
    folder: str,
    stem: str,
    tree: Any,
    tensors: Mapping[str, torch.Tensor],
    extras: list[Any],
) -> dict[str, WrittenFile]:
    """Write a state :func:`encode_state` split, as :func:`write_state` does."""
    json_name, tensors_name, torch_name = state_files(stem)
    written: dict[str, WrittenFile] = {}
    if tensors:
        written[tensors_name] = write_safetensors(storage, join(folder, tensors_name), tensors)
    if extras:
        buffer = io.BytesIO()
        torch.save(extras, buffer)
        written[torch_name] = storage.write_bytes(join(folder, torch_name), buffer.getbuffer())
    doc = {"format": _FORMAT, "version": _VERSION, "state": tree}
    data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("utf-8")
    written[json_name] = storage.write_bytes(join(folder, json_name), data)
    return written


def read_state(
    storage: Storage,
    folder: str,
    stem: str,
    expected: Mapping[str, Any] | None = None,
    map_location: torch.device | str | None = None,
    zero_copy: bool = False,
) -> Any:
    """Read the state stored under ``stem`` in ``folder``.

    Args:
        storage: its storage.
        folder: the checkpoint folder.
        stem: e.g. ``optimizer``, ``random_states_0``.
        expected: manifest entries by relative name; when given, only files listed there are
            read and each is verified.
        map_location: put every tensor on this device instead of its saved one.
        zero_copy: on a local disk, CPU tensors view a private (copy-on-write) memory map of
            the file, like ``torch.load(mmap=True)``, instead of being read into new memory.

    Raises:
        CorruptCheckpointError: naming the file, if one is missing, damaged, or malformed.
    """
    json_name, tensors_name, torch_name = state_files(stem)
    json_url = join(folder, json_name)
    raw = read_verified_bytes(storage, json_url, (expected or {}).get(json_name))
    doc = load_json(raw, json_url)
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or "state" not in doc:
        raise _bad(json_url, "is not an accelkit state file")
    if doc.get("version") != _VERSION:
        raise CorruptCheckpointError(
            f"{json_url}: state format version {doc.get('version')!r} is not supported; "
            "upgrade accelkit to load it."
        )
    tensors: dict[str, torch.Tensor] = {}
    extras: list[Any] = []
    if expected is not None:
        has_tensors, has_extras = tensors_name in expected, torch_name in expected
    else:
        has_tensors = storage.exists(join(folder, tensors_name))
        has_extras = storage.exists(join(folder, torch_name))
    if has_tensors:
        tensors, _ = read_safetensors(
            storage, join(folder, tensors_name), (expected or {}).get(tensors_name), zero_copy
        )
    if has_extras:
        torch_url = join(folder, torch_name)
        data = read_verified_bytes(storage, torch_url, (expected or {}).get(torch_name))
        try:
            extras = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{torch_url}: refused by torch.load(weights_only=True) ({exc}). accelkit never "
                "unpickles arbitrary objects; make the state_dict hold tensors, numbers, "
                "strings, lists and dicts."
            ) from None
        if not isinstance(extras, list):
            raise _bad(torch_url, "does not hold a list")
    return decode_state(doc["state"], tensors, extras, json_url, map_location)
