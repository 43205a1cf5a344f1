from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import MemoryQueueStore, QueueStore, SqliteQueueStore
from queryqueue.engine.clock import ManualClock
from tests.postgres_util import postgres_store
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
