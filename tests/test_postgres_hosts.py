"""Several supervisors ("hosts") sharing one queue on PostgreSQL, each with its own worker
pool and callers: dedup, the budget, priorities and failover across them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from queryqueue import ContinueWaitError, SocketQueueDriver, StoreError
from tests.pool_util import ask
from tests.postgres_hosts_util import ask_sql, pool_host, two_pool_hosts, until_done
from tests.postgres_util import URL, fresh_schema, pg_host
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until


async def _pending(driver: SocketQueueDriver, count: int) -> bool:
    return len(await driver.pending("pool")) == count


async def test_two_hosts_share_dedup_and_the_concurrency_budget(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with two_pool_hosts(workdir, schema) as (_, drivers, queues):
        keys = [f"k{i}" for i in range(6)]
        # Every key asked on both hosts at once: each runs once, somewhere.
        results = await asyncio.gather(*(ask_sql(q, key, 0.3) for key in keys for q in queues))
        assert [r["key"] for r in results] == [key for key in keys for _ in queues]
        trace = read_trace(workdir)
        starts = sorted(t[1] for t in trace if t[0] == "start")
        assert starts == keys
        # The prefix's budget (2) held across 4 workers on 2 hosts: recorded, not assumed.
        assert max_overlap(trace) == 2
        ran_on = {int(t[2]) for t in trace if t[0] == "start"}
        pools = [set(w["pid"] for w in (await d.stats())["pool"]["workers"]) for d in drivers]
        assert ran_on <= pools[0] | pools[1]


async def test_a_host_killed_mid_query_is_reclaimed_by_the_other(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    hosts = [pool_host(workdir, name, schema) for name in ("a", "b")]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [app.pool_queue(d, continue_wait_timeout=1.0) for d in drivers]
    pools = [[w["pid"] for w in (await d.stats())["pool"]["workers"]] for d in drivers]
    try:
        callers = [asyncio.ensure_future(ask_sql(q, "slow", 3.0)) for q in queues]
        await wait_until(lambda: any(t[0] == "start" for t in read_trace(workdir)), within=30)
        runner = int(next(t for t in read_trace(workdir) if t[0] == "start")[2])
        dead = 0 if runner in pools[0] else 1
        alive = 1 - dead
        # The whole host goes: its supervisor and its workers, without a word.
        hosts[dead].kill9()
        for pid in pools[dead]:
            with contextlib.suppress(ProcessLookupError):  # gone with its supervisor
                os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        callers[dead].cancel()
        # The surviving host reaps the stalled item (TO_CANCEL) and runs it again.
        result = await asyncio.wait_for(callers[alive], 60)
        assert result["key"] == "slow" and result["pid"] in pools[alive]
        starts = [t for t in read_trace(workdir) if t[0] == "start"]
        assert len(starts) == 2 and int(starts[1][2]) in pools[alive], read_trace(workdir)
        # Re-run only once the first execution was dead and its heartbeats stale.
        assert float(starts[1][3]) >= killed_at
        assert (await drivers[alive].list_items("pool")) == []
    finally:
        await asyncio.gather(*callers, return_exceptions=True)
        for queue, driver in zip(queues, drivers, strict=True):
            await queue.shutdown(grace=0)
            await driver.close()
        assert hosts[1 - dead].stop() == 0


async def test_killed_database_connections_lose_no_acknowledged_result(
    workdir: Path, schema: str
) -> None:
    import psycopg

    host = pg_host(workdir, "a", schema)
    driver = SocketQueueDriver(host.socket_path)
    stop = threading.Event()
    kills = 0

    def terminate_forever() -> None:
        nonlocal kills
        with psycopg.connect(URL, autocommit=True) as admin:
            while not stop.wait(0.05):
                row = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE application_name = %s",
                    (f"queryqueue:{schema}",),
                ).fetchone()
                kills += int(row[0]) if row else 0

    killer = threading.Thread(target=terminate_forever, daemon=True)
    acked: dict[str, str] = {}
    try:
        killer.start()
        for i in range(150):
            path = f"p:k{i}"
            value = f'{{"n":{i}}}'
            await until_done(driver.add, path, '{"q":1}')
            item = await until_done(driver.retrieve, path, concurrency=1000)
            if item is not None and item.id is not None:
                queue_id = item.id
            else:
                # A RETRIEVE re-sent after its first COMMIT's answer was lost finds the item
                # active: the first one took it.
                active = await until_done(driver.active, "p")
                queue_id = next(row.queue_id for row in active if row.id == f"k{i}")
            ack = await until_done(driver.ack, queue_id, value)
            if not ack.success:
                # Only an ACK re-sent after its first COMMIT's answer was lost finds no item:
                # then that first one took effect.
                assert await driver.result(queue_id) is not None
            acked[path] = value
        stop.set()
        killer.join()
        assert kills > 0  # the connections really were killed under load
        for path, value in acked.items():
            found = await driver.result(path)
            assert found is not None and found.payload == value, path
        assert await driver.list_items("p") == []  # nothing wedged
    finally:
        stop.set()
        await driver.close()
        assert host.stop() == 0


async def test_priority_order_holds_across_hosts(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    gate = workdir / "gate"
    gate.touch()
    monkeypatch.setenv("POOL_GATE", str(gate))

    async def ask(queue: Any, handler: str, key: str, priority: int, seconds: float) -> Any:
        query = {"key": key, "seconds": seconds}
        return await queue.execute_in_queue(handler, key, query, priority)

    async with two_pool_hosts(workdir, schema) as (_, drivers, queues):
        # The prefix's two slots busy (one per host) until the gate opens...
        blockers = [
            asyncio.ensure_future(ask(q, "gated", f"b{i}", 0, 0)) for i, q in enumerate(queues)
        ]
        await wait_until(lambda: sum(t[0] == "start" for t in read_trace(workdir)) == 2, within=30)
        # ...background work queued on host a, then urgent work on host b.
        low = [asyncio.ensure_future(ask(queues[0], "sql", f"low{i}", 0, 0.05)) for i in range(3)]
        await wait_until(lambda: _pending(drivers[0], 3), within=30)
        # The first high to end frees the slot the last high takes; a low takes a slot
        # only once a long one ends, half a second later: the order shows in their starts
        # however long a worker takes to start what it was handed.
        high = [
            asyncio.ensure_future(ask(queues[1], "sql", f"high{i}", 5, seconds))
            for i, seconds in enumerate((0.05, 0.5, 0.5))
        ]
        await wait_until(lambda: _pending(drivers[0], 6), within=30)
        gate.unlink()
        await asyncio.gather(*blockers, *low, *high)
    started = {t[1]: float(t[3]) for t in read_trace(workdir) if t[0] == "start"}
    assert max(started[f"high{i}"] for i in range(3)) <= min(started[f"low{i}"] for i in range(3))
    assert max_overlap(read_trace(workdir)) == 2


async def test_an_item_its_caller_abandoned_is_reaped_by_another_host(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    gate = workdir / "gate"
    gate.touch()
    monkeypatch.setenv("POOL_GATE", str(gate))
    slow_beats = {**os.environ, "POOL_HEARTBEAT": "1.0"}
    hosts = [pool_host(workdir, "a", schema), pool_host(workdir, "b", schema, env=slow_beats)]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [app.pool_queue(d, continue_wait_timeout=0.3) for d in drivers]
    try:
        # Each host's slot held until the gate opens, however slow the machine.
        blockers = [
            asyncio.ensure_future(ask(q, "gated", f"b{i}", {"key": f"b{i}"}, within=60))
            for i, q in enumerate(queues)
        ]
        await wait_until(lambda: sum(t[0] == "start" for t in read_trace(workdir)) == 2, within=30)
        # Asked on host a with a 1 s orphaned timeout, then the caller goes away. Host b
        # finds the blocker host a held stalled only its heartbeat timeout (4 s) after the
        # kill: "gone" is orphaned first, so the slot the blocker frees never goes to it.
        query = {"key": "gone", "seconds": 0, "orphanedTimeout": 1}
        with pytest.raises(ContinueWaitError):
            await queues[0].execute_in_queue("sql", "gone", query)
        pids = [w["pid"] for w in (await drivers[0].stats())["pool"]["workers"]]
        hosts[0].kill9()  # nobody on host a is left to reap it
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: _pending(drivers[1], 0), within=15)
        gate.unlink()
        await asyncio.gather(blockers[1])
        trace = read_trace(workdir)
        assert "gone" not in [t[1] for t in trace if t[0] == "start"]
        # Removed as orphaned by host b, whose supervisor ran the cancel path.
        assert ["cancel", "gone", str(hosts[1].pid)] in [t[:3] for t in trace]
        blockers[0].cancel()
        await asyncio.gather(blockers[0], return_exceptions=True)
    finally:
        for queue, driver in zip(queues, drivers, strict=True):
            await queue.shutdown(grace=0)
            await driver.close()
        assert hosts[1].stop() == 0
        if hosts[0].process.poll() is None:
            hosts[0].stop()


def test_a_connection_that_keeps_breaking_is_a_store_error_after_bounded_retries(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from queryqueue.driver_postgres import batch as batch_module
    from queryqueue.driver_postgres import store as pg

    store = pg.PostgresQueueStore(URL, schema=schema)
    attempts = 0

    def broken() -> object:
        nonlocal attempts
        attempts += 1
        raise batch_module.Disconnected("server closed the connection unexpectedly")

    monkeypatch.setattr(store, "_atomic", broken)
    try:
        with pytest.raises(StoreError, match="broke 4 times in a row") as raised:
            store.add("p:k", "{}")
        assert type(raised.value) is StoreError  # the public family, nothing private
        assert attempts == pg.RECONNECT_ATTEMPTS
    finally:
        monkeypatch.undo()
        store.close()


def test_queues_in_two_schemas_of_one_database_do_not_share_prefix_locks(schema: str) -> None:
    """Advisory locks are one namespace per database: a prefix locked in one queue (its
    schema) must not hold up the same prefix of another queue in the same database."""
    import psycopg

    from queryqueue.driver_postgres.statements import prefix_lock_key
    from queryqueue.driver_postgres.store import PostgresQueueStore

    other_schema = fresh_schema()
    store = PostgresQueueStore(URL, schema=schema, lock_timeout=1.0)
    try:
        with psycopg.connect(URL, autocommit=True) as other:
            other.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))",
                (prefix_lock_key(other_schema, "p"),),
            )
            assert store.add("p:k", "{}").added  # before: waited, then failed at 1 s
            other.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (prefix_lock_key(schema, "p"),)
            )
            with pytest.raises(StoreError, match="lock timeout"):
                store.add("p:k2", "{}")  # its own queue's lock does hold it up
    finally:
        store.close()
