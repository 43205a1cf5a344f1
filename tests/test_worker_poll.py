"""A pool worker between queries (worker.worker_loop): it polls for its next query when the
one it ran was retrieved with nothing else pending and its queries usually follow each
other within its poll (linger.Gap); after a query of a saturated queue it sleeps."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import multiprocess
import orjson
import pytest

from queryqueue import MemoryQueueStore, SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.supervisor import loops
from queryqueue.supervisor import worker as worker_module
from queryqueue.supervisor.core.linger import Gap
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.settings import Settings
from tests.waiting import wait_until

APP = "tests.apps.pool_app:app"
PREFIX = "pool"  # the app's queue


@asynccontextmanager
async def _worker(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, poll_s: float
) -> AsyncIterator[tuple[SocketQueueDriver, Any, list[float]]]:
    """A server (no pool: the test hands off, as a pool would) and a worker loop run here,
    on the test's loop, given its jobs through a pipe. Each pass of its poll is recorded:
    until when it was to poll."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = SqliteQueueStore(workdir / "q.db")
    # Its polls: not recorded.
    server = QueueServer(store, workdir / "s.sock", settings=Settings(poll_s=0.0))
    await server.start()
    caller = SocketQueueDriver(server.socket_path)
    parent, child = multiprocess.Pipe()
    passes: list[float] = []
    real = loops.Polling._pass

    def recorded(polling: loops.Polling) -> None:
        passes.append(polling.until)
        real(polling)

    monkeypatch.setattr(loops.Polling, "_pass", recorded)
    # Its next always due within a minute: a poll ends when its hand-off arrives, or never
    # within the test (however slow the machine).
    monkeypatch.setattr(Gap, "poll_until", lambda gap, since, at_most: since + 60.0)
    worker = asyncio.ensure_future(
        worker_module.worker_loop(APP, str(server.socket_path), child, None, os.getppid(), poll_s)
    )
    try:
        yield caller, parent, passes
    finally:
        parent.send_bytes(b"")  # exit
        await asyncio.wait_for(worker, 30)
        parent.close()
        child.close()
        await caller.close()
        await server.stop()
        store.close()


async def _run(caller: SocketQueueDriver, conn: Any, key: str, pending: int) -> None:
    """Add `key`, retrieve it as the pool would (`pending` others left behind it), hand it
    to the worker, and wait for its result."""
    path = f"{PREFIX}:{key}"
    payload = orjson.dumps({"queryHandler": "sql", "query": {"key": key, "seconds": 0}}).decode()
    added = await caller.add_and_retrieve(path, payload, 1)
    assert added.payload is not None
    retrieved = RetrievedQuery(key, added.id, added.id, pending, orjson.loads(added.payload))
    conn.send_bytes(worker_module.job_message(retrieved))
    assert await caller.result_blocking(path, 30_000) is not None


async def test_a_worker_polls_for_its_next_query_only_after_one_of_an_unsaturated_queue(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _worker(workdir, monkeypatch, poll_s=60.0) as (caller, conn, passes):
        await _run(caller, conn, "first", pending=0)
        # Polling now, until a hand-off arrives.
        await wait_until(lambda: len(passes) > 2, what="the worker polling")
        await _run(caller, conn, "second", pending=3)
        polled = len(passes)
        assert passes[-1] == 0.0  # the hand-off's arrival ended it, not the minute
        # After a query retrieved with others pending, it sleeps: no pass while its next
        # (and that one's whole round trip) is on its way.
        await _run(caller, conn, "third", pending=2)
        assert len(passes) == polled


async def test_a_worker_never_polls_when_told_not_to(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _worker(workdir, monkeypatch, poll_s=0.0) as (caller, conn, passes):
        for key in ("first", "second", "third"):
            await _run(caller, conn, key, pending=0)
        assert passes == []


def test_a_hand_off_says_whether_the_worker_may_poll_after_it() -> None:
    def blob(pending: int) -> bytes:
        return worker_module.job_message(RetrievedQuery("k", 1, 1, pending, {}))

    assert blob(0)[:1] == worker_module.JOB_THEN_POLL
    assert blob(1)[:1] == blob(500)[:1] == worker_module.JOB


def test_the_pool_knows_its_queue_saturated_by_what_it_is_handed(workdir: Path) -> None:
    pool = WorkerPool(APP, workdir / "s.sock", MemoryQueueStore())
    seen = [pool.saturated]
    pool.submit(PREFIX, RetrievedQuery("a", 1, 1, 3, {}))  # 3 others left pending
    seen.append(pool.saturated)
    pool.submit(PREFIX, RetrievedQuery("b", 2, 2, 0, {}))
    seen.append(pool.saturated)
    assert seen == [False, True, False]
