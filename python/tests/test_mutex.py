# SPDX-License-Identifier: Apache-2.0
"""keel.Mutex: sets of entities, shared or exclusive, with timeouts, across processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

import keel

ctx = mp.get_context("fork")


def _hold(path, algorithm, names, shared, ready, go):
    g = keel.Mutex(path, algorithm).lock(names, shared=shared)
    ready.set()
    go.wait()
    g.release()


@pytest.mark.parametrize("algorithm", ["byte_ranges", "lock_files", "flock"])
def test_sets_exclude_where_they_overlap(tmp, algorithm):
    path = os.path.join(tmp, "m")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(path, algorithm, ["a", b"b", 7], False, ready, go))
    p.start()
    try:
        assert ready.wait(60)
        m = keel.Mutex(path, algorithm)
        assert m.algorithm == algorithm
        with m.lock(["c", "d"], timeout=0) as g:  # disjoint: granted
            assert g.held and len(g) == 2
        for overlapping in (["c", "a"], [b"b"], [7]):
            with pytest.raises(keel.Timeout):
                m.lock(overlapping, timeout=0)
        with pytest.raises(keel.Timeout):
            m.lock(["a"], timeout=0.05)
    finally:
        go.set()
        p.join()
    assert p.exitcode == 0
    with keel.Mutex(path, algorithm).lock(["a", "b"], timeout=0):
        pass


def test_shared_holders_share(tmp):
    path = os.path.join(tmp, "m")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(path, "byte_ranges", ["r"], True, ready, go))
    p.start()
    try:
        assert ready.wait(60)
        m = keel.Mutex(path)
        m.lock(["r"], shared=True, timeout=0).release()
        with pytest.raises(keel.Timeout):
            m.lock(["r"], timeout=0)
    finally:
        go.set()
        p.join()


def test_a_lock_is_released_by_its_own_thread(tmp):
    m = keel.Mutex(os.path.join(tmp, "m"))
    g = m.lock(["x"])
    errors = []

    def other():
        try:
            g.release()
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and g.held
    g.release()
    assert not g.held
    with pytest.raises(ValueError):
        g.release()


def test_bad_input_is_named(tmp):
    with pytest.raises(keel.Error):
        keel.Mutex(os.path.join(tmp, "m"), "no_such_algorithm")
    m = keel.Mutex(os.path.join(tmp, "m2"))
    with pytest.raises(TypeError):
        m.lock([1.5])
    with pytest.raises(ValueError):
        m.lock([-1])
    assert "byte_ranges" in keel.Mutex.algorithms()


def test_a_single_name_is_not_a_list_of_its_characters(tmp):
    m = keel.Mutex(os.path.join(tmp, "m"))
    with pytest.raises(TypeError, match="list of names"):
        m.lock("job-1")
    with pytest.raises(TypeError):
        m.lock(b"job-1")
    with pytest.raises(ValueError):
        m.lock([2**64])
