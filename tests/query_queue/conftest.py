"""The queues every QueryQueue test runs on: in memory, on SQLite, and through a supervisor
(one per test package and xdist worker, stopped by its pid)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import (
    LocalQueueDriver,
    MemoryQueueStore,
    QueryQueue,
    QueueDriver,
    QueueStore,
    SocketQueueDriver,
    SqliteQueueStore,
)
from tests.query_queue.helpers import PREFIX, MakeQueue, Recorder
from tests.supervisor_util import SupervisorProcess, socket_dir, start_supervisor


@pytest.fixture(scope="package")
def supervisor() -> Iterator[SupervisorProcess]:
    """One supervisor process per test package (and xdist worker); stopped by its pid."""
    directory = socket_dir()
    process = start_supervisor(directory / "queue.db", directory / "s.sock")
    try:
        yield process
    finally:
        assert process.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["memory", "sqlite", "supervisor"])
async def shared_driver(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[QueueDriver]:
    """Every test runs on an in-memory store, a SQLite store, and through a supervisor."""
    if request.param == "supervisor":
        process: SupervisorProcess = request.getfixturevalue("supervisor")
        remote = SocketQueueDriver(process.socket_path, reconnect_timeout=10)
        await remote.truncate()
        yield remote
        await remote.close()
        return
    store: QueueStore = (
        MemoryQueueStore() if request.param == "memory" else SqliteQueueStore(tmp_path / "q.db")
    )
    yield LocalQueueDriver(store)
    store.close()


@pytest.fixture
async def make_queue(shared_driver: QueueDriver) -> AsyncIterator[MakeQueue]:
    made: list[QueryQueue] = []

    def make(**options: Any) -> QueryQueue:
        options.setdefault("query_handlers", {})
        options.setdefault("continue_wait_timeout", 5.0)
        # Long enough that a loaded CI machine never lets a live query look stalled; tests
        # about stalling set a short one.
        options.setdefault("heartbeat_interval", 1.0)
        queue = QueryQueue(PREFIX, driver=shared_driver, **options)
        made.append(queue)
        return queue

    yield make
    for queue in made:
        await queue.shutdown(grace=0)  # stop whatever a test left running, at once


@pytest.fixture
def rec() -> Recorder:
    return Recorder()
