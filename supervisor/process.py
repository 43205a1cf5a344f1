"""Running the supervisor: the store, the server, the worker pool, signals, a clean exit."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from queryqueue.driver_sqlite.store import SqliteQueueStore, Synchronous
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer


def open_store(db: str | Path, *, synchronous: Synchronous, schema: str) -> QueueStore:
    """A SQLite file, or a postgresql:// URL (a queue several hosts share)."""
    if isinstance(db, str) and db.startswith(("postgresql://", "postgres://")):
        from queryqueue.driver_postgres.store import PostgresQueueStore

        return PostgresQueueStore(db, schema=schema)
    return SqliteQueueStore(db, synchronous=synchronous)


async def serve(
    db: str | Path,
    socket_path: str | Path,
    *,
    synchronous: Synchronous = "NORMAL",
    schema: str = "queryqueue",
    tcp_port: int | None = None,
    app: str | None = None,
    workers: int = 0,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    **pool_options: Any,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then shut down gracefully.

    `pool_options` go to `WorkerPool` (cancel_grace, max_tasks_per_worker,
    max_memory_per_worker, shm_threshold)."""
    store = open_store(db, synchronous=synchronous, schema=schema)
    pool = (
        WorkerPool(app, socket_path, store, workers=workers, **pool_options)
        if app and workers > 0
        else None
    )
    server = QueueServer(
        store,
        socket_path,
        tcp_host="127.0.0.1" if tcp_port is not None else None,
        tcp_port=tcp_port,
        pool=pool,
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)  # the handler only sets a flag
    try:
        await server.start()
        if pool is not None:
            await pool.start()
        print(f"queryqueue supervisor listening on {server.socket_path}", flush=True)
        if server.tcp_address is not None:
            print(f"queryqueue supervisor listening on tcp {server.tcp_address}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if pool is not None:
            await pool.stop()
        await server.stop()
        store.close()


def run(db: str | Path, socket_path: str | Path, **options: Any) -> int:
    asyncio.run(serve(db, socket_path, **options))
    return 0
