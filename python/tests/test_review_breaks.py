# SPDX-License-Identifier: Apache-2.0
"""What the second review of the Python module broke, each as it was broken: descriptors a
forked child kept (and with them its dead parent's locks), a signal's exception inside an
acquire, guards of ended threads, a transaction used across fork, Store.pop."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import keel
from conftest import wait_until


def _descriptors_of(path: str) -> int:
    """How many of this process's descriptors are open on the file at `path`."""
    ino = os.stat(path).st_ino
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == ino:
                n += 1
        except OSError:
            pass  # closed meanwhile (another thread's), or the listing's own
    return n


def _fork_grandchild_and_die(take) -> tuple[int, int]:
    """Forks a holder that takes a lock (`take()`), forks a grandchild that lives until the
    returned pipe's write end closes, and is SIGKILLed; returns (grandchild pid, pipe end)."""
    life_r, life_w = os.pipe()
    told_r, told_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            take()
            grandchild = os.fork()
            if grandchild == 0:
                os.close(life_w)
                os.read(life_r, 1)
                os._exit(0)
            os.write(told_w, str(grandchild).encode())
            signal.pause()
        finally:
            os._exit(1)
    os.close(life_r)
    os.close(told_w)
    grandchild = int(os.read(told_r, 32))
    os.close(told_r)
    os.kill(holder, signal.SIGKILL)
    os.waitpid(holder, 0)
    return grandchild, life_w


def test_a_dead_holders_child_keeps_no_filelock(tmp):
    path = os.path.join(tmp, "f.lock")
    grandchild, life = _fork_grandchild_and_die(lambda: keel.FileLock(path).acquire())
    try:
        os.kill(grandchild, 0)  # still there
        keel.FileLock(path).acquire(timeout=30).lock.release()
    finally:
        os.close(life)


@pytest.mark.parametrize("algorithm", keel.Mutex.algorithms())
def test_a_dead_holders_child_keeps_no_mutex_lock(tmp, algorithm):
    path = os.path.join(tmp, "m")
    m = keel.Mutex(path, algorithm)
    kept = []
    grandchild, life = _fork_grandchild_and_die(lambda: kept.append(m.lock(["x"])))
    try:
        os.kill(grandchild, 0)
        with m.lock(["x"], timeout=30):
            pass
    finally:
        os.close(life)


def test_a_child_forked_while_a_thread_acquires_keeps_no_copy(tmp):
    # Threads take and let go of the lock while the main thread forks: no child may hold it
    # after its parent's release (a copy of the descriptor between the wait and the object).
    path = os.path.join(tmp, "w.lock")
    lock = keel.FileLock(path)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            with lock:
                pass

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                # The child's copy of the object holds nothing, whatever the moment, and the
                # child has no descriptor of the file (opened, waiting, held or let go).
                os._exit(0 if not lock.is_locked and _descriptors_of(path) == 0 else 3)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        t.join()
    keel.FileLock(path).acquire(timeout=0).lock.release()


@pytest.mark.parametrize("algorithm", keel.Mutex.algorithms())
def test_a_child_forked_while_a_thread_first_locks_keeps_none_of_it(tmp, algorithm):
    # A thread's first lock opens its own descriptors while the main thread forks: every child
    # stays alive, the holder is SIGKILLed, and the entity must be free (third review: a fork
    # between a descriptor's open and its state's registration kept it in the child).
    path = os.path.join(tmp, "m")
    keel.Mutex(path, algorithm)
    for _attempt in range(10):
        life_r, life_w = os.pipe()
        told_r, told_w = os.pipe()
        holder = os.fork()
        if holder == 0:
            try:
                os.close(told_r)
                m = keel.Mutex(path, algorithm)
                done = threading.Event()
                box = []
                t = threading.Thread(target=lambda: (box.append(m.lock(["x"])), done.set()))
                t.start()
                forks = 0
                while not done.is_set() and forks < 100:
                    if os.fork() == 0:
                        os.close(life_w)
                        os.read(life_r, 1)
                        os._exit(0)
                    forks += 1
                t.join()
                os.write(told_w, b"!")
                signal.pause()
            finally:
                os._exit(1)
        os.close(life_r)
        os.close(told_w)
        try:
            assert os.read(told_r, 1) == b"!"
            os.kill(holder, signal.SIGKILL)
            os.waitpid(holder, 0)
            with keel.Mutex(path, algorithm).lock(["x"], timeout=30):
                pass
        finally:
            os.close(told_r)
            os.close(life_w)


