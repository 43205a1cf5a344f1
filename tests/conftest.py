from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import MemoryQueueStore, QueueStore, SqliteQueueStore
from queryqueue.driver_socket.segments import SHM_DIR
from queryqueue.engine.clock import ManualClock
from queryqueue.supervisor.server import QueueServer
from tests.postgres_util import drop_schema, fresh_schema, postgres_store, require_postgres
from tests.supervisor_util import socket_dir

StoreFactory = Callable[..., QueueStore]

STORE_KINDS = ["memory", "sqlite", "postgres"]


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A private directory short enough for a Unix socket path."""
    directory = socket_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def server(workdir: Path) -> AsyncIterator[QueueServer]:
    """A supervisor's server in this process, on a memory store, with no re-read grace;
    it must leave no shared-memory segment behind."""
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock")
    server.segments.reread_grace = 0.0
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
    assert list(SHM_DIR.glob(server.segments.prefix + "*")) == []


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=STORE_KINDS)
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> Iterator[StoreFactory]:
    """Builds stores of one kind (the parameter) on the shared manual clock."""
    made: list[QueueStore] = []

    def make(**options: Any) -> QueueStore:
        options.setdefault("clock", clock)
        store: QueueStore
        if request.param == "memory":
            store = MemoryQueueStore(**options)
        elif request.param == "postgres":
            store = postgres_store(**options)
        else:
            store = SqliteQueueStore(tmp_path / f"queue-{len(made)}.db", **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: StoreFactory) -> QueueStore:
    return make_store()


@pytest.fixture
def schema() -> Iterator[str]:
    """A fresh PostgreSQL schema, dropped afterwards (the test is skipped without a server)."""
    require_postgres()
    name = fresh_schema()
    yield name
    drop_schema(name)
