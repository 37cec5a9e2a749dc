"""All storage access of accelkit's checkpoints, and the storage chosen for a URL.

A location is a plain string: a local path (``/runs/exp1``, ``runs/exp1``) or any fsspec URL
(``s3://bucket/run-7``, ``memory://run``, ``gcs://...``). URLs stay strings on purpose:
``pathlib.Path`` would collapse the ``//`` of ``s3://``.

Public API:

- :func:`get_storage(url, storage_options=None) <get_storage>` -- the :class:`Storage` that
  serves ``url``, of the class registered for its protocol (as fsspec's registry does):
  :class:`~accelkit.checkpointing.storage.local.LocalStorage` for local paths,
  :class:`~accelkit.checkpointing.storage.fsspec.S3Storage` for ``s3://``, and
  :class:`~accelkit.checkpointing.storage.fsspec.FsspecStorage` for every other fsspec
  protocol. ``storage_options`` go to fsspec (e.g. ``{"endpoint_url": ..., "key": ...,
  "secret": ...}`` for S3); fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL`` and
  friends) and the backend's environment variables work too.
- :func:`register_storage(protocol, factory) <register_storage>` -- serve a protocol with
  another class (a subclass of :class:`FsspecStorage` with a backend's quirks, say).
- :func:`join(base, *names) <join>`, :func:`basename` and :func:`protocol_of`.
- :class:`Storage` (the contract: the base class every storage subclasses, and the type the
  checkpoint code is annotated with), :class:`WrappedStorage`, :class:`HashingWriter`,
  :class:`Entry`, :class:`WrittenFile`, :class:`StorageError` and its children of each
  ``OSError`` kind (:class:`StorageNotFoundError` is also a ``FileNotFoundError``): see
  :mod:`~accelkit.checkpointing.storage.base`.
- :func:`sync_batch` -- a context manager: local files written inside it are ``fsync``-ed in
  background threads, overlapping the next writes; leaving it waits for all of them.
- :func:`parts_in_flight(limit) <parts_in_flight>` -- a context manager: S3 uploads begun
  inside it in this thread keep at most ``limit`` parts in memory at once (the replicator's
  budget).

Durability: every file written through :meth:`Storage.open_write` or
:meth:`Storage.write_bytes` is durable once reported written (``fsync`` on a local disk, a
completed upload on an object store), and an atomic write is seen whole or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from accelkit.checkpointing.storage._localfile import sync_batch
from accelkit.checkpointing.storage._s3io import parts_in_flight
from accelkit.checkpointing.storage.base import (
    Entry,
    HashingWriter,
    Storage,
    StorageConnectionError,
    StorageError,
    StorageExistsError,
    StorageIsADirectoryError,
    StorageNotADirectoryError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageTimeoutError,
    WrappedStorage,
    WrittenFile,
    basename,
    join,
    protocol_of,
)
from accelkit.checkpointing.storage.local import LocalStorage
from accelkit.errors import ConfigurationError

__all__ = [
    "Entry",
    "HashingWriter",
    "LocalStorage",
    "Storage",
    "StorageFactory",
    "StorageConnectionError",
    "StorageError",
    "StorageExistsError",
    "StorageIsADirectoryError",
    "StorageNotADirectoryError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageTimeoutError",
    "WrappedStorage",
    "WrittenFile",
    "basename",
    "get_storage",
    "join",
    "parts_in_flight",
    "protocol_of",
    "register_storage",
    "sync_batch",
]

StorageFactory = Callable[[str, Mapping[str, Any]], Storage]
"""Builds the storage of a protocol: ``factory(protocol, storage_options) -> Storage``."""

_LOCAL_PROTOCOLS = ("file", "local")


def _local(protocol: str, options: Mapping[str, Any]) -> Storage:
    return LocalStorage()


def _fsspec(protocol: str, options: Mapping[str, Any]) -> Storage:
    from accelkit.checkpointing.storage.fsspec import fsspec_storage

    return fsspec_storage(protocol, options)


_FACTORIES: dict[str, StorageFactory] = dict.fromkeys(_LOCAL_PROTOCOLS, _local)
_STORAGES: dict[tuple[str, tuple[tuple[str, str], ...]], Storage] = {}


def register_storage(protocol: str, factory: StorageFactory, overwrite: bool = False) -> None:
    """Serve URLs of ``protocol`` with the storage ``factory`` builds.

    Args:
        protocol: the protocol as written in URLs (``"gs"`` for ``gs://bucket``).
        factory: ``factory(protocol, storage_options) -> Storage``. For an fsspec filesystem
            with quirks of its own: ``lambda protocol, options: MyFsspecStorage(
            fsspec.filesystem(protocol, **options), protocol)``.
        overwrite: replace a factory already registered for ``protocol``.

    Raises:
        ConfigurationError: (a ``ValueError``) if ``protocol`` already has a factory and
            ``overwrite`` is false.
    """
    if protocol in _FACTORIES and not overwrite:
        raise ConfigurationError(
            f"Storage protocol {protocol!r} is already served by {_FACTORIES[protocol]!r}. "
            "Pass overwrite=True to replace it."
        )
    _FACTORIES[protocol] = factory
    for key in [k for k in _STORAGES if k[0] == protocol]:
        del _STORAGES[key]


def get_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """Return the :class:`Storage` for ``url`` (one shared instance per protocol and options).

    Args:
        url: a local path or an fsspec URL; only its protocol matters here.
        storage_options: keyword arguments for the fsspec filesystem (S3: ``endpoint_url``,
            ``key``, ``secret``, ``client_kwargs``...).

    Raises:
        ConfigurationError: (a ``ValueError``) if the protocol is unknown or its package is not
            installed (the message names the package to install).
    """
    protocol = protocol_of(url)
    options = dict(storage_options or {})
    key = (protocol, tuple(sorted((k, repr(v)) for k, v in options.items())))
    cached = _STORAGES.get(key)
    if cached is not None:
        return cached
    factory = _FACTORIES.get(protocol, _fsspec)
    try:
        storage = factory(protocol, options)
    except ImportError as exc:
        hint = "pip install 'accelkit[s3]'" if protocol in ("s3", "s3a") else str(exc)
        raise ConfigurationError(
            f"Cannot open {url!r}: the package for protocol {protocol!r} is not installed. "
            f"Fix: {hint}"
        ) from exc
    except ValueError as exc:
        raise ConfigurationError(
            f"Cannot open {url!r}: unknown storage protocol {protocol!r} ({exc})."
        ) from exc
    _STORAGES[key] = storage
    # "file" and "local" are one disk: share the instance.
    if protocol in _LOCAL_PROTOCOLS and factory is _local:
        for other in _LOCAL_PROTOCOLS:
            _STORAGES.setdefault((other, key[1]), storage)
    return storage