def test_a_new_thread_with_an_ended_ones_id_is_not_the_filelocks_holder(tmp):
    lock = keel.FileLock(os.path.join(tmp, "t.lock"))
    first = threading.Thread(target=lock.acquire)
    first.start()
    first.join()
    ident = first.ident
    for _ in range(100):  # a new thread, until one has the ended thread's id
        got = []
        t = threading.Thread(target=lambda: got.append((threading.get_ident(), _try_file(lock))))
        t.start()
        t.join()
        if got[0][0] == ident:
            break
    assert all(not took for _, took in got), "a new thread re-entered an ended thread's hold"
    assert lock.lock_counter == 1
    lock.release()
    assert not lock.is_locked


def _try_file(lock: keel.FileLock) -> bool:
    try:
        lock.acquire(timeout=0)
        return True
    except keel.Timeout:
        return False


class _Alarm(Exception):
    pass


def test_a_signals_exception_leaves_the_lock_whole(tmp):
    # SIGALRM's handler raises at any bytecode of acquire and release: afterwards the lock is
    # held exactly as its counter says, no descriptor is left behind, and others can take it.
    path = os.path.join(tmp, "s.lock")
    lock = keel.FileLock(path)
    lock.acquire()
    lock.release()  # (the file exists from here on)

    def ring(signum, frame):
        # Raised only where keel.FileLock's own code runs (a signal's handler runs in the frame
        # it interrupted): anywhere inside acquire, release, __enter__ and __exit__.
        if frame is not None and frame.f_code.co_filename.endswith("_filelock.py"):
            raise _Alarm

    old = signal.signal(signal.SIGALRM, ring)
    interrupted = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
        for _ in range(3000):
            try:
                with lock:
                    pass
            except _Alarm:
                interrupted += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    lock.release(force=True)  # a hold whose `with` never began (as with filelock)
    assert not lock.is_locked
    assert _descriptors_of(path) == 0
    keel.FileLock(path).acquire(timeout=0).lock.release()
    lock.acquire(timeout=0)
    lock.release()


def test_a_guard_of_an_ended_thread_is_not_held_and_not_let_go_by_a_new_one(tmp):
    m = keel.Mutex(os.path.join(tmp, "m"))
    guards = []
    t = threading.Thread(target=lambda: guards.append(m.lock(["x"])))
    t.start()
    t.join()
    g = guards.pop()
    # Its thread has ended (join returns before the thread's last step, which lets its
    # descriptors go: until then it still holds), and byte_ranges' locks with its descriptors.
    wait_until(lambda: not g.held, "the ended thread's guard to be let go")
    with pytest.raises(ValueError, match="ended"):
        g.release()
    del g
    # A new thread (perhaps with the ended one's id) takes x and keeps it: nothing another
    # thread dropped is let go as its.
    taken, probe, done = threading.Event(), threading.Event(), threading.Event()
    results = []

    def holder() -> None:
        h = m.lock(["x"])
        taken.set()
        probe.wait()
        m.lock(["y"]).release()  # a call that lets this thread's orphans go
        results.append(h.held)
        done.wait()
        h.release()

    other = threading.Thread(target=holder)
    other.start()
    taken.wait()
    probe.set()
    try:
        while not results:
            threading.Event().wait(0.001)
        assert results == [True]
        got = []
        prober = threading.Thread(target=lambda: got.append(_try(m, "x")))
        prober.start()
        prober.join()
        assert got == [False], "another thread got x while the new thread held it"
    finally:
        done.set()
        other.join()


def _try(m: keel.Mutex, name: str) -> bool:
    try:
        m.lock([name], timeout=0).release()
        return True
    except keel.Timeout:
        return False


def test_a_transaction_is_refused_in_a_forked_child(tmp):
    s = keel.Store(os.path.join(tmp, "s"))
    s[b"k"] = b"v"
    t = s.transaction()
    assert t[b"k"] == b"v"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            t[b"k"]
        except ValueError:
            code = 0
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    t.abort()
    s.close()


def test_store_pop_popitem_setdefault_clear_update(tmp):
    s = keel.Store(os.path.join(tmp, "s"))
    with pytest.raises(KeyError):
        s.pop(b"absent")
    assert s.pop(b"absent", None) is None
    s[b"a"] = b"1"
    assert s.pop(b"a") == b"1" and b"a" not in s
    assert s.setdefault(b"b", b"2") == b"2"
    assert s.setdefault(b"b", b"3") == b"2"
    s.update({b"c": b"3"})
    s.update([(b"d", b"4")])
    assert dict(s.items()) == {b"b": b"2", b"c": b"3", b"d": b"4"}
    k, v = s.popitem()
    assert k not in s and {k: v}.items() <= {b"b": b"2", b"c": b"3", b"d": b"4"}.items()
    s.clear()
    assert len(s) == 0
    with pytest.raises(KeyError):
        s.popitem()
    with pytest.raises(TypeError):
        s.update(x=b"1")
    s.close()
