"""The PostgreSQL examples as a user runs them: each worker opens its connection pool in
its start hook and waits on the database for many queries at once."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from queryqueue.supervisor.launch import launch
from tests.postgres_util import URL, require_postgres
from tests.supervisor_util import REPO, socket_dir
from tests.waiting import wait_until_sync

EXAMPLES = REPO / "examples"
WAITING = "SELECT %s::int FROM (SELECT pg_advisory_xact_lock_shared(%s)) AS waited"


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    require_postgres()
    monkeypatch.setenv("PG_DSN", URL)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import postgres_app

    yield postgres_app


@pytest.mark.parametrize(("name", "lanes"), [("app", 32), ("threaded", 16)])
def test_one_worker_waits_on_postgresql_for_many_queries_at_once(
    examples: Any, name: str, lanes: int
) -> None:
    """Eight queries wait together on a lock the test holds, in the one worker process (seen
    in pg_stat_activity), and each answers once the lock goes."""
    import psycopg

    app = getattr(examples, name)
    directory = socket_dir()
    options = ("--workers", "1", "--worker-concurrency", str(lanes))
    process = launch(
        directory / "pg.db", directory / "s.sock", "--app", f"postgres_app:{name}", *options,
        cwd=EXAMPLES,
    )  # fmt: skip
    app.socket_path = process.socket_path
    lock = random.randrange(1, 2**31)
    results: list[Any] = []
    try:
        with psycopg.connect(URL, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", [lock])
            callers = threading.Thread(target=lambda: results.extend(_ask_eight(app, lock)))
            callers.start()
            try:
                wait_until_sync(lambda: _waiting(holder, lock) == 8, within=60, what="8 waiting")
            finally:
                holder.execute("SELECT pg_advisory_unlock(%s)", [lock])
                callers.join(120)
    finally:
        assert process.stop() == 0
        shutil.rmtree(directory, ignore_errors=True)
    assert sorted(results) == [[[i]] for i in range(8)]


def _ask_eight(app: Any, lock: int) -> list[Any]:
    async def main() -> list[Any]:
        try:
            return list(
                await asyncio.gather(
                    *(app.run("sql", {"sql": _marked(lock), "params": [i, lock]}) for i in range(8))
                )
            )
        finally:
            await app.aclose()

    return asyncio.run(main())


def _marked(lock: int) -> str:
    return f"/* lanes {lock} */ {WAITING}"


def _waiting(holder: Any, lock: int) -> int:
    """Sessions waiting for the test's lock."""
    row = holder.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        [f"/* lanes {lock} */%"],
    ).fetchone()
    return int(row[0])
