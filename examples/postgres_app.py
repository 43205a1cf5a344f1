"""Queries that wait on PostgreSQL, many at once in each worker: an async handler on
psycopg's async connection pool (`app`), and a sync one on its threaded pool (`threaded`).
Each worker process opens its pool once, in its start hook, and closes it in its stop hook.

    cd examples
    export PG_DSN=postgresql://localhost/postgres
    queryqueue supervisor --db pg.db --app postgres_app:app        # 2 workers x 16
    queryqueue supervisor --db pg.db --app postgres_app:threaded   # the sync handler

    # then, from any process:
    rows = await run_sql.run({"sql": "SELECT pg_sleep(0.05), 42"}, key="slow-report")

Needs `pip install 'queryqueue[postgres]'` (psycopg and psycopg-pool).
"""

from __future__ import annotations

import os
from typing import Any

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from queryqueue import QueueApp, SetCancelHandler

DSN = os.environ.get("PG_DSN", "postgresql://localhost/postgres")

# 32 queries at once on the database, 16 in each of 2 worker processes.
app = QueueApp("pg", concurrency=32, worker_concurrency=16)


@app.on_worker_start
async def open_pool() -> None:
    """One pool per worker process, as large as the queries it runs at once, its
    connections made before the first query; reads in autocommit: no BEGIN before each
    and no ROLLBACK as the connection goes back to the pool."""
    app.state.pool = AsyncConnectionPool(
        DSN, min_size=16, max_size=16, open=False, kwargs={"autocommit": True}
    )
    await app.state.pool.open()


@app.on_worker_stop
async def close_pool() -> None:
    await app.state.pool.close()


@app.handler("sql")
async def run_sql(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> list[list[Any]]:
    """Runs `query["sql"]` with `query["params"]`; its rows. A cancel or a timeout cancels
    this coroutine, which psycopg turns into a cancel of the statement on the server."""
    pool: AsyncConnectionPool = app.state.pool
    async with pool.connection() as connection:
        cursor = await connection.execute(query["sql"], query.get("params"))
        return [list(row) for row in await cursor.fetchall()]


# The same for a driver without asyncio: each worker runs 8 sync handlers at once, on its
# threads, each waiting on the database with the GIL released.
threaded = QueueApp("pg_threads", concurrency=16, worker_concurrency=8)


@threaded.on_worker_start
def open_threaded_pool() -> None:
    threaded.state.pool = ConnectionPool(DSN, min_size=1, max_size=8)


@threaded.on_worker_stop
def close_threaded_pool() -> None:
    threaded.state.pool.close()


@threaded.handler("sql")
def run_sql_in_a_thread(
    query: dict[str, Any], set_cancel_handler: SetCancelHandler
) -> list[list[Any]]:
    """As `run_sql`; a cancel handler gets the backend's pid, to cancel the statement with."""
    pool: ConnectionPool = threaded.state.pool
    with pool.connection() as connection:
        set_cancel_handler({"backend": connection.info.backend_pid})
        return [list(row) for row in connection.execute(query["sql"], query.get("params"))]


@threaded.cancel_handler("sql")
def cancel_statement(definition: dict[str, Any]) -> None:
    """Cancels the statement of the cancelled (or timed-out) query on the server (in the
    worker that runs it: a caller that cancels has no pool, and leaves it to the worker)."""
    backend = (definition.get("cancelHandler") or {}).get("backend")
    pool: ConnectionPool | None = getattr(threaded.state, "pool", None)
    if backend is not None and pool is not None:
        with pool.connection() as connection:
            connection.execute("SELECT pg_cancel_backend(%s)", [backend])
