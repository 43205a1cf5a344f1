"""PostgreSQL for tests: a fresh schema per store, dropped when the store closes; the
test is skipped, with the reason, when no server is reachable."""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from queryqueue.supervisor.launch import SupervisorProcess

URL = os.environ.get("QUERYQUEUE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


@functools.cache
def unavailable() -> str | None:
    """Why PostgreSQL tests cannot run here, or None."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[test]')"
    try:
        with psycopg.connect(URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"no PostgreSQL server at {URL}: {str(exc).strip().splitlines()[0]}"
    return None


def require_postgres() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


def fresh_schema() -> str:
    return f"qq_t_{uuid.uuid4().hex[:12]}"


def drop_schema(schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def postgres_store(**options: Any) -> Any:
    """A PostgresQueueStore on a schema of its own; closing it drops the schema."""
    require_postgres()
    from queryqueue.driver_postgres.store import PostgresQueueStore

    schema = options.pop("schema", None) or fresh_schema()
    store = PostgresQueueStore(options.pop("url", URL), schema=schema, **options)
    close = store.close

    def close_and_drop() -> None:
        close()
        drop_schema(schema)

    store.close = close_and_drop  # type: ignore[method-assign]
    return store


def pg_host(
    workdir: Path,
    name: str,
    schema: str,
    *options: str,
    url: str = URL,
    env: dict[str, str] | None = None,
) -> SupervisorProcess:
    """A supervisor of `schema` on PostgreSQL at `url` (or a proxy in
    front of it), its files named `name` in `workdir`, started in the checkout, where
    `--app tests.apps...` resolves."""
    from queryqueue.supervisor.launch import launch
    from tests.supervisor_util import REPO

    return launch(
        workdir / f"{name}.db",
        workdir / f"{name}.sock",
        *("--schema", schema, *options),
        store=url,
        cwd=REPO,
        env=env,
    )


def lock_waiters(admin: Any, schema: str) -> int:
    """Sessions of the queue in `schema` waiting on a lock now (read by `admin`)."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        " AND wait_event_type = 'Lock'",
        (f"queryqueue:{schema}",),
    ).fetchone()
    return int(row[0]) if row else 0


def break_store_connections(schema: str) -> None:
    """Terminate the command connections of the stores on `schema` (not their LISTEN ones):
    each store's next command finds its connection broken and reconnects."""
    import psycopg

    with psycopg.connect(URL, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND query NOT ILIKE 'LISTEN%%'"
            " AND pid <> pg_backend_pid()",
            (f"queryqueue:{schema}",),
        )


class Proxy:
    """A TCP proxy in front of PostgreSQL, on a thread of its own, to break the network
    the ways a real one breaks: `freeze()` stops forwarding (connections stay open, bytes
    are held: a partition, a hung middlebox); `cut()` closes every connection and refuses
    new ones (a restart, seen from the client) until `resume()`; `mute_answers()` drops
    whatever the server sends on the connections open now (a COMMIT that arrives, and
    whose answer is lost on the way back)."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        import asyncio
        import threading

        self._target = target
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._up = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._muted: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.StreamWriter] = set()  # the proxy's side toward clients
        self.connections = 0
        started = threading.Event()
        self.port = 0

        async def start() -> asyncio.Server:
            self._flowing.set()
            server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            started.set()
            return server

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            server = self._loop.run_until_complete(start())
            self._loop.run_forever()
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0.05))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="pg-proxy", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the proxy did not start")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    async def _accept(self, reader: Any, writer: Any) -> None:
        import asyncio

        if not self._up:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        self._clients.add(writer)
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            self._writers.discard(w)
            self._muted.discard(w)
            w.close()
        self._clients.discard(writer)

    async def _pipe(self, reader: Any, writer: Any) -> None:
        while data := await reader.read(65536):
            await self._flowing.wait()
            if writer in self._muted:
                continue
            writer.write(data)
            await writer.drain()
        writer.close()

    def _call(self, callback: Any) -> None:
        import concurrent.futures

        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            callback()
            done.set_result(None)

        self._loop.call_soon_threadsafe(run)
        done.result(10)

    def mute_answers(self) -> None:
        self._call(lambda: self._muted.update(self._clients))

    def freeze(self) -> None:
        self._call(self._flowing.clear)

    def cut(self) -> None:
        def cut() -> None:
            self._up = False
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(cut)

    def resume(self) -> None:
        def resume() -> None:
            self._up = True
            self._flowing.set()

        self._call(resume)

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
