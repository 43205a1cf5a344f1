"""A queue server in the test's own process with a worker pool (tests.apps.pool_app) on
the store the test gives it, and a pool queue talking to it over its socket."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.engine.errors import ContinueWaitError
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer

POOL_APP = "tests.apps.pool_app:app"


@contextlib.asynccontextmanager
async def pool_server(
    store: QueueStore,
    workdir: Path,
    *,
    workers: int = 1,
    app_ref: str = POOL_APP,
    pool_options: dict[str, Any] | None = None,
    stop_grace: float = 0,
    **server_options: Any,
) -> AsyncIterator[tuple[QueueServer, WorkerPool, Any]]:
    """(server, its pool, a pool queue on it); the queue's driver is `queue.driver`. All
    of it is stopped afterwards (the workers by their pool, by pid), and `store` closed."""
    from queryqueue.app import load_app

    app = load_app(app_ref)
    pool = WorkerPool(app_ref, workdir / "s.sock", store, workers=workers, **(pool_options or {}))
    server = QueueServer(store, workdir / "s.sock", pool=pool, **server_options)
    await server.start()
    driver = SocketQueueDriver(server.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=30.0)
    try:
        await pool.start()
        yield server, pool, queue
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        await pool.stop(grace=stop_grace)
        await server.stop()
        store.close()


async def ask(
    queue: Any, handler: str, key: str, query: Any, priority: int = 0, within: float = 90
) -> Any:
    """execute_in_queue, asking again after each continue-wait, for up to `within` s."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await queue.execute_in_queue(handler, key, query, priority)
        except ContinueWaitError:
            assert time.monotonic() < deadline, f"no result for {key}"
