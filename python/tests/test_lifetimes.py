# SPDX-License-Identifier: Apache-2.0
"""What outlives what: a store closed under other threads' calls, transactions and views that
outlive their store or the interpreter, one transaction used by many threads, and threads still
inside keel when the process exits. Each case that could crash runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import keel


def run_python(code: str, tmp: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), tmp],
                          capture_output=True, text=True, timeout=300)


def test_close_while_other_threads_are_inside_calls(tmp):
    r = run_python("""
        import keel, os, sys, threading
        for rnd in range(3):
            s = keel.Store(os.path.join(sys.argv[1], f"s{rnd}"))
            started = threading.Barrier(4)
            def writer(n):
                started.wait()
                try:
                    for i in range(200):
                        s[b"%d-%d" % (n, i)] = b"x" * 200_000
                except ValueError:
                    pass  # closed: the next call says so
            ts = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
            for t in ts: t.start()
            started.wait()
            s.close()
            for t in ts: t.join()
        print("ok")
    """, tmp)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("case", ["txn", "view", "wrote_view", "iterator"])
def test_what_outlives_the_store_or_the_interpreter(tmp, case):
    r = run_python(f"""
        import keel, os, sys
        s = keel.Store(os.path.join(sys.argv[1], "s"))
        s[b"k"] = b"v"
        case = "{case}"
        t = s.transaction()
        if case == "view":
            v = t.view(b"k")
        if case == "wrote_view":
            t[b"x"] = b"1"
            v = t.view(b"k")
        if case == "iterator":
            it = s.items(); next(it)
        s.close()
        if case == "iterator":
            try:
                next(it)
            except ValueError:
                pass
        del t
        s2 = keel.Store(os.path.join(sys.argv[1], "s"))
        t2 = s2.transaction()
        t2.view(b"k")   # left open at exit, with a view
        print("ok")
    """, tmp)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_exit_while_daemon_threads_wait_inside_keel(tmp):
    r = run_python("""
        import keel, os, sys, threading
        d = sys.argv[1]
        holder = keel.Mutex(os.path.join(d, "m"))
        g = holder.lock(["a"])
        lock = keel.FileLock(os.path.join(d, "f.lock")); lock.acquire()
        s = keel.Store(os.path.join(d, "s"))
        def mutex_waiter():
            keel.Mutex(os.path.join(d, "m")).lock(["a"])
        def file_waiter():
            keel.FileLock(os.path.join(d, "f.lock")).acquire()
        def writer():
            while True:
                s[b"k"] = b"v" * 100_000
        for f in (mutex_waiter, file_waiter, writer):
            threading.Thread(target=f, daemon=True).start()
        print("ok")
    """, tmp)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_one_transaction_used_by_many_threads(tmp):
    s = keel.Store(os.path.join(tmp, "s"))
    s[b"k"] = b"0"
    t = s.transaction()
    stop = threading.Event()
    seen = []

    def viewer():
        while not stop.is_set():
            v = t.view(b"k")
            seen.append(bytes(v))
            del v

    def writer():
        for i in range(300):
            t[b"k"] = b"%d" % i * 1000

    a, b = threading.Thread(target=viewer), threading.Thread(target=writer)
    a.start()
    b.start()
    b.join()
    stop.set()
    a.join()
    # Every view was either the snapshot's value or one this transaction wrote, whole.
    valid = {b"0"} | {b"%d" % i * 1000 for i in range(300)}
    assert seen and all(x in valid for x in seen)
    del seen
    t.abort()


def test_a_guard_dropped_by_another_thread_is_let_go_by_its_own(tmp):
    m = keel.Mutex(os.path.join(tmp, "m"))
    box = [m.lock(["x"])]
    t = threading.Thread(target=box.clear)  # the last reference goes in another thread
    t.start()
    t.join()
    # This thread's next call unlocks it, and locks it again.
    with m.lock(["x"], timeout=0):
        pass


def test_a_timeout_of_years_waits(tmp):
    import multiprocessing as mp
    from conftest import wait_until
    ctx = mp.get_context("fork")
    path = os.path.join(tmp, "m")
    ready, go = ctx.Event(), ctx.Event()

    def hold():
        g = keel.Mutex(path, "byte_ranges").lock(["a"])
        ready.set()
        go.wait()
        g.release()

    p = ctx.Process(target=hold)
    p.start()
    assert ready.wait(60)
    outcome = []
    waiting = threading.Event()

    def wait_long():
        waiting.set()
        try:
            with keel.Mutex(path, "byte_ranges").lock(["a"], timeout=1e300):
                outcome.append("locked")
        except keel.Timeout:
            outcome.append("timed out")

    w = threading.Thread(target=wait_long)
    w.start()
    waiting.wait()
    # It waits: it has not given up by the time it shows as blocked in the kernel (byte_ranges
    # waits in F_OFD_SETLKW).
    wait_until(lambda: outcome or _kernel_waiters() >= 1, "the waiter to block")
    assert outcome == []
    go.set()
    w.join()
    p.join()
    assert outcome == ["locked"]


def _kernel_waiters():
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line)


def test_a_relative_path_is_reopened_where_it_was(tmp, monkeypatch):
    import pickle
    monkeypatch.chdir(tmp)
    s = keel.Store("rel.kv")
    s[b"a"] = b"1"
    os.mkdir("elsewhere")
    monkeypatch.chdir("elsewhere")
    again = pickle.loads(pickle.dumps(s))
    assert again[b"a"] == b"1" and os.path.isabs(again.path)
    s.close()
    with pytest.raises(ValueError):
        pickle.dumps(s)
