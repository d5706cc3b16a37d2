# SPDX-License-Identifier: Apache-2.0
"""keel.Store as a mapping shared by threads and processes, its transactions, views, and
errors."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import pickle
import threading
from collections.abc import MutableMapping

import pytest

import keel
from conftest import wait_until


@pytest.fixture
def store(tmp):
    with keel.Store(os.path.join(tmp, "s")) as s:
        yield s


def test_a_mapping_of_bytes(store):
    assert isinstance(store, MutableMapping)
    store[b"a"] = b"1"
    store[bytearray(b"b")] = memoryview(b"22")
    assert store[b"a"] == b"1" and store[b"b"] == b"22"
    assert b"a" in store and b"zz" not in store
    assert store.get(b"zz") is None and store.get(b"zz", b"d") == b"d"
    assert len(store) == 2
    assert sorted(store) == [b"a", b"b"]
    assert sorted(store.keys()) == [b"a", b"b"]
    assert sorted(store.values()) == [b"1", b"22"]
    assert dict(store.items()) == {b"a": b"1", b"b": b"22"}
    assert store == {b"a": b"1", b"b": b"22"}
    del store[b"a"]
    with pytest.raises(KeyError):
        store[b"a"]
    with pytest.raises(KeyError):
        del store[b"a"]
    assert store.pop(b"b") == b"22" and len(store) == 0
    assert store.setdefault(b"c", b"3") == b"3"
    store.update({b"d": b"4"}, e=b"5") if False else store.update({b"d": b"4"})
    store[b"empty"] = b""
    assert store[b"empty"] == b""
    assert dict(store.items()) == {b"c": b"3", b"d": b"4", b"empty": b""}


def test_str_is_refused_and_bad_keys_are_named(store):
    with pytest.raises(TypeError):
        store["a"] = b"1"
    with pytest.raises(TypeError):
        store[b"a"] = "1"
    # A key the store cannot hold is a ValueError saying the limit, and absent when read.
    with pytest.raises(ValueError, match="1 to 1024 bytes"):
        store[b""] = b"x"
    with pytest.raises(ValueError, match="1 to 1024 bytes"):
        store[b"k" * 2000] = b"x"
    assert b"" not in store and store.get(b"k" * 2000) is None
    with pytest.raises(KeyError):
        del store[b""]


def test_transactions_commit_whole_or_not_at_all(store):
    with store.transaction() as t:
        t[b"x"] = b"1"
        t[b"y"] = b"2"
        assert t[b"x"] == b"1"
        assert b"x" not in store  # not before the commit
    assert store[b"x"] == b"1" and store[b"y"] == b"2"
    with pytest.raises(RuntimeError):
        with store.transaction() as t:
            t[b"x"] = b"changed"
            del t[b"y"]
            raise RuntimeError("the block failed")
    assert store[b"x"] == b"1" and store[b"y"] == b"2"  # aborted: nothing applied
    t = store.transaction()
    t.abort()
    assert not t.active
    with pytest.raises(ValueError):
        t[b"x"]


def test_a_conflict_is_raised_and_nothing_of_it_applied(store):
    store[b"n"] = b"0"
    a = store.transaction()
    b = store.transaction()
    a[b"n"] = a[b"n"] + b"a"
    b[b"n"] = b[b"n"] + b"b"
    b[b"other"] = b"b"
    a.commit()
    with pytest.raises(keel.Conflict) as info:
        b.commit()
    assert isinstance(info.value, keel.Error) and info.value.errno is None
    assert store[b"n"] == b"0a" and b"other" not in store


def test_views_without_a_copy(tmp):
    store = keel.Store(os.path.join(tmp, "s"), lock_timeout=0.2)
    store[b"v"] = b"value" * 100
    with store.transaction() as t:
        v = t.view(b"v")
        assert v.readonly and bytes(v) == b"value" * 100
    # A transaction that only read keeps its snapshot for the view that outlives it:
    # compaction waits for it as for any open transaction (here for lock_timeout, in vain).
    for i in range(50):
        store[b"v"] = b"x%d" % i
    with pytest.raises(TimeoutError):
        store.compact()
    assert bytes(v[:5]) == b"value"
    v.release()
    store.compact()  # the view gone, so is its snapshot
    # Its own write is a copy: valid whatever it writes next.
    with store.transaction() as t:
        t[b"w"] = b"mine"
        w = t.view(b"w")
        t[b"w"] = b"again"
        assert bytes(w) == b"mine"
        del w
    # One that wrote may not commit while a view of its snapshot lives.
    t = store.transaction()
    t[b"z"] = b"1"
    held = t.view(b"v")
    with pytest.raises(BufferError):
        t.commit()
    held.release()
    del held
    t.commit()
    assert store[b"z"] == b"1"
    with pytest.raises(KeyError):
        with store.transaction() as t:
            t.view(b"absent")


def test_iteration_of_a_transaction_reads_its_snapshot(store):
    for i in range(600):
        store[b"k%d" % i] = b"%d" % i
    with store.transaction() as t:
        it = t.items()
        first = next(it)
        for i in range(600, 700):
            store[b"k%d" % i] = b"late"
        rest = list(it)
    assert len(rest) + 1 == 600
    assert all(v != b"late" for _, v in [first, *rest])


def test_threads_share_a_store(store):
    def writer(n):
        for i in range(300):
            store[b"t%d-%d" % (n, i)] = b"%d" % i

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 1200
    assert store[b"t3-299"] == b"299"


def _count_up(path, key, times):
    s = keel.Store(path)
    for _ in range(times):
        while True:
            try:
                with s.transaction() as t:
                    t[key] = b"%d" % (int(t.get(key, b"0")) + 1)
                break
            except keel.Conflict:
                continue


def test_processes_share_a_store_with_no_lost_update(tmp):
    path = os.path.join(tmp, "s")
    keel.Store(path).close()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_count_up, args=(path, b"counter", 200)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert keel.Store(path)[b"counter"] == b"800"


def _put_through(s, key):
    s[key] = b"from the child"


def test_a_forked_or_spawned_child_uses_the_parents_store(store):
    for method in ("fork", "spawn"):
        p = mp.get_context(method).Process(target=_put_through, args=(store, method.encode()))
        p.start()
        p.join()
        assert p.exitcode == 0, method
        assert store[method.encode()] == b"from the child"
    pid = os.fork()
    if pid == 0:
        try:
            store[b"os.fork"] = b"yes"
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert store[b"os.fork"] == b"yes"
    again = pickle.loads(pickle.dumps(store))
    assert again[b"spawn"] == b"from the child"


def test_errors_keep_errno_and_file(tmp):
    missing = os.path.join(tmp, "missing")
    with pytest.raises(FileNotFoundError) as info:
        keel.Store(missing, create_if_missing=False)
    assert isinstance(info.value, keel.Error) and info.value.filename == missing
    path = os.path.join(tmp, "s")
    keel.Store(path).close()
    with pytest.raises(FileExistsError):
        keel.Store(path, error_if_exists=True)
    ro = keel.Store(path, read_only=True)
    with pytest.raises(keel.Error) as info:
        ro[b"a"] = b"1"
    assert info.value.errno == errno.EROFS
    with pytest.raises(TypeError):
        keel.Store(path, no_such_option=1)
    foreign = os.path.join(tmp, "foreign")
    os.mkdir(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(keel.Error):
        keel.Store(foreign)
    assert open(os.path.join(foreign, "notes.txt")).read() == "mine"
    s = keel.Store(path)
    s.close()
    with pytest.raises(ValueError):
        s[b"a"]


def test_damage_is_an_error_naming_the_file_never_wrong_data(tmp):
    path = os.path.join(tmp, "s")
    s = keel.Store(path)
    marker = b"0123456789abcdef" * 8
    s[b"k"] = marker
    hit = None
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                data = f.read()
            at = data.find(marker)
            if at >= 0 and os.path.basename(root) == "seg":
                hit = (p, at)
    assert hit is not None
    with open(hit[0], "r+b") as f:
        f.seek(hit[1] + 5)
        f.write(b"X")
    with pytest.raises(keel.Error) as info:
        s[b"k"]
    assert info.value.errno == errno.EBADMSG
    assert info.value.filename == hit[0]
    report = s.verify()
    assert report["damaged"]


def test_stats_backup_and_compact(store, tmp):
    for i in range(100):
        store[b"%d" % i] = b"x" * 100
    st = store.stats()
    assert st["records"] == 100 and any(u["self"] for u in st["users"])
    copy = os.path.join(tmp, "copy")
    assert store.backup(copy)["keys"] == 100
    assert len(keel.Store(copy)) == 100
    assert "segments_removed" in store.compact()


def test_a_wait_inside_the_store_leaves_the_gil(tmp):
    # compact() waits for the transactions open in any thread: here for one this thread holds
    # and can end only if the waiting thread let go of the GIL (else compact times out).
    s = keel.Store(os.path.join(tmp, "s"), lock_timeout=60)
    for i in range(20):
        s[b"k"] = b"%d" % i
    t = s.transaction()
    t.get(b"k")
    outcome = []
    started = threading.Event()

    def compact():
        started.set()
        try:
            outcome.append(s.compact())
        except keel.Error as e:
            outcome.append(e)

    th = threading.Thread(target=compact)
    th.start()
    started.wait()
    wait_until(lambda: _sleeping(th.native_id), "the compaction to wait")
    t.abort()
    th.join()
    assert len(outcome) == 1 and isinstance(outcome[0], dict), outcome


def _sleeping(tid):
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"
