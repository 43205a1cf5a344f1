"""The backlog curve: a queue's operations with 0, 100k and 1M items pending.

On the SQLite store in process, where nothing but the store is timed. The backlog is
priority-0 items on the measured prefix (one item active), added in batches; then, each
the median of many, in a store that keeps its backlog as it is:
- add: an ADD of a new priority-0 item (its own transaction);
- fast track: a priority-10 ADD, its retrieval past the backlog (the head of PENDING with
  a limit, as reconcile reads it, then RETRIEVE) and its ACK: a query with a free slot;
- stats: the store's `describe`, what `queryqueue status`, `/api/status` and `/metrics`
  read;
- reconcile head: PENDING with the queue's concurrency as its limit, what a Cube-style
  caller's reconcile reads.
The supervisor's own reading of `stats` over its socket, with that backlog in its
database, is a row of its own (`stats over the socket`).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.drive import REPO
from benchmarks.measure import spread
from benchmarks.ours import curve_row
from queryqueue.driver_sqlite.store import SqliteQueueStore
from queryqueue.supervisor.launch import launch

PREFIX = "bench"  # the benchmark app's: the supervisor's pool serves it
FILL_BATCH = 10_000
SAMPLES = 300
CONCURRENCY = 2


def rows(points: list[int]) -> list[dict[str, Any]]:
    made: list[dict[str, Any]] = []
    firsts: dict[str, float] = {}
    for pending in points:
        with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
            db = Path(tmp) / "queue.db"
            store = SqliteQueueStore(db)
            try:
                _fill(store, pending)
                timings = _timed(store)
            finally:
                store.close()
            timings["stats over the socket"] = _socket_stats(db, Path(tmp) / "s.sock")
        for operation, median_us in timings.items():
            row: dict[str, Any] = {
                "workload": "scale",
                "system": f"queryqueue: {operation}, {pending:,} pending",
                "n": SAMPLES,
                "repetitions": 1,
                "metric": "us (median)",
                **spread([median_us]),
                "settings": f"SQLite store in process, {pending:,} priority-0 items "
                f"pending on the queue, median of {SAMPLES}",
            }
            curve = f"backlog: {operation}"
            firsts[operation] = curve_row(row, curve, pending, firsts.get(operation))
            made.append(row)
    return made


def _fill(store: SqliteQueueStore, pending: int) -> None:
    def add(start: int, end: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(start, end):
                store.add(f"{PREFIX}:backlog{i}", "{}")

        return run

    for start in range(0, pending, FILL_BATCH):
        store.batched(add(start, min(pending, start + FILL_BATCH)), lambda _: None)
    store.add(f"{PREFIX}:running", "{}")
    store.retrieve(f"{PREFIX}:running", concurrency=CONCURRENCY)


def _timed(store: SqliteQueueStore) -> dict[str, float]:
    adds, fast, described, heads = [], [], [], []
    for i in range(SAMPLES):
        adds.append(_us(partial(store.add, f"{PREFIX}:new{i}", "{}")))
        fast.append(_us(partial(_fast_track, store, f"urgent{i}")))
        described.append(_us(store.describe))
        heads.append(_us(partial(store.pending, PREFIX, limit=CONCURRENCY)))
    return {
        "add": statistics.median(adds),
        "fast track (ADD, retrieve, ACK)": statistics.median(fast),
        "stats": statistics.median(described),
        "reconcile head": statistics.median(heads),
    }


def _fast_track(store: SqliteQueueStore, key: str) -> None:
    store.add(f"{PREFIX}:{key}", "{}", priority=10)
    head = store.pending(PREFIX, limit=CONCURRENCY)[0].id
    if head != key:
        raise AssertionError(f"{head} came before the priority-10 item")
    store.retrieve(f"{PREFIX}:{head}", concurrency=CONCURRENCY)
    store.ack(f"{PREFIX}:{head}", "1")


def _us(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e6


def _socket_stats(db: Path, socket_path: Path) -> float:
    """`stats` over a supervisor's socket, as `queryqueue status` asks it, its backlog
    in its database (no pool, so nothing drains it)."""
    supervisor = launch(db, socket_path, cwd=REPO)
    try:
        return asyncio.run(_ask_stats(socket_path))
    finally:
        supervisor.stop()


async def _ask_stats(socket_path: Path) -> float:
    from queryqueue.driver_socket.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path)
    try:
        await driver.stats()
        samples = []
        for _ in range(50):
            started = time.perf_counter()
            await driver.stats()
            samples.append((time.perf_counter() - started) * 1e6)
        return statistics.median(samples)
    finally:
        await driver.close()
