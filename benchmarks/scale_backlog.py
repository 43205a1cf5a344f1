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
database, is a row of its own (`stats over the socket`). Every backlog is made first and
then measured in rounds, a slice of each point's samples in turn.
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
SOCKET_SAMPLES = 60
SOCKET_WARM = 40  # a round's unmeasured requests before its samples
ROUNDS = 6
CONCURRENCY = 2
FAST = "fast track (ADD, retrieve, ACK)"
OPERATIONS = ("add", FAST, "stats", "reconcile head")


def rows(points: list[int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
        dbs = [Path(tmp) / f"queue{pending}.db" for pending in points]
        stores = [SqliteQueueStore(db) for db in dbs]
        try:
            for store, pending in zip(stores, points, strict=True):
                _fill(store, pending)
            samples = _timed(stores)
        finally:
            for store in stores:
                store.close()
        for at, over_socket in enumerate(_socket_stats(dbs, Path(tmp))):
            samples[at]["stats over the socket"] = over_socket
    made: list[dict[str, Any]] = []
    firsts: dict[str, float] = {}
    for pending, timings in zip(points, samples, strict=True):
        for operation, taken in timings.items():
            row: dict[str, Any] = {
                "workload": "scale",
                "system": f"queryqueue: {operation}, {pending:,} pending",
                "n": len(taken),
                "repetitions": 1,
                "metric": "us (median)",
                **spread([statistics.median(taken)]),
                "settings": f"SQLite store in process, {pending:,} priority-0 items "
                f"pending on the queue, median of {len(taken)} in {ROUNDS} rounds",
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


def _timed(stores: list[SqliteQueueStore]) -> list[dict[str, list[float]]]:
    """Each store's samples, taken in rounds (a slice of every backlog in each): a drift
    in the machine's speed then reaches every point of the curve alike."""
    samples: list[dict[str, list[float]]] = [
        {operation: [] for operation in OPERATIONS} for _ in stores
    ]
    for round_ in range(ROUNDS):
        for store, taken in zip(stores, samples, strict=True):
            for n in range(round_ * SAMPLES // ROUNDS, (round_ + 1) * SAMPLES // ROUNDS):
                taken["add"].append(_us(partial(store.add, f"{PREFIX}:new{n}", "{}")))
                taken[FAST].append(_us(partial(_fast_track, store, f"urgent{n}")))
                taken["stats"].append(_us(store.describe))
                taken["reconcile head"].append(
                    _us(partial(store.pending, PREFIX, limit=CONCURRENCY))
                )
    return samples


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


def _socket_stats(dbs: list[Path], tmp: Path) -> list[list[float]]:
    """`stats` over a supervisor's socket, as `queryqueue status` asks it, its backlog in
    its database (no pool, so nothing drains it): a supervisor a backlog, asked in rounds."""
    supervisors = []
    try:
        for at, db in enumerate(dbs):
            supervisors.append(launch(db, tmp / f"s{at}.sock", cwd=REPO))
        return asyncio.run(_ask_stats([s.socket_path for s in supervisors]))
    finally:
        for supervisor in supervisors:
            supervisor.stop()


async def _ask_stats(socket_paths: list[Path]) -> list[list[float]]:
    from queryqueue.driver_socket.client import SocketQueueDriver

    drivers = [SocketQueueDriver(path) for path in socket_paths]
    samples: list[list[float]] = [[] for _ in drivers]
    try:
        for _ in range(ROUNDS):
            for driver, taken in zip(drivers, samples, strict=True):
                # Unmeasured first: a process woken from idle answers its first rapid
                # requests several times slower (the VM's CPU, not the supervisor).
                for _ in range(SOCKET_WARM):
                    await driver.stats()
                for _ in range(SOCKET_SAMPLES // ROUNDS):
                    started = time.perf_counter()
                    await driver.stats()
                    taken.append((time.perf_counter() - started) * 1e6)
        return samples
    finally:
        for driver in drivers:
            await driver.close()
