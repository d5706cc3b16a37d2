# SPDX-License-Identifier: Apache-2.0
"""keel.FileLock as a drop-in for filelock.FileLock, and beside filelock and portalocker."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest

import keel
from conftest import waiters_on, wait_until

filelock = pytest.importorskip("filelock")
portalocker = pytest.importorskip("portalocker")

ctx = mp.get_context("fork")


def _hold_with(kind: str, path: str, ready, go) -> None:
    if kind == "filelock":
        lock = filelock.FileLock(path)
        lock.acquire()
    elif kind == "portalocker":
        f = open(path, "a")
        portalocker.lock(f, portalocker.LOCK_EX)
    else:
        lock = keel.FileLock(path)
        lock.acquire()
    ready.set()
    go.wait()


def test_acquire_release_and_reentrance(tmp):
    lock = keel.FileLock(os.path.join(tmp, "a.lock"))
    assert not lock.is_locked
    with lock:
        assert lock.is_locked
        with lock.acquire():
            assert lock.lock_counter == 2
        assert lock.is_locked
    assert not lock.is_locked
    assert os.path.exists(lock.lock_file)  # left in place, as filelock leaves it


@pytest.mark.parametrize("other", ["filelock", "portalocker"])
def test_excludes_and_is_excluded_by_the_python_locks(tmp, other):
    path = os.path.join(tmp, "shared.lock")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_with, args=(other, path, ready, go))
    p.start()
    try:
        assert ready.wait(60)
        with pytest.raises(keel.Timeout) as info:
            keel.FileLock(path).acquire(timeout=0)
        assert isinstance(info.value, TimeoutError)
        assert info.value.lock_file == path
    finally:
        go.set()
        p.join()
    # And the other way: keel holds, the Python lock is kept out.
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_with, args=("keel", path, ready, go))
    p.start()
    try:
        assert ready.wait(60)
        if other == "filelock":
            with pytest.raises(filelock.Timeout):
                filelock.FileLock(path).acquire(timeout=0)
        else:
            with open(path, "a") as f, pytest.raises(portalocker.LockException):
                portalocker.lock(f, portalocker.LOCK_EX | portalocker.LOCK_NB)
    finally:
        go.set()
        p.join()
    assert p.exitcode == 0


def test_timeouts_and_blocking_false(tmp):
    path = os.path.join(tmp, "t.lock")
    holder = keel.FileLock(path)
    holder.acquire()
    other = keel.FileLock(path, timeout=0.05)
    with pytest.raises(keel.Timeout):
        other.acquire()
    with pytest.raises(keel.Timeout):
        other.acquire(blocking=False)
    with pytest.raises(TimeoutError):
        other.acquire(timeout=0.01)
    assert not other.is_locked
    holder.release()
    with other.acquire(timeout=0):
        assert other.is_locked


def test_another_thread_using_the_same_object_waits_for_the_holder(tmp):
    lock = keel.FileLock(os.path.join(tmp, "th.lock"))
    lock.acquire()
    outcome = []

    def other():
        try:
            lock.acquire(timeout=0.05)
            outcome.append("acquired")
            lock.release()
        except keel.Timeout:
            outcome.append("timeout")

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert outcome == ["timeout"]
    lock.release()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert outcome == ["timeout", "acquired"]


def test_a_killed_holder_lets_the_waiter_in_and_the_wait_leaves_the_gil(tmp):
    path = os.path.join(tmp, "k.lock")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_with, args=("keel", path, ready, go))
    p.start()
    assert ready.wait(60)
    got = []
    waiter = threading.Thread(target=lambda: got.append(keel.FileLock(path).acquire()))
    waiter.start()
    # This thread runs on while the waiter sleeps in the kernel: the wait left the GIL.
    wait_until(lambda: waiters_on(path) >= 1, "the waiter to block in flock")
    os.kill(p.pid, signal.SIGKILL)
    waiter.join()
    p.join()
    assert p.exitcode == -signal.SIGKILL
    assert len(got) == 1 and got[0].lock.is_locked
    got[0].lock.release()


def test_ctrl_c_ends_a_wait_for_ever(tmp):
    path = os.path.join(tmp, "c.lock")
    holder = keel.FileLock(path)
    holder.acquire()

    def interrupt():
        wait_until(lambda: waiters_on(path) >= 1, "the main thread to wait")
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, whatever this run inherited (a shell's background job ignores
    # SIGINT, and Python then leaves it ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t = threading.Thread(target=interrupt)
        t.start()
        with pytest.raises(KeyboardInterrupt):
            keel.FileLock(path).acquire()
        t.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    holder.release()


def test_errors_keep_the_errno_and_the_file(tmp):
    path = os.path.join(tmp, "no", "such", "dir", "x.lock")
    with pytest.raises(FileNotFoundError) as info:
        keel.FileLock(path).acquire(timeout=0)
    assert isinstance(info.value, keel.Error)
    assert info.value.filename == path


def test_a_forked_child_holds_none_of_its_parents_locks(tmp):
    # The child's copy of a lock object shares nothing with the parent's hold: it is not
    # locked there, it is kept out while the parent holds, and its release frees nothing.
    lock = keel.FileLock(os.path.join(tmp, "f.lock"))
    lock.acquire()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            lock.release()  # not the child's to release
            if not lock.is_locked:
                try:
                    lock.acquire(timeout=0)
                except keel.Timeout:
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lock.is_locked
    with pytest.raises(filelock.Timeout):
        filelock.FileLock(lock.lock_file).acquire(timeout=0)
    lock.release()


def test_filelocks_names_and_timeouts(tmp):
    assert keel.UnixFileLock is keel.FileLock and keel.BaseFileLock is keel.FileLock
    e = keel.Timeout("x.lock")
    assert e.lock_file == "x.lock" and isinstance(e, TimeoutError) and "x.lock" in str(e)
    lock = keel.FileLock(os.path.join(tmp, "n.lock"))
    with pytest.raises(ValueError):
        lock.acquire(timeout=float("nan"))
    with lock.acquire(timeout=float("inf")) as same:  # for ever, as filelock
        assert same is lock
    with pytest.warns(DeprecationWarning):
        lock.acquire(poll_intervall=0.1)
    lock.release()
    with pytest.raises(ValueError):
        keel.FileLock(os.path.join(tmp, "a\0b")).acquire()
