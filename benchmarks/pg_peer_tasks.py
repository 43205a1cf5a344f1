"""The PostgreSQL peers' task modules, in one file: imported inside each peer's own virtual
environment (never by queryqueue), configured by $QQ_PEER and $QQ_PG_DSN (a database of
the peer's own, made afresh for each repetition by pg_peer_runner.py).

Every setting that is not the library's default is listed in SETTINGS and printed with
the results.
"""
# mypy: ignore-errors
# ruff: noqa

from __future__ import annotations

import os

PEER = os.environ.get("QQ_PEER", "")
DSN = os.environ.get("QQ_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
SETTINGS: dict[str, str] = {}

if PEER == "pgqueuer":
    from contextlib import asynccontextmanager

    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job

    @asynccontextmanager
    async def create_pgqueuer():
        """The worker's factory (`pgq run pg_peer_tasks:create_pgqueuer`)."""
        connection = await asyncpg.connect(DSN)
        pgq = PgQueuer.from_asyncpg_connection(connection)

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            return None

        try:
            yield pgq
        finally:
            await connection.close()

elif PEER == "procrastinate":
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DSN))

    @app.task(name="noop")
    async def noop() -> int:
        return 1
