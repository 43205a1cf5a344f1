"""What the hot path's tests share: a pool server on a store of the test's choosing, and
the SQL handler's query."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.loop_runner import LoopRunner
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer
from tests.trace import read_trace
from tests.waiting import wait_until


def record_batches(server: QueueServer, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The commands of each batch the server answers, as (method, first argument)."""
    batches: list[list[Any]] = []
    answer_batch = server.answers.answer_batch

    def recording(batch: list[Any], answers: list[Any], **options: Any) -> None:
        batches.append([(r.method, r.args[0] if r.args else None) for r in batch])
        answer_batch(batch, answers, **options)

    monkeypatch.setattr(server.answers, "answer_batch", recording)
    return batches


class Told:
    """A linger that waits as the test says: for every query on a worker whose
    ACK is not queued yet (`until` from now), or for `awaited` (ids) alone."""

    def __init__(self) -> None:
        self.until: float | None = None  # None: waits for nothing
        self.awaited: set[Any] | None = None

    def awaited_for(self, running: Any, coming: Any, now: float) -> tuple[set[Any], float]:
        if self.until is None:
            return set(), now
        awaited = self.awaited or {q for q, _ in running if q not in coming}
        return set(awaited), now + self.until


@contextlib.asynccontextmanager
async def told_lane(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str = "postgres",
    pool_of: tuple[str, int] | None = None,
) -> AsyncIterator[tuple[QueueServer, Told, SocketQueueDriver, list[list[Any]]]]:
    """A server with a pool of two workers (tests.apps.pool_app) whose batches linger as
    the test says (`Told`), recorded: on a PostgreSQL store, its lane's; on SQLite, the
    loop's turns."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    if kind == "postgres":
        from tests.postgres_util import postgres_store

        store: Any = postgres_store()
    else:
        store = SqliteQueueStore(workdir / "q.db")
    # The loop's turn lingers only while no worker is idle: there, one query fills the pool.
    app, workers = pool_of or (("app", 2) if kind == "postgres" else ("single", 1))
    pool = WorkerPool(f"tests.apps.pool_app:{app}", workdir / "s.sock", store, workers=workers)
    server = QueueServer(store, workdir / "s.sock", pool=pool)
    told = Told()
    monkeypatch.setattr(server.runner.linger, "awaited", told.awaited_for)
    await server.start()
    caller = SocketQueueDriver(server.socket_path)
    try:
        await pool.start()
        yield server, told, caller, record_batches(server, monkeypatch)
    finally:
        await caller.close()
        await pool.stop(grace=0)
        if not server.stopping:  # a test may have stopped it
            await server.stop()
        store.close()


def sql_query(key: str, seconds: float) -> str:
    query = {"key": key, "seconds": seconds}
    return orjson.dumps({"queryHandler": "sql", "query": query, "priority": 0}).decode()


async def started_keys(workdir: Path, queries: int) -> None:
    """Until that many queries started: a worker then says nothing more about its query
    until its ACK (the cancel handler it sets goes through the pool, not the socket)."""
    await wait_until(lambda: len([t for t in read_trace(workdir) if t[0] == "start"]) == queries)


def on_loop(server: QueueServer) -> LoopRunner:
    """The runner of a server whose store runs on the loop (SQLite, memory)."""
    assert isinstance(server.runner, LoopRunner)
    return server.runner
