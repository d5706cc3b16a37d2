# SPDX-License-Identifier: Apache-2.0
"""keel.FileLock: a drop-in for ``filelock.FileLock``, on keel's flock(2) with deadlines."""

from __future__ import annotations

import math
import os
import warnings
from types import TracebackType

from . import _keel
from ._errors import Timeout


class _AcquireReturnProxy:
    """What ``acquire`` returns: a context manager that releases the lock (as filelock's)."""

    def __init__(self, lock: FileLock) -> None:
        self.lock = lock

    def __enter__(self) -> FileLock:
        return self.lock

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.lock.release()


class FileLock:
    """An exclusive lock on the file at ``lock_file``, held by this object: flock(2) on the
    whole file, the lock ``filelock.FileLock``, ``portalocker`` and flock(1) take, so each
    excludes the others on the same file. The file is made if missing and left in place.

    As ``filelock.FileLock``: ``acquire(timeout=..., blocking=...)`` (a timeout of -1 waits for
    ever, 0 tries once), ``release()``, ``is_locked``, ``with lock:``, and ``keel.Timeout`` (a
    TimeoutError) when the lock cannot be had in time. It is re-entrant in the thread holding
    it: each acquire needs its release. Unlike filelock it does not poll: a waiter sleeps in
    the kernel and gets the lock the moment it is free (on a filesystem other machines share,
    it asks again from 50 us to 10 ms apart); another thread of this process using the same
    object waits for the holding thread to release it; a waiter that started on a file since
    removed or replaced ends holding the file the path names; a holder that dies, even by
    SIGKILL, lets it go at once; and a forked child holds none of its parent's hold (nor keeps
    the lock alive past its parent's death).
    """

    def __init__(self, lock_file: str | os.PathLike[str], timeout: float = -1) -> None:
        self._lock_file = os.fspath(lock_file)
        self._timeout = float(timeout)
        # Who holds it in this process, how many times, and the descriptor holding the file's
        # lock: kept in C++, where no signal handler's exception can come between the steps of
        # an acquire or a release. A forked child holds none of it (its copy of the
        # descriptor is closed at the fork). Its end lets a held lock go.
        self._core = _keel._FileLockCore(self._lock_file)

    @property
    def lock_file(self) -> str:
        """The path of the lock file."""
        return self._lock_file

    @property
    def timeout(self) -> float:
        """The default timeout of ``acquire`` (seconds; -1: for ever)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = float(value)

    @property
    def is_locked(self) -> bool:
        """Whether this object holds the lock."""
        return self._core.count > 0

    @property
    def lock_counter(self) -> int:
        """How many acquires are not released yet."""
        return self._core.count

    def acquire(self, timeout: float | None = None, poll_interval: float = 0.05, *,
                poll_intervall: float | None = None, blocking: bool = True
                ) -> _AcquireReturnProxy:
        """Takes the lock, waiting ``timeout`` seconds (None: the object's; -1 or below: for
        ever; 0, or ``blocking=False``: not at all). Raises keel.Timeout. ``poll_interval``
        is accepted for filelock's callers and not needed: keel does not poll."""
        del poll_interval
        if poll_intervall is not None:
            warnings.warn("use poll_interval instead of poll_intervall", DeprecationWarning,
                          stacklevel=2)
        if timeout is None:
            timeout = self._timeout
        if not blocking:
            timeout = 0
        if math.isnan(timeout):
            raise ValueError("timeout is NaN: give seconds, or -1 to wait for ever")
        self._core.acquire(float(timeout))
        return _AcquireReturnProxy(self)

    def release(self, force: bool = False) -> None:
        """Undoes one acquire (``force``: every one); the last lets the lock go."""
        self._core.release(force)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"keel.FileLock({self._lock_file!r}, locked={self.is_locked})"


# filelock's other names for the same lock (its SoftFileLock, a lock by a file's existence, is
# another kind and is not offered).
AcquireReturnProxy = _AcquireReturnProxy
BaseFileLock = FileLock
UnixFileLock = FileLock

__all__ = ["AcquireReturnProxy", "BaseFileLock", "FileLock", "Timeout", "UnixFileLock"]
