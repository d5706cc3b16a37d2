#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""keel's Python module beside what Python users have, in one run: keel.FileLock against
filelock and portalocker (lock+unlock per second, alone and with 4 processes contending),
and keel.Store against python-lmdb (1 KiB values: gets and puts on 1 thread, and puts from 4
processes at once). Each figure is the median of --rounds rounds, peers interleaved.

Usage: PYTHONPATH=build/release/python python3 python/bench/bench.py --dir DIR --json OUT
       [--quick]   (make bench runs it; a missing peer is reported as not measured)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import keel

try:
    import filelock
except ImportError:  # pragma: no cover - reported in the JSON
    filelock = None
try:
    import portalocker
except ImportError:  # pragma: no cover
    portalocker = None
try:
    import lmdb
except ImportError:  # pragma: no cover
    lmdb = None

ctx = mp.get_context("fork")
VALUE = os.urandom(1024)


def progress(msg: str) -> None:
    print(f"python bench: {msg}", file=sys.stderr, flush=True)


# ---- locks ----

def _lock_ops(kind: str, path: str):
    """acquire() and release() of one lock object of `kind` on `path`."""
    if kind == "keel":
        lock = keel.FileLock(path)
        return lock.acquire, lock.release
    if kind == "filelock":
        lock = filelock.FileLock(path)
        return lock.acquire, lock.release
    lock = portalocker.Lock(path, timeout=3600, fail_when_locked=False)
    return lock.acquire, lock.release


def lock_loop(kind: str, path: str, seconds: float) -> int:
    acquire, release = _lock_ops(kind, path)
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(50):
            acquire()
            release()
        n += 50
    return n


def busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _lock_worker(kind, path, seconds, outside, start, out):
    # Each holder works 20 us under the lock, then `outside`: "busy" works 20 us more (the
    # lock is wanted back to back), "sleep" sleeps 200 us (a process between two I/Os). What
    # counts is how soon a waiter gets a lock let go.
    acquire, release = _lock_ops(kind, path)
    start.wait()
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        acquire()
        busy(20)
        release()
        if outside == "busy":
            busy(20)
        else:
            time.sleep(200e-6)
        n += 1
    out.put(n)


def _waiter(kind, path, n, conn):
    acquire, release = _lock_ops(kind, path)
    for _ in range(n):
        conn.send("waiting")
        acquire()
        t1 = time.perf_counter()
        release()
        conn.send(t1)
        conn.recv()  # the holder has it again


def handoff_latency(kind: str, path: str, n: int) -> float:
    """The median time from a holder's release to the waiter holding the lock (seconds):
    the holder lets go 2 ms after the waiter said it is about to wait."""
    acquire, release = _lock_ops(kind, path)
    mine, theirs = ctx.Pipe()
    acquire()
    p = ctx.Process(target=_waiter, args=(kind, path, n, theirs))
    p.start()
    took = []
    for _ in range(n):
        mine.recv()
        time.sleep(0.002)
        t0 = time.perf_counter()
        release()
        took.append(mine.recv() - t0)
        acquire()
        mine.send("again")
    release()
    p.join()
    return statistics.median(took)


def run_together(target, argss: list[tuple]) -> list:
    """Runs target(*args, start, out) in a process per args, started at once; what each put."""
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args, start, out)) for args in argss]
    for p in ps:
        p.start()
    start.set()
    results = [out.get() for _ in ps]
    for p in ps:
        p.join()
    return results


def contended_lock_rate(kind: str, path: str, seconds: float, procs: int, outside: str) -> float:
    counts = run_together(_lock_worker, [(kind, path, seconds, outside)] * procs)
    return sum(counts) / seconds


# ---- stores ----

def keys(n: int, first: int = 0) -> list[bytes]:
    return [b"key-%010d" % i for i in range(first, first + n)]


def open_store(kind: str, path: str):
    if kind == "keel":
        return keel.Store(path)
    # LMDB with the durability keel's default has: a commit survives the process, not a power
    # cut (sync=False, metasync=False); lock=True, as several processes write.
    return lmdb.open(path, map_size=8 << 30, sync=False, metasync=False, max_dbs=0)


def put_all(kind: str, db, ks: list[bytes]) -> None:
    if kind == "keel":
        for k in ks:
            db[k] = VALUE
    else:
        for k in ks:
            with db.begin(write=True) as txn:
                txn.put(k, VALUE)


