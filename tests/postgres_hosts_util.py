"""What the tests of several supervisors on one PostgreSQL queue share: hosts with a pool,
calls that ask again, recorded statements."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import SocketQueueDriver, StoreError
from queryqueue.supervisor.launch import SupervisorProcess
from tests.pool_util import ask
from tests.postgres_util import URL, pg_host
from tests.supervisor_util import close_all

APP = "tests.apps.pool_app:app"


def pool_host(
    workdir: Path, name: str, schema: str, *, url: str = URL, env: dict[str, str] | None = None
) -> SupervisorProcess:
    pool = ("--app", APP, "--workers", "2", "--cancel-grace", "1")
    return pg_host(workdir, name, schema, *pool, url=url, env=env)


async def ask_sql(queue: Any, key: str, seconds: float) -> Any:
    return await ask(queue, "sql", key, {"key": key, "seconds": seconds}, within=60)


@contextlib.asynccontextmanager
async def two_pool_hosts(
    workdir: Path, schema: str
) -> AsyncIterator[tuple[list[SupervisorProcess], list[SocketQueueDriver], list[Any]]]:
    """Two supervisors with pools on one database, and a pool queue on each; all stopped
    (by pid) afterwards. Their stall timeout is 10 s: a host paused for a second (a loaded
    machine) must not have its running queries reaped and run again by the other."""
    from tests.apps.pool_app import app

    env = {**os.environ, "POOL_HEARTBEAT": "2.5"}
    hosts = [pool_host(workdir, name, schema, env=env) for name in ("a", "b")]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [app.pool_queue(d, continue_wait_timeout=30.0) for d in drivers]
    try:
        yield hosts, drivers, queues
    finally:
        await close_all(queues, drivers, hosts)


async def until_done(command: Any, *args: Any, **kwargs: Any) -> Any:
    """A command the store reported as failed (its connection died during COMMIT) is
    asked again: every one of these is safe to repeat. Connections die every 50 ms, so on
    a loaded machine a try may need many: the bound is a deadline, not a count."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return await command(*args, **kwargs)
        except StoreError as exc:
            last = exc
            await asyncio.sleep(0.05)
    raise AssertionError(f"the store never recovered: {last}")


def recorded_statements(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements this thread's connection of `store` runs from now on (those of a
    pipelined batch go through its Lean, lean.py, and one that falls back to psycopg's
    `execute` is recorded once)."""
    from queryqueue.driver_postgres.lean import Lean

    conn = store.connection()
    statements: list[str] = []
    execute = conn.execute
    lean_execute = Lean.execute
    inside: list[bool] = []

    def recorded(query: Any, *args: Any, **kwargs: Any) -> Any:
        if not inside:
            statements.append(str(query).strip())
        return execute(query, *args, **kwargs)

    def lean_recorded(self: Lean, query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query).strip())
        inside.append(True)
        try:
            return lean_execute(self, query, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(conn, "execute", recorded)
    monkeypatch.setattr(Lean, "execute", lean_recorded)
    return statements


# The pool's read of PENDING's head (`_send_expected`, or the listing when not read ahead).
HEAD_READ = "ORDER BY priority DESC, id LIMIT"


def pipelined_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement a pipelined batch sends from now on, on any thread (each goes
    through a Lean, lean.py); `monkeypatch` puts `Lean.execute` back."""
    from queryqueue.driver_postgres.lean import Lean

    statements: list[str] = []
    execute = Lean.execute

    def recorded(self: Lean, query: Any, *args: Any, **kwargs: Any) -> Any:
        statements.append(str(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(Lean, "execute", recorded)
    return statements
