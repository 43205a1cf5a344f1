"""A prefix whose lock another client holds on PostgreSQL holds up its own commands only:
the pool's heartbeats for its running queries wait on that prefix's lane, not on every
lane, so another prefix's ADD and `stats` answer meanwhile, on the pool's host and on
another."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psycopg
import pytest

from queryqueue import SocketQueueDriver
from queryqueue.driver_postgres.statements import prefix_lock_key
from tests.pool_util import ask
from tests.postgres_util import URL, lock_waiters, pg_host
from tests.trace import read_trace
from tests.waiting import wait_until

WORKERS = 4  # as many as the store's lanes: a heartbeat each would take them all


async def test_the_pools_prefix_locked_elsewhere_holds_up_no_other_prefix(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import six

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    host = pg_host(
        workdir, "a", schema, "--app", "tests.apps.pool_app:six",
        *("--workers", str(WORKERS), "--pg-connections", "4", "--pg-lock-timeout", "20"),
        env={**os.environ, "POOL_HEARTBEAT": "0.25"},  # a heartbeat round every 0.25 s
    )  # fmt: skip
    plain = pg_host(workdir, "b", schema, "--pg-lock-timeout", "20")  # no pool: a second host
    driver, other_host = SocketQueueDriver(host.socket_path), SocketQueueDriver(plain.socket_path)
    queue = six.pool_queue(driver, continue_wait_timeout=1.0)
    running = [
        asyncio.ensure_future(ask(queue, "ticking", f"r{i}", {"key": f"r{i}", "seconds": 30.0}))
        for i in range(WORKERS)
    ]
    try:
        await wait_until(lambda: sum(t[0] == "start" for t in read_trace(workdir)) == WORKERS)
        with psycopg.connect(URL, autocommit=True) as other:
            # Another client takes the pool prefix's lock and keeps it: the next heartbeat
            # round of the pool's running queries waits on it.
            other.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
                (prefix_lock_key(schema, "six"),),
            )
            await wait_until(lambda: lock_waiters(other, schema) >= 1, within=10)
            for i in range(3):  # through the pool's host and through the other one
                added = await asyncio.wait_for(driver.add(f"q:k{i}", "{}"), 1.0)
                assert added.added
                stats = await asyncio.wait_for(driver.stats(), 1.0)
                assert stats["pool"]["alive"] == WORKERS
                added = await asyncio.wait_for(other_host.add(f"q:b{i}", "{}"), 1.0)
                assert added.added
                await asyncio.wait_for(other_host.stats(), 1.0)
            # One of its sessions waits on the lock: the heartbeats queue behind it.
            assert lock_waiters(other, schema) == 1
            other.execute("SELECT pg_advisory_unlock_all()")
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await queue.shutdown(grace=0)
        await driver.close()
        await other_host.close()
        assert host.stop() == 0
        assert plain.stop() == 0
