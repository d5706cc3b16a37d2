# SPDX-License-Identifier: Apache-2.0
"""keel: safe, fast filesystem coordination and storage for Linux, from Python.

- ``keel.FileLock(path)``: a drop-in for ``filelock.FileLock`` (flock(2) on the file, so it
  excludes filelock, portalocker and flock(1) users of the same file), that waits in the
  kernel instead of polling.
- ``keel.Mutex(path, algorithm=...)``: keel's mutexes over sets of named entities, shared or
  exclusive, with timeouts, correct where holders die and on filesystems shared by machines.
- ``keel.Store(path, **options)``: an embedded transactional store, a mutable mapping of
  bytes to bytes shared by threads and processes (fork and multiprocessing included), with
  transactions (``with s.transaction() as t:``), crash-safe and checksummed.

Errors are ``keel.Error`` (an OSError keeping errno, message and file), ``keel.Conflict``
(retry the transaction) and ``keel.Timeout`` (a TimeoutError, as ``filelock.Timeout``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from . import _keel
from ._errors import Conflict, Error, Timeout
from ._filelock import AcquireReturnProxy, BaseFileLock, FileLock, UnixFileLock
from ._keel import Mutex, MutexGuard, Transaction

__version__: str = _keel.__version__

for _cls in (Error, Conflict, Timeout):
    _cls.__module__ = "keel"


_MISSING: Any = object()


def _reopen(path: str, options: dict[str, Any]) -> Store:
    return Store(path, **options)


class Store(_keel.Store):
    """A keel store at ``path`` (a directory, made if missing), as a mutable mapping of bytes
    to bytes: ``s[k]``, ``s[k] = v``, ``del s[k]``, ``k in s``, ``s.get(k)``, ``len(s)``,
    iteration over keys, ``values()`` and ``items()`` (a key present throughout is seen once,
    while others write). Every thread and process that opens the same path shares it; a child
    made by fork or multiprocessing may use its parent's (spawned ones reopen it by path).

    Options (keywords): ``create_if_missing`` (True), ``error_if_exists``, ``read_only``,
    ``durable`` (commits on stable storage when they return; False: they survive a crash of
    the process, not of the machine), ``verify_checksums`` (True), ``segment_size``,
    ``max_bytes``, ``lock_timeout`` (seconds), ``checkpoint_bytes``,
    ``compact_dead_fraction``, ``ledger``, ``every_user_on_this_host`` (see keel::kv::options).
    """

    def pop(self, key: bytes, default: Any = _MISSING) -> Any:
        """Removes ``key`` and returns its value, in one transaction (no other writer's value
        is lost between the read and the delete); ``default`` if absent, else KeyError."""
        while True:
            try:
                with self.transaction() as t:
                    value = t.get(key)
                    if value is None:
                        if default is _MISSING:
                            raise KeyError(key)
                        return default
                    del t[key]
                return value
            except Conflict:
                continue  # another wrote the key meanwhile: read it again

    def popitem(self) -> tuple[bytes, bytes]:
        """Removes some key and returns it with its value; KeyError when the store is empty."""
        for key in self.keys():
            value = self.pop(key, None)
            if value is not None:
                return key, value
        raise KeyError("popitem(): the store is empty")

    def setdefault(self, key: bytes, default: Any = None) -> Any:
        """The value of ``key``; absent, ``default`` is stored and returned, in one transaction
        (of two callers at once, one stores and both return what it stored)."""
        while True:
            try:
                with self.transaction() as t:
                    value = t.get(key)
                    if value is not None:
                        return value
                    t[key] = default
                return default
            except Conflict:
                continue

    def clear(self) -> None:
        """Removes every key (each by itself: keys written meanwhile may stay)."""
        for key in list(self.keys()):
            self.pop(key, None)

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Stores each key and value of ``other`` (a mapping, or pairs), each by itself.
        (Keywords, which are str, are refused as any str key is: encode them.)"""
        pairs = other.items() if hasattr(other, "items") else other
        for key, value in pairs:
            self[key] = value
        for key, value in kwargs.items():
            self[key] = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Store, dict)):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        if self.closed:
            raise ValueError("the store is closed: a closed store is not pickled")
        return (_reopen, (self.path, self.options))

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"keel.Store({self.path!r}, {state})"


MutableMapping.register(Store)

__all__ = ["AcquireReturnProxy", "BaseFileLock", "Conflict", "Error", "FileLock", "Mutex",
           "MutexGuard", "Store", "Timeout", "Transaction", "UnixFileLock", "__version__"]