def get_all(kind: str, db, ks: list[bytes]) -> int:
    n = 0
    if kind == "keel":
        for k in ks:
            n += len(db[k])
    else:
        for k in ks:
            with db.begin() as txn:
                n += len(txn.get(k))
    return n


def _put_worker(kind, path, first, count, start, out):
    db = open_store(kind, path)
    ks = keys(count, first)
    start.wait()
    t0 = time.perf_counter()
    put_all(kind, db, ks)
    out.put(time.perf_counter() - t0)


def store_round(kind: str, base: str, n: int, procs: int) -> dict[str, float]:
    path = tempfile.mkdtemp(prefix=f"{kind}-", dir=base)
    try:
        db = open_store(kind, path)
        ks = keys(n)
        t0 = time.perf_counter()
        put_all(kind, db, ks)
        put_rate = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        get_all(kind, db, ks)
        get_rate = n / (time.perf_counter() - t0)
        # Several processes at once, each putting keys of its own, one commit per put.
        per = n // procs
        slowest = max(run_together(_put_worker,
                                   [(kind, path, n + i * per, per) for i in range(procs)]))
        db.close()
        return {"put": put_rate, "get": get_rate, "put_procs": per * procs / slowest}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def median_of(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the locks and stores go (default: $TMPDIR)")
    ap.add_argument("--json", required=True, help="results file")
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds, not minutes)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    seconds = 0.3 if args.quick else 1.0
    n = 5000 if args.quick else 20000
    procs = 4
    base = tempfile.mkdtemp(prefix="keel-pybench-", dir=args.dir)
    missing = {name: None for name, mod in
               (("filelock", filelock), ("portalocker", portalocker), ("lmdb", lmdb))
               if mod is None}
    results: dict = {"python": platform.python_version(), "keel": keel.__version__,
                     "rounds": rounds, "seconds": seconds, "keys": n, "processes": procs,
                     "value_bytes": len(VALUE), "missing_peers": sorted(missing),
                     "versions": {}, "locks": {}, "stores": {}}
    for name, mod in (("filelock", filelock), ("portalocker", portalocker), ("lmdb", lmdb)):
        if mod is not None:
            results["versions"][name] = getattr(mod, "__version__", "?")
    try:
        lock_kinds = ["keel"] + [k for k in ("filelock", "portalocker") if k not in missing]
        alone: dict[str, list[float]] = {k: [] for k in lock_kinds}
        busy_rates: dict[str, list[float]] = {k: [] for k in lock_kinds}
        sleep_rates: dict[str, list[float]] = {k: [] for k in lock_kinds}
        handoffs: dict[str, list[float]] = {k: [] for k in lock_kinds}
        for r in range(rounds):
            progress(f"locks, round {r + 1}/{rounds}: " + ", ".join(lock_kinds))
            for k in lock_kinds:
                path = os.path.join(base, f"{k}-alone.lock")
                alone[k].append(lock_loop(k, path, seconds) / seconds)
                path = os.path.join(base, f"{k}-contended.lock")
                busy_rates[k].append(contended_lock_rate(k, path, seconds, procs, "busy"))
                sleep_rates[k].append(contended_lock_rate(k, path, seconds, procs, "sleep"))
                handoffs[k].append(handoff_latency(k, path, 10 if args.quick else 20))
        for k in lock_kinds:
            results["locks"][k] = {"alone": statistics.median(alone[k]),
                                   "contended_busy": statistics.median(busy_rates[k]),
                                   "contended_sleep": statistics.median(sleep_rates[k]),
                                   "handoff_s": statistics.median(handoffs[k])}
        store_kinds = ["keel"] + (["lmdb"] if "lmdb" not in missing else [])
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in store_kinds}
        for r in range(rounds):
            progress(f"stores, round {r + 1}/{rounds}: {n} keys x 1 KiB, " + ", ".join(store_kinds))
            for k in store_kinds:
                runs[k].append(store_round(k, base, n, procs))
        for k in store_kinds:
            results["stores"][k] = {m: median_of(runs[k], m) for m in ("put", "get", "put_procs")}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    for k, v in results["locks"].items():
        progress(f"{k:12} lock+unlock/s alone {v['alone']:>9.0f}  contended, busy outside "
                 f"{v['contended_busy']:>7.0f}  sleeping outside {v['contended_sleep']:>7.0f}  "
                 f"handoff {v['handoff_s'] * 1e6:>8.0f} us")
    for k, v in results["stores"].items():
        progress(f"{k:12} put/s {v['put']:>9.0f}  get/s {v['get']:>9.0f}  "
                 f"put/s {procs} procs {v['put_procs']:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
