# SPDX-License-Identifier: Apache-2.0
"""keel's exceptions. Every error keel raises is a keel.Error (an OSError): it keeps the
errno (None for keel's own conditions, such as a conflict), the message and the file it is
about (``filename``) and, for damage, where in it (``offset``). An error with an errno is also
the OSError subclass Python maps that errno to: ``except FileNotFoundError`` and
``except PermissionError`` work as they do for open()."""

from __future__ import annotations

import errno as _errno


class Error(OSError):
    """An error of keel: ``errno`` (or None), ``strerror`` (the message, naming the file and
    offset when known), ``filename`` (or None) and ``offset`` (or None)."""

    offset: int | None = None

    def __str__(self) -> str:
        # keel's message already names the file and the offset.
        return self.strerror if self.strerror is not None else super().__str__()


class Conflict(Error):
    """Another transaction committed a key this one read or wrote since it began: nothing of
    this one was applied. Retry it."""


class Timeout(Error, TimeoutError):
    """A lock was not acquired before its timeout (or at once, when it may not wait). As
    ``filelock.Timeout``, it names the lock file in ``lock_file`` (and ``Timeout(lock_file)``
    makes one, as filelock's does)."""

    lock_file: str | None = None

    def __init__(self, *args: object) -> None:
        if len(args) == 1:  # filelock's form: Timeout(lock_file)
            lock_file = str(args[0])
            super().__init__(_errno.ETIMEDOUT,
                             f"The file lock '{lock_file}' could not be acquired.", lock_file)
            self.lock_file = lock_file
        else:
            super().__init__(*args)

    def __str__(self) -> str:
        if self.lock_file is not None:
            return f"The file lock '{self.lock_file}' could not be acquired."
        return super().__str__()


# keel.Error joined with the OSError subclass of an errno (FileNotFoundError, ...), made once.
_joined: dict[type, type] = {}


def _class_for(errnum: int | None) -> type:
    if errnum is None:
        return Error
    base = type(OSError(errnum, ""))
    if base is OSError:
        return Error
    cls = _joined.get(base)
    if cls is None:
        cls = type(base.__name__, (Error, base), {"__module__": "keel", "__doc__": base.__doc__})
        _joined[base] = cls
    return cls


def _make(kind: str, errnum: int | None, message: str, filename: str | None,
          offset: int | None) -> Error:
    """The exception for an error of the library (called by the extension)."""
    if kind == "conflict":
        cls: type = Conflict
    elif kind == "timeout":
        cls = Timeout
    else:
        cls = _class_for(errnum)
    # OSError(errno, strerror, filename) sets the three attributes.
    exc = cls(errnum, message, filename)
    exc.offset = offset
    if kind == "timeout":
        exc.lock_file = filename
    return exc
