# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of keel's Python tests: they run against the module as built
(PYTHONPATH=build/<preset>/python, as ctest sets it)."""

from __future__ import annotations

import os
import sys
import time

import pytest

try:
    import keel  # noqa: F401
except ImportError as exc:  # pragma: no cover - reported as the reason
    pytest.exit(f"keel is not importable ({exc}): build it and set PYTHONPATH", returncode=77)


def waiters_on(path: str) -> int:
    """How many waiters /proc/locks shows blocked on a lock of the file at `path`."""
    ino = os.stat(path).st_ino
    n = 0
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and any(x.endswith(f":{ino}") for x in fields):
                n += 1
    return n


def wait_until(predicate, what: str, limit: float = 60.0) -> None:
    """Waits for a condition another process or thread brings about (a bound only against a
    hang: it is not a timing assumption)."""
    end = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting for {what} after {limit} s")
        time.sleep(0.001)


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)


sys.dont_write_bytecode = True
