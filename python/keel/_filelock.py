# SPDX-License-Identifier: Apache-2.0
"""keel.FileLock: a drop-in for ``filelock.FileLock``, on keel's flock(2) with deadlines."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref
from types import TracebackType

from . import _keel
from ._errors import Timeout, timeout as _timeout


class _AcquireReturnProxy:
    """What ``acquire`` returns: a context manager that releases the lock (as filelock's)."""

    def __init__(self, lock: FileLock) -> None:
        self.lock = lock

    def __enter__(self) -> FileLock:
        return self.lock

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.lock.release()


# Every FileLock, so that a forked child starts with none held and no descriptor of its
# parent's (a descriptor inherited shares the parent's open file description, and its lock).
_every_lock: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_every_lock):
        lock._forget_parents()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    removed or replaced ends holding the file the path names; and a holder that dies, even
    by SIGKILL, lets it go at once.
    """

    def __init__(self, lock_file: str | os.PathLike[str], timeout: float = -1) -> None:
        self._lock_file = os.fspath(lock_file)
        self._timeout = float(timeout)
        self._state = threading.Lock()  # guards the four below
        self._owner: int | None = None  # the thread holding it
        self._count = 0
        # The lock file's descriptor while this object holds it (opened at each acquire and
        # closed at the release, as filelock does: an object kept idle holds no descriptor).
        self._fd = -1
        # Held by the thread that holds the file lock through this object: others queue here.
        self._turn = threading.Lock()
        _every_lock.add(self)

    def _forget_parents(self) -> None:
        # In a forked child: the parent's hold is not the child's, and its descriptor is
        # closed without unlocking (that would unlock the parent's). (A descriptor of a wait
        # under way in another thread of the parent is closed by the extension.)
        self._state = threading.Lock()
        self._turn = threading.Lock()
        self._owner, self._count = None, 0
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

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
        return self._count > 0

    @property
    def lock_counter(self) -> int:
        """How many acquires are not released yet."""
        return self._count

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
        if timeout > threading.TIMEOUT_MAX:
            timeout = -1  # longer than any wait can be: for ever
        me = threading.get_ident()
        if self._owner == me:  # only this thread sets or clears its own ownership
            self._count += 1
            return _AcquireReturnProxy(self)
        if timeout < 0:
            got_turn = self._turn.acquire()
            left = -1.0
        elif timeout == 0:
            got_turn = self._turn.acquire(blocking=False)
            left = 0.0
        else:
            start = time.monotonic()
            got_turn = self._turn.acquire(timeout=timeout)
            left = timeout - (time.monotonic() - start)
            if got_turn and left <= 0:
                self._turn.release()
                got_turn = False
        if not got_turn:
            raise _timeout(self._lock_file)
        try:
            self._fd = _keel.flock_acquire(self._lock_file, True, left)
        except BaseException:
            self._turn.release()
            raise
        self._owner, self._count = me, 1
        return _AcquireReturnProxy(self)

    def release(self, force: bool = False) -> None:
        """Undoes one acquire (``force``: every one); the last lets the lock go."""
        with self._state:
            if self._count == 0:
                return
            self._count = 0 if force else self._count - 1
            if self._count > 0:
                return
            self._owner = None
            fd, self._fd = self._fd, -1
        try:
            _keel.flock_release(fd)
        finally:
            self._turn.release()

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release(force=True)
        except Exception:  # noqa: BLE001 - nothing to raise to at collection
            pass

    def __repr__(self) -> str:
        return f"keel.FileLock({self._lock_file!r}, locked={self.is_locked})"


# filelock's other names for the same lock (its SoftFileLock, a lock by a file's existence, is
# another kind and is not offered).
AcquireReturnProxy = _AcquireReturnProxy
BaseFileLock = FileLock
UnixFileLock = FileLock

__all__ = ["AcquireReturnProxy", "BaseFileLock", "FileLock", "Timeout", "UnixFileLock"]
