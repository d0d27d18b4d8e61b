"""SQLite writes queue in arrival order in the API process (backend.db.FifoLock), instead of SQLite's busy
handler, whose growing sleeps left some of 20 concurrent metric writers waiting 30 times the median."""
from __future__ import annotations

import threading
import time

from backend.db import FifoLock, get_engine, write_lock


def test_waiters_get_the_lock_in_the_order_they_asked_for_it():
    lock, order = FifoLock(), []

    def take(i: int) -> None:
        with lock:
            order.append(i)

    with lock:
        threads = []
        for i in range(8):
            t = threading.Thread(target=take, args=(i,))
            t.start()
            deadline = time.monotonic() + 5
            while lock._next != i + 2 and time.monotonic() < deadline:  # queued behind the holder and i before
                time.sleep(0.001)
            threads.append(t)
        assert order == []
    for t in threads:
        t.join(timeout=5)
    assert order == list(range(8))


def test_only_sqlite_engines_have_a_write_lock(tmp_path):
    lite = get_engine(f"sqlite:///{tmp_path / 'a.sqlite'}")
    assert isinstance(write_lock(lite), FifoLock) and write_lock(lite) is write_lock(lite)
    pg = get_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    assert not isinstance(write_lock(pg), FifoLock)
