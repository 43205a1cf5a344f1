"""Several supervisors ("hosts") sharing one queue on PostgreSQL, each with its own worker
pool and callers; and the database connection killed under load."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import ContinueWaitError, SocketQueueDriver, StoreError
from queryqueue.engine.clock import ManualClock
from queryqueue.supervisor.launch import SupervisorProcess
from tests.batches import answers_or_errors
from tests.pool_util import ask, pool_server
from tests.postgres_util import (
    URL,
    Proxy,
    break_store_connections,
    fresh_schema,
    lock_waiters,
    pg_host,
)
from tests.recording import record_calls
from tests.supervisor_util import close_all
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until, wait_until_sync

APP = "tests.apps.pool_app:app"


def _pool_host(
    workdir: Path, name: str, schema: str, *, url: str = URL, env: dict[str, str] | None = None
) -> SupervisorProcess:
    pool = ("--app", APP, "--workers", "2", "--cancel-grace", "1")
    return pg_host(workdir, name, schema, *pool, url=url, env=env)


async def _adds(driver: SocketQueueDriver) -> int:
    commands = (await driver.stats())["commands"]
    return sum(int(commands.get(c, {}).get("count", 0)) for c in ("add", "add_and_retrieve"))


async def _ask(queue: Any, key: str, seconds: float) -> Any:
    return await ask(queue, "sql", key, {"key": key, "seconds": seconds}, within=60)


@contextlib.asynccontextmanager
async def _two_pool_hosts(
    workdir: Path, schema: str
) -> AsyncIterator[tuple[list[SupervisorProcess], list[SocketQueueDriver], list[Any]]]:
    """Two supervisors with pools on one database, and a pool queue on each; all stopped
    (by pid) afterwards. Their stall timeout is 10 s: a host paused for a second (a loaded
    machine) must not have its running queries reaped and run again by the other."""
    from tests.apps.pool_app import app

    env = {**os.environ, "POOL_HEARTBEAT": "2.5"}
    hosts = [_pool_host(workdir, name, schema, env=env) for name in ("a", "b")]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [app.pool_queue(d, continue_wait_timeout=30.0) for d in drivers]
    try:
        yield hosts, drivers, queues
    finally:
        await close_all(queues, drivers, hosts)


async def test_two_hosts_share_dedup_and_the_concurrency_budget(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with _two_pool_hosts(workdir, schema) as (_, drivers, queues):
        keys = [f"k{i}" for i in range(6)]
        # Every key asked on both hosts at once: each runs once, somewhere.
        results = await asyncio.gather(*(_ask(q, key, 0.3) for key in keys for q in queues))
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
    hosts = [_pool_host(workdir, name, schema) for name in ("a", "b")]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [app.pool_queue(d, continue_wait_timeout=1.0) for d in drivers]
    pools = [[w["pid"] for w in (await d.stats())["pool"]["workers"]] for d in drivers]
    try:
        callers = [asyncio.ensure_future(_ask(q, "slow", 3.0)) for q in queues]
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
            await _until_done(driver.add, path, '{"q":1}')
            item = await _until_done(driver.retrieve, path, concurrency=1000)
            if item is not None and item.id is not None:
                queue_id = item.id
            else:
                # A RETRIEVE re-sent after its first COMMIT's answer was lost finds the item
                # active: the first one took it.
                active = await _until_done(driver.active, "p")
                queue_id = next(row.queue_id for row in active if row.id == f"k{i}")
            ack = await _until_done(driver.ack, queue_id, value)
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


async def _until_done(command: Any, *args: Any, **kwargs: Any) -> Any:
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

    async with _two_pool_hosts(workdir, schema) as (_, drivers, queues):
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


async def _pending(driver: SocketQueueDriver, count: int) -> bool:
    return len(await driver.pending("pool")) == count


async def test_an_item_its_caller_abandoned_is_reaped_by_another_host(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    gate = workdir / "gate"
    gate.touch()
    monkeypatch.setenv("POOL_GATE", str(gate))
    slow_beats = {**os.environ, "POOL_HEARTBEAT": "1.0"}
    hosts = [_pool_host(workdir, "a", schema), _pool_host(workdir, "b", schema, env=slow_beats)]
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


def test_a_commit_whose_answer_is_lost_is_looked_up_not_guessed(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ACK's COMMIT reaches the server but its answer never comes back: the store
    asks the database what became of that transaction (txid_status) on a fresh
    connection, and reports the ACK done, rather than an unknown outcome."""
    from queryqueue.driver_postgres import pipelined, statements
    from queryqueue.driver_postgres import store as pg

    proxy = Proxy()
    store = pg.PostgresQueueStore(proxy.url, schema=schema, network_timeout=1.0)
    real_scalar = statements.scalar

    def lose_the_next_answer(conn: Any, query: str, params: tuple[Any, ...] = ()) -> Any:
        value = real_scalar(conn, query, params)
        if "txid_current_if_assigned" in query:
            proxy.mute_answers()  # what the server says from here on is lost
        return value

    try:
        store.add("p:k", "{}")
        retrieved = store.retrieve("p:k", concurrency=1)
        assert retrieved is not None and retrieved.id is not None
        monkeypatch.setattr(pipelined, "scalar", lose_the_next_answer)
        ack = store.ack("p:k", '"done"')
        monkeypatch.undo()
        assert ack.success
        found = store.result("p:k")
        assert found is not None and found.payload == '"done"'
        assert store.ack("p:k", '"again"').success is False  # it ran once
    finally:
        monkeypatch.undo()
        store.close()
        proxy.close()


async def test_a_waiter_is_woken_only_once_the_ack_has_committed(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ACK's COMMIT is held back a moment: the waiter by path must not be told before
    it lands (it would take a row it cannot see yet, and the row would be read again)."""
    from queryqueue.driver_postgres import pipelined, statements
    from queryqueue.driver_postgres import store as pg

    store = pg.PostgresQueueStore(URL, schema=schema)
    real_scalar = statements.scalar

    def slow_commit(conn: Any, query: str, params: tuple[Any, ...] = ()) -> Any:
        value = real_scalar(conn, query, params)
        if "txid_current_if_assigned" in query and value is not None:
            time.sleep(0.3)  # between the ACK's last statement and its COMMIT
        return value

    try:
        store.add("p:k", "{}")
        retrieved = store.retrieve("p:k", concurrency=1)
        assert retrieved is not None and retrieved.id is not None
        waiter = asyncio.ensure_future(store.result_blocking("p:k", 10_000))
        await wait_until(lambda: store.waiters.count() == 1, within=10)
        monkeypatch.setattr(pipelined, "scalar", slow_commit)
        await store.run_off_loop(store.ack, "p:k", '"done"')
        found = await waiter
        assert found is not None and found.payload == '"done"'
        assert store.result("p:k") is None  # the waiter took it: it is not read twice
    finally:
        monkeypatch.undo()
        store.close()


async def test_a_lock_held_elsewhere_fails_after_the_lock_timeout_while_ping_answers(
    workdir: Path, schema: str
) -> None:
    import psycopg

    from queryqueue.driver_postgres.statements import prefix_lock_key

    host = pg_host(workdir, "a", schema, "--pg-lock-timeout", "5")
    driver = SocketQueueDriver(host.socket_path)
    try:
        with psycopg.connect(URL, autocommit=True) as other:
            # Another client holds the prefix's lock (the store takes it per command).
            other.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (prefix_lock_key(schema, "p"),)
            )
            add = asyncio.ensure_future(driver.add("p:k", "{}"))
            await wait_until(lambda: lock_waiters(other, schema) > 0, within=10)
            # The supervisor's loop is not waiting with it: ping answers meanwhile, and
            # another prefix's commands run on another connection.
            assert await driver.ping() == "pong"
            assert (await driver.add("q:k", "{}")).added
            assert await driver.retrieve("q:k", concurrency=1) is not None
            assert [row.id for row in await driver.active("q")] == ["k"]
            assert not add.done()
            with pytest.raises(StoreError, match="lock timeout"):
                await add
            other.execute("SELECT pg_advisory_unlock_all()")
        added = await driver.add("p:k", "{}")  # the store is fine afterwards
        assert added.added
    finally:
        await driver.close()
        assert host.stop() == 0


async def test_a_table_locked_elsewhere_fails_commands_after_the_lock_timeout_not_ping(
    workdir: Path, schema: str
) -> None:
    """Another session holds the queue's table in ACCESS EXCLUSIVE mode: every prefix's
    command waits on it (none can run), and each fails with a StoreError naming the lock
    timeout; the supervisor's loop waits for none of them, and service returns after."""
    import psycopg
    from psycopg import sql

    host = pg_host(workdir, "a", schema, "--pg-lock-timeout", "2")
    driver = SocketQueueDriver(host.socket_path)
    try:
        with psycopg.connect(URL) as other, psycopg.connect(URL, autocommit=True) as admin:
            other.execute(
                sql.SQL("LOCK TABLE {}.items IN ACCESS EXCLUSIVE MODE").format(
                    sql.Identifier(schema)
                )
            )
            adds = [asyncio.ensure_future(driver.add(f"{p}:k", "{}")) for p in ("p", "q", "r")]
            await wait_until(lambda: lock_waiters(admin, schema) > 0, within=10)
            assert await driver.ping() == "pong"
            assert not any(add.done() for add in adds)
            for add in adds:
                with pytest.raises(StoreError, match="lock timeout"):
                    await add
            assert await driver.ping() == "pong"
            other.rollback()  # the lock goes with the transaction
        assert all([(await driver.add(f"{p}:k", "{}")).added for p in ("p", "q", "r")])
    finally:
        await driver.close()
        assert host.stop() == 0


async def test_parked_long_polls_rely_on_listen_while_it_is_healthy(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from queryqueue.driver_postgres.store import PostgresQueueStore

    store = PostgresQueueStore(URL, schema=schema)
    looked = record_calls(monkeypatch, store, "_lookup")
    try:
        # Past its listener's first second, when its waiters look once more (a new epoch).
        await wait_until(lambda: store.listen_epoch >= 2, within=30)
        ids = [store.add(f"p:k{i}", "{}").id for i in range(20)]
        # Twenty idle waiters for 2.5 s: each reads the table once; LISTEN covers the rest
        # (the store used to read it again every second: 60 transactions here).
        assert await asyncio.gather(*(store.result_blocking(i, 2500) for i in ids)) == [None] * 20
        assert len(looked) == 20
        waiter = asyncio.ensure_future(store.result_blocking(ids[0], 10_000))
        await wait_until(lambda: len(looked) == 21)
        other = PostgresQueueStore(URL, schema=schema)  # another host's ACK, by NOTIFY
        try:
            assert other.ack(ids[0], '{"result": 1}').success
        finally:
            other.close()
        found = await asyncio.wait_for(waiter, 10)
        assert found is not None and found.payload == '{"result": 1}'
    finally:
        monkeypatch.undo()
        store.close()


def test_an_ack_notifies_only_while_another_host_listens(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NOTIFY is for other hosts' waiters (this host's are woken in-process): a store
    whose listener counts no other on its channel sends none with its ACKs; one that
    starts listening says so (its hello), and ACKs notify again until it has gone."""
    from queryqueue.driver_postgres import listening
    from queryqueue.driver_postgres import store as pg

    monkeypatch.setattr(listening, "LISTEN_CHECK_S", 0.2)
    a = pg.PostgresQueueStore(URL, schema=schema)
    try:
        wait_until_sync(lambda: not a.others_listen, within=30, what="a counted alone")
        statements = _recording(a, monkeypatch)
        assert a.ack(a.add("p:one", "{}").id, '"r1"').success
        assert any(s.startswith("INSERT INTO results") for s in statements), statements
        assert not [s for s in statements if "pg_notify" in s]
        b = pg.PostgresQueueStore(URL, schema=schema)
        try:
            wait_until_sync(lambda: a.others_listen, within=30, what="a heard of b")
            published = record_calls(monkeypatch, b, "_publish")
            two = a.add("p:two", "{}").id
            assert a.ack(two, '"r2"').success
            assert [s for s in statements if "pg_notify" in s]
            wait_until_sync(
                lambda: any(f'"id":{two},' in args[0] for args in published),
                within=30,
                what="b's listener hearing a's ACK",
            )
        finally:
            b.close()
        wait_until_sync(lambda: not a.others_listen, within=30, what="a alone again")
    finally:
        monkeypatch.undo()
        a.close()


async def test_a_new_listeners_waiters_look_again_once_other_hosts_heard_of_it(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that listened alone ACKs without a NOTIFY until it hears a new listener's
    hello: a waiter of the new host that looked before then finds such a result by one
    more look once the hello has had time to be heard (a new epoch), not at the safety
    re-check (30 s here)."""
    from queryqueue.driver_postgres import listening
    from queryqueue.driver_postgres import store as pg

    monkeypatch.setattr(listening, "LISTEN_GRACE_S", 5.0)
    a = pg.PostgresQueueStore(URL, schema=schema)
    monkeypatch.setattr(a, "_notifying", lambda: None)  # it never heard of b
    b = pg.PostgresQueueStore(URL, schema=schema, recheck_ms=100)
    looks: list[Any] = []  # what each of b's looks found, as it ended
    lookup = b._lookup

    def looked(key: Any) -> Any:
        found = lookup(key)
        looks.append(found)
        return found

    monkeypatch.setattr(b, "_lookup", looked)
    try:
        first_epoch = b.listen_epoch
        item = a.add("p:k", "{}").id
        waiter = asyncio.ensure_future(b.result_blocking(item, 30_000))
        await wait_until(lambda: len(looks) == 1, within=30)
        assert looks == [None]
        assert b.listen_epoch == first_epoch, "looked before the grace ended"
        assert a.ack(item, '"r"').success
        found = await asyncio.wait_for(waiter, 20)
        assert found is not None and found.payload == '"r"'
        assert len(looks) == 2 and b.listen_epoch == first_epoch + 1
    finally:
        monkeypatch.undo()
        b.close()
        a.close()


async def test_a_long_poll_its_own_ack_answered_is_answered_on_the_loop(
    schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter by id woken by an ACK of this store has its result in the event (the ACK's
    transaction took it): answering it costs no hop to a lane and back."""
    from queryqueue.driver_postgres.store import PostgresQueueStore

    store = PostgresQueueStore(URL, schema=schema)
    looked = record_calls(monkeypatch, store, "_lookup")
    try:
        queue_id = store.add("p:k", "{}").id
        waiter = asyncio.ensure_future(store.result_blocking(queue_id, 10_000))
        await wait_until(lambda: len(looked) == 1 and store.waiters.count() == 1)
        hops = record_calls(monkeypatch, store, "run_off_loop")
        assert store.ack(queue_id, '{"result": 1}').success
        found = await asyncio.wait_for(waiter, 10)
        assert found is not None and found.payload == '{"result": 1}' and found.id == queue_id
        assert hops == []
    finally:
        monkeypatch.undo()
        store.close()


def test_after_a_reconnect_active_items_are_not_reaped_for_the_outage(schema: str) -> None:

    from queryqueue.driver_postgres.store import PostgresQueueStore
    from queryqueue.engine.clock import ManualClock

    clock = ManualClock()
    store = PostgresQueueStore(URL, schema=schema, clock=clock)
    try:
        running = store.add("p:running", "{}").id
        store.retrieve(running, concurrency=5)
        clock.advance(100_000)  # an outage longer than any heartbeat timeout...
        break_store_connections(schema)  # ...that broke the connection
        # The first command after it reconnects; the running item was not reaped for it.
        assert store.stalled(50_000, "p") == []
        assert store.reconnects >= 1
        clock.advance(60_000)  # a real heartbeat timeout later, nobody beat it: stalled
        assert [row.queue_id for row in store.stalled(50_000, "p")] == [running]
    finally:
        store.close()


async def test_large_results_are_readable_on_every_host(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from queryqueue.driver_socket.segments import SHM_DIR, name_prefix
    from tests.apps.pool_app import big_text

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    gate = workdir / "gate"
    gate.touch()
    monkeypatch.setenv("POOL_GATE", str(gate))
    size = 2 * 1024 * 1024  # over the 1 MiB shared-memory threshold
    async with _two_pool_hosts(workdir, schema) as (hosts, drivers, queues):
        keys = [f"big{i}" for i in range(8)]
        # Every key asked on both hosts at once: wherever it ran, both callers read it.
        asks = asyncio.gather(
            *(
                ask(q, "big", key, {"key": key, "size": size}, within=60)
                for key in keys
                for q in queues
            )
        )

        async def every_add_in() -> bool:
            # A caller whose ADD came after the result was read would run it again (a
            # result read by a waiter is taken): the queries wait until all have asked.
            return all([await _adds(d) >= len(keys) for d in drivers])

        try:
            await wait_until(every_add_in, within=60, what="every caller's ADD on both hosts")
        finally:
            gate.unlink()
        results = await asks
        assert results == [big_text(size, key) for key in keys for _ in queues]
        starts = [t for t in read_trace(workdir) if t[0] == "start"]
        assert sorted(t[1] for t in starts) == keys  # 8 executions, not 16
    for host in hosts:
        assert list(SHM_DIR.glob(name_prefix(host.socket_path) + "*")) == []


async def test_a_frozen_connection_fails_after_the_network_timeout_and_the_supervisor_answers(
    workdir: Path, schema: str
) -> None:
    proxy = Proxy()
    try:
        host = pg_host(workdir, "a", schema, "--pg-network-timeout", "2", url=proxy.url)
        driver = SocketQueueDriver(host.socket_path)
        try:
            assert (await driver.add("p:a", "{}")).added
            proxy.freeze()  # connections stay open; nothing is forwarded any more
            add = asyncio.ensure_future(driver.add("p:b", "{}"))
            assert await driver.ping() == "pong"  # the loop does not wait with it
            with pytest.raises(StoreError, match=r"network timeout|cannot connect"):
                await add
            assert await driver.ping() == "pong"
            proxy.resume()
            assert (await _until_done(driver.add, "p:c", "{}")).added
            pending = {row.id for row in await _until_done(driver.pending, "p")}
            assert {"a", "c"} <= pending  # what was committed before the freeze is there
        finally:
            await driver.close()
            assert host.stop() == 0
    finally:
        proxy.close()


async def test_a_restart_under_load_answers_every_caller_once_and_sticks_no_slot(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database goes away for 2 s while queries run (every connection cut, new ones
    refused: a restart as its clients see it). The workers' heartbeats and ACKs ride it
    out: every caller gets its own answer, every query ran exactly once (nothing stuck
    until the stall timeout and run again), and afterwards no slot is held."""
    from tests.apps.pool_app import app

    proxy = Proxy()
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    try:
        host = _pool_host(workdir, "a", schema, url=proxy.url)
        driver = SocketQueueDriver(host.socket_path)
        queue = app.pool_queue(driver, continue_wait_timeout=30.0)
        keys = [f"r{i}" for i in range(10)]
        try:
            asks = [asyncio.ensure_future(_ask_through_errors(queue, key, 0.4)) for key in keys]
            await wait_until(lambda: read_trace(workdir) != [], within=30)  # queries run
            proxy.cut()
            await asyncio.sleep(2.0)  # the outage itself, not a wait for something
            proxy.resume()
            answers = await asyncio.wait_for(asyncio.gather(*asks), 60)
            assert [answer["key"] for answer in answers] == keys
            started = [event[1] for event in read_trace(workdir) if event[0] == "start"]
            assert sorted(started) == sorted(keys), "a query ran twice, or never"
            assert await _until_done(driver.active, "sql") == []
            assert await _until_done(driver.pending, "sql") == []
        finally:
            await queue.shutdown(grace=0)
            await driver.close()
            assert host.stop() == 0
    finally:
        proxy.close()


async def _ask_through_errors(queue: Any, key: str, seconds: float) -> Any:
    """A caller that asks again after a StoreError (the database is away), as one would."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await _ask(queue, key, seconds)
        except StoreError:
            assert time.monotonic() < deadline, f"no result for {key}"
            await asyncio.sleep(0.1)


def test_a_batch_whose_connection_dies_before_commit_runs_again_whole() -> None:
    """Group commit on PostgreSQL: what a batch did before its connection died was never
    committed, so the batch runs again on a fresh connection, every command once; the
    answers of the lost attempt are undone (its long polls unsubscribed), not sent."""
    import psycopg

    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        attempts = 0
        undone: list[list[Any]] = []

        def work() -> list[Any]:
            nonlocal attempts
            attempts += 1
            answers: list[Any] = [store.add("p:a", "{}")]
            if attempts == 1:
                _terminate(psycopg, store.connection().info.backend_pid)
            return answers + answers_or_errors(
                lambda: store.add("p:b", "{}"), lambda: store.add("p:c", "{}")
            )

        answers = store.batched(work, undone.append)
        assert attempts == 2
        assert len(undone) == 1 and isinstance(undone[0][1], StoreError)
        assert [a.added for a in answers] == [True, True, True]
        assert [row.id for row in store.pending("p")] == ["a", "b", "c"]  # once each
        assert store.add("p:d", "{}").pending == 4
    finally:
        store.close()


def _terminate(psycopg: Any, pid: int) -> None:
    with psycopg.connect(URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the backend did not go away"
            time.sleep(0.01)


def test_a_database_error_in_a_batch_undoes_its_command_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command of a batch that the database refuses (here a statement that fails in
    the middle of HEARTBEAT) is rolled back to its savepoint: the commands before and
    after it commit, the batch's transaction is not left aborted."""
    from queryqueue.driver_postgres.transaction import PostgresTransaction
    from tests.postgres_util import postgres_store

    def failing(self: PostgresTransaction, item: Any, now: int) -> None:
        self._write("UPDATE items SET heartbeat = 1 / 0 WHERE id = %s", (item.id,))

    store = postgres_store()
    try:
        first = store.add("p:a", "{}")

        def work() -> list[Any]:
            return answers_or_errors(
                lambda: store.add("p:b", "{}"),
                lambda: store.heartbeat("p:a"),
                lambda: store.add("p:c", "{}"),
            )

        monkeypatch.setattr(PostgresTransaction, "set_heartbeat", failing)
        answers = store.batched(work, lambda _: None)
        monkeypatch.undo()
        assert answers[0].added and answers[2].added
        assert isinstance(answers[1], StoreError) and "division by zero" in str(answers[1])
        assert [row.id for row in store.pending("p")] == ["a", "b", "c"]
        assert store.heartbeat(first.id)  # and the store goes on
    finally:
        store.close()


async def test_a_waiter_whose_timeout_comes_while_its_ack_commits_gets_the_result() -> None:
    """The ACK commits on a lane while its waiter by id may time out on the loop. The ACK
    takes the result for that waiter (claims it), so the waiter, timed out meanwhile,
    waits for the ACK's event instead of answering nothing: the result is not consumed
    for nobody (the caller would run the query again)."""
    from tests.postgres_util import postgres_store

    store = postgres_store()
    release = threading.Event()
    try:
        qid = store.add("p:a", "{}").id
        found, waiter = store.result_blocking_start(qid, 100)
        assert found is None and waiter is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        poll = asyncio.ensure_future(store.result_blocking_wait(qid, 100, waiter))

        def ack_then_hold() -> bool:
            acked: bool = store.ack(qid, '{"r":1}').success
            release.wait(10)  # the ACK's transaction has not committed yet
            return acked

        acking = loop.run_in_executor(None, store.batched, ack_then_hold, lambda _: None, "p")
        await wait_until(lambda: waiter.claimed and loop.time() > started + 0.3, within=10)
        assert not poll.done()  # past its timeout, waiting for the claimed event
        release.set()
        assert await acking
        got = await asyncio.wait_for(poll, 10)
        assert got is not None and got.payload == '{"r":1}'
    finally:
        release.set()
        store.close()


def _recording(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
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


def _recording_waits(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`_recording`'s statements, with "<wait>" where the thread waited for an answer not
    in yet (psycopg's pipeline then sends what is queued and waits for it)."""
    from psycopg import _pipeline_base

    events = _recording(store, monkeypatch)
    fetch = _pipeline_base.BasePipeline._fetch_gen

    def waited(self: Any, *args: Any, flush: bool = False) -> Any:
        if flush:
            events.append("<wait>")
        return fetch(self, *args, flush=flush)

    monkeypatch.setattr(_pipeline_base.BasePipeline, "_fetch_gen", waited)
    return events


# The pool's read of PENDING's head (`_send_expected`, or the listing when not read ahead).
_HEAD_READ = "ORDER BY priority DESC, id LIMIT"


def _recording_pipelined(monkeypatch: pytest.MonkeyPatch) -> list[str]:
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


def test_a_batch_that_does_not_fail_takes_no_savepoint_and_writes_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch runs first without savepoints: one whose commands all succeed sends no
    SAVEPOINT; the prefix's counts are written once, as it commits, and that write
    returns the transaction's id (no statement of its own for it). A command that fails
    after writing has the batch run again, each command in a savepoint of its own, and
    the counts stay true."""
    from queryqueue.driver_postgres.transaction import PostgresTransaction
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        store.add("p:a", "{}")
        statements = _recording(store, monkeypatch)
        answers = store.batched(
            lambda: [store.add("p:b", "{}"), store.add("p:c", "{}"), store.retrieve("p:a")],
            lambda _: None,
        )
        assert [a.added for a in answers[:2]] == [True, True] and answers[2].payload is not None
        assert not [s for s in statements if "SAVEPOINT" in s]
        assert len([s for s in statements if "prefix_counts" in s]) == 1
        assert not [s for s in statements if "txid_current_if_assigned" in s]
        # Its id known (the inserts returned it), COMMIT went with the pipeline's end.
        assert statements[-1] == "COMMIT"
        statements.clear()
        acked = store.batched(lambda: store.ack("p:a", '"done"'), lambda _: None)
        assert acked.success and statements[-1] == "COMMIT"  # the id came with the find
        assert not [s for s in statements if "txid_current_if_assigned" in s]
        store.retrieve("p:b")
        assert store.add("p:d", "{}").pending == 2  # c, d; b is active

        statements.clear()

        def failing(self: PostgresTransaction, item: Any, now: int) -> None:
            self._write("UPDATE items SET heartbeat = 1 / 0 WHERE id = %s", (item.id,))

        monkeypatch.setattr(PostgresTransaction, "set_heartbeat", failing)
        answers = store.batched(
            lambda: answers_or_errors(
                lambda: store.add("p:e", "{}"),
                lambda: store.heartbeat("p:b"),
                lambda: store.add("p:f", "{}"),
            ),
            lambda _: None,
        )
        assert isinstance(answers[1], StoreError) and answers[0].added and answers[2].added
        assert [s.split()[0] for s in statements if "SAVEPOINT" in s] == [
            "SAVEPOINT",
            "ROLLBACK",
            "RELEASE",
        ]
        monkeypatch.undo()
        assert store.add("p:g", "{}").pending == 5  # c, d, e, f, g
        assert [row.id for row in store.active("p")] == ["b"]
    finally:
        store.close()


def test_an_adds_reads_go_to_the_database_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a pipelined batch an ADD sends what it may read (the item at its path, the
    owner of its external id, the path's unread result) and the id it takes if it
    inserts with its lock, before it waits for any answer: one wait in all (four before:
    each read, then its INSERT's id). An ADD that joins reads the same way; the answers
    are those of reads made one by one."""
    import psycopg

    from queryqueue.driver_postgres.lean import Answer
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        first = store.add("p:a", "{}")
        events = _recording(store, monkeypatch)
        fetchone = psycopg.Cursor.fetchone

        def answered(self: psycopg.Cursor[Any]) -> Any:
            events.append("<answer>")
            return fetchone(self)

        monkeypatch.setattr(psycopg.Cursor, "fetchone", answered)
        answer_fetchone = Answer.fetchone

        def lean_answered(self: Answer) -> Any:
            events.append("<answer>")
            return answer_fetchone(self)

        monkeypatch.setattr(Answer, "fetchone", lean_answered)
        answers = store.batched(
            lambda: [
                store.add("p:b", "{}", external_id="e", if_no_result=True),
                store.add("p:a", "{}", if_no_result=True),
            ],
            lambda _: None,
        )
        monkeypatch.undo()
        assert answers[0].added and answers[0].pending == 2
        assert not answers[1].added and answers[1].id == first.id
        before_commit = events[: events.index("COMMIT")]
        sent_first = before_commit[: before_commit.index("<answer>")]
        for read in ("WHERE prefix = %s AND key = %s", "WHERE external_id", "FROM results"):
            assert [s for s in sent_first if read in s], (read, sent_first)
        # Waits: each run of answers read after statements were sent.
        waits = sum(
            1
            for i, event in enumerate(before_commit)
            if event == "<answer>" and before_commit[i - 1] != "<answer>"
        )
        assert waits == 2  # b's reads (its INSERT waits for nothing), a's reads
        assert [row.id for row in store.pending("p")] == ["a", "b"]
        assert store.add("p:c", "{}").pending == 3
    finally:
        store.close()


def test_a_batchs_acks_by_id_are_read_with_its_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor tells a batch what it will run (`expect`): the items its ACKs by
    queue id ask for are read right after the batch's prefix lock, so the ACKs wait for
    their reads together with the first command that waits: two waits for the database
    before the COMMIT here (the first ACK's, the ADD's reads), not three."""

    from tests.postgres_util import postgres_store

    # Time stands still: the ACK's purge of expired results (once a second) stays done.
    store = postgres_store(clock=ManualClock())
    try:
        store.ack(store.add("p:warm", "{}").id, None)  # the first ACK's purge, done
        a, b = store.add("p:a", "{}").id, store.add("p:b", "{}").id
        store.retrieve("p:a")
        store.retrieve("p:b")
        events = _recording_waits(store, monkeypatch)

        def work() -> list[Any]:
            store.expect([("ack", (a, '"ra"')), ("add", ("p:c", "{}")), ("ack", (b, None))])
            return [store.ack(a, '"ra"'), store.add("p:c", "{}"), store.ack(b, None)]

        answers = store.batched(work, lambda _: None, prefix="p")
        monkeypatch.undo()
        assert [answers[0].success, answers[1].added, answers[2].success] == [True] * 3
        before_commit = events[: events.index("COMMIT")]
        sent_first = before_commit[: before_commit.index("<wait>")]
        assert len([s for s in sent_first if "WHERE id = %s AND prefix = %s" in s]) == 2
        assert before_commit.count("<wait>") == 2, before_commit
        assert store.result(a) is not None
        assert [row.id for row in store.pending("p")] == ["c"] and not store.active("p")
    finally:
        store.close()


def test_a_batchs_adds_are_read_with_its_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Told the batch's commands with their keywords, as a supervisor tells them, the
    store sends the reads of its ADDs of other paths (their item, external id, unread
    result and the id each takes if it inserts) with the batch's first statements: three
    ADDs and a worker's ACK wait once for the database before the COMMIT, not three
    times, and answer as the in-memory store does, ids included. An ADD of a path seen
    before it in the batch reads in its turn (a wait of its own), and so do those after
    it: their ids stay in the batch's order. Told the commands without their keywords,
    each ADD reads in its turn."""

    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    try:
        for target in (model, store):
            target.ack(target.add("p:warm", "{}").id, None)  # the first ACK's purge, done
            target.ack(target.add("p:b", "{}").id, '"b"')  # an unread result to join
            target.retrieve(target.add("p:a", "{}").id)
        ack = 3
        script: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:c", "{}"), {"external_id": "e1", "if_no_result": True}),
            ("add", ("p:b", "{}"), {"if_no_result": True}),  # joins p:b's result
            ("add", ("p:d", "{}"), {"priority": 5}),
            ("ack", (ack, '"a"'), {}),
        ]
        again: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:e", "{}"), {}),
            ("add", ("p:e", "{}"), {}),  # its path seen: reads in its turn
            ("add", ("p:f", "{}"), {}),  # after it: in its turn too
        ]

        def run(
            commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]], keywords: bool = True
        ) -> int:
            """The batch's answers checked; how many times it waited before its COMMIT."""
            expected = [getattr(model, name)(*args, **kw) for name, args, kw in commands]
            events = _recording_waits(store, monkeypatch)

            def work() -> list[Any]:
                store.expect(commands if keywords else [(name, a) for name, a, _ in commands])
                return [getattr(store, name)(*args, **kw) for name, args, kw in commands]

            answers = store.batched(work, lambda _: None, prefix="p")
            monkeypatch.undo()
            assert answers == expected
            return events[: events.index("COMMIT")].count("<wait>")

        assert run(script) == 1
        assert run(again) == 3
        # Told names and arguments only, each ADD reads in its turn.
        assert run([(name, (f"{args[0]}2", *args[1:]), kw) for name, args, kw in again], False) == 3
        assert run([("add", (f"p:g{n}", "{}"), {}) for n in range(3)], False) == 3
        assert store.result(ack) == model.result(ack)
        assert [row.id for row in store.pending("p")] == [row.id for row in model.pending("p")]
    finally:
        store.close()


def test_an_add_whose_result_expired_since_the_batch_read_ahead_reads_it_again() -> None:
    """A batch's ADDs read before its commands run: an unread result of an ADD's path
    that expires in between is read again (the ADD inserts, as in its turn it would),
    and the next ADDs then read in their turn, so their items still come after its (the
    ids they took ahead go unused)."""
    from tests.postgres_util import postgres_store

    clock = ManualClock()
    store = postgres_store(clock=clock, result_ttl_ms=5_000)
    try:
        store.ack(store.add("p:a", "{}").id, '"old"')  # unread until it expires
        clock.advance(4_999)
        commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:z", "{}"), {}),  # the batch's first: its ADDs' reads go with it
            ("add", ("p:a", "{}"), {"if_no_result": True}),
            ("add", ("p:b", "{}"), {}),
        ]

        def work() -> list[Any]:
            store.expect(commands)
            answers = []
            for _, args, kw in commands:
                answers.append(store.add(*args, **kw))
                clock.advance(1)  # the result expires after the reads, before its ADD
            return answers

        z, a, b = store.batched(work, lambda _: None, prefix="p")
        assert z.added and a.added and b.added and z.id < a.id < b.id
        assert [row.id for row in store.pending("p")] == ["z", "a", "b"]
    finally:
        store.close()


def test_an_add_not_the_one_the_batch_was_told_of_reads_in_its_turn() -> None:
    """`expect` is a hint: an ADD that runs with other keywords than the batch was told
    (another external id; without if_no_result) reads in its turn, and so do the ADDs
    after it: the answers are those of the commands run one by one, and the items come
    in the batch's order (the ids read ahead for what was told go unused)."""
    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    try:
        for target in (model, store):
            target.ack(target.add("p:r", "{}").id, '"r"')  # an unread result, told joined
            target.add("p:x", "{}", external_id="e1")
        told: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:a", "{}"), {"external_id": "e2"}),
            ("add", ("p:r", "{}"), {"if_no_result": True}),
            ("add", ("p:b", "{}"), {}),
        ]
        run: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:a", "{}"), {"external_id": "e1"}),  # taken: refused
            ("add", ("p:r", "{}"), {}),  # not joining the result: inserts, in its turn
            ("add", ("p:b", "{}"), {}),
        ]
        expected = answers_or_errors(
            *(functools.partial(getattr(model, name), *args, **kw) for name, args, kw in run)
        )

        def work() -> list[Any]:
            store.expect(told)
            return answers_or_errors(
                *(functools.partial(getattr(store, name), *args, **kw) for name, args, kw in run)
            )

        got = store.batched(work, lambda _: None, prefix="p")
        assert [type(a) for a in got] == [type(a) for a in expected]
        assert [(a.added, a.pending) for a in got[1:]] == [
            (a.added, a.pending) for a in expected[1:]
        ]
        assert got[1].id < got[2].id
        assert [row.id for row in store.pending("p")] == [row.id for row in model.pending("p")]
    finally:
        store.close()


def test_the_pools_retrieval_is_read_with_the_batchs_first_statements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A supervisor's batch that frees a slot ends with its pool's retrieval; told so
    (`expect_retrieval`), the store reads the head of PENDING with the batch's lock and
    its ACKs' items, and keeps it up to date with the batch's own writes: an ADD, then a
    worker's ACK, then the retrieval wait once for the database before the COMMIT (the
    ADD's reads, which bring the rest), and the retrieval takes the ADD's item, of the
    highest priority, before the one queued earlier."""
    from tests.postgres_util import postgres_store

    # Time stands still: the ACK's purge of expired results (once a second) stays done.
    store = postgres_store(clock=ManualClock())
    try:
        store.ack(store.add("p:warm", "{}").id, None)  # the first ACK's purge, done
        a = store.add("p:a", "{}").id
        store.add("p:b", "{}")
        assert [r.id for r in store.retrieve_next("p", concurrency=1, process_id="pool")] == [a]
        events = _recording_waits(store, monkeypatch)

        def work() -> list[Any]:
            store.expect([("add", ("p:c", "{}")), ("ack", (a, '"ra"'))])
            store.expect_retrieval("p", "pool", 1)
            return [
                store.add("p:c", "{}", priority=5),
                store.ack(a, '"ra"'),
                store.retrieve_next("p", concurrency=1, process_id="pool"),
            ]

        added, acked, retrieved = store.batched(work, lambda _: None, prefix="p")
        monkeypatch.undo()
        assert added.added and acked.success
        assert [(r.key, r.id, r.pending) for r in retrieved] == [("c", added.id, 1)]
        before_commit = events[: events.index("COMMIT")]
        assert before_commit.count("<wait>") == 1, before_commit
        assert not [s for s in before_commit[before_commit.index("<wait>") :] if "LIMIT" in s]
        assert [row.id for row in store.pending("p")] == ["b"]
    finally:
        store.close()


def test_a_store_tells_whether_its_last_batch_left_a_prefix_with_nothing_pending() -> None:
    """`nothing_pending_seen`: what the counts of the last batch this store committed on
    a prefix said (a hint: another host may have added since); not known before one."""
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        assert not store.nothing_pending_seen("p")
        first = store.batched(lambda: store.add("p:a", "{}"), lambda _: None, prefix="p")
        assert not store.nothing_pending_seen("p")  # one pending
        store.batched(
            lambda: store.retrieve_next("p", concurrency=1, process_id="pool"),
            lambda _: None,
            prefix="p",
        )
        assert store.nothing_pending_seen("p")  # active now
        assert not store.nothing_pending_seen("q")
        store.batched(lambda: store.ack(first.id, '"r"'), lambda _: None, prefix="p")
        assert store.nothing_pending_seen("p")
    finally:
        store.close()


async def test_an_idle_queues_ack_reads_no_head_and_another_hosts_work_is_still_retrieved(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's retrieval after an ACK has its head of PENDING read with the batch's
    lock only while something may be pending: once a batch left nothing pending, an idle
    queue's ACK (the fast track's, here) costs no listing. What another host adds then,
    unseen by this host's store, still runs here (the counts read with the lock show it
    to the retrieval, which then reads the head; or the pool's reconcile finds it)."""
    from queryqueue.driver_postgres.store import PostgresQueueStore
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = postgres_store()
    other = PostgresQueueStore(URL, schema=store.schema)  # another host's
    statements: list[str] = []

    def head_reads() -> list[str]:
        return [s for s in statements if _HEAD_READ in s]

    try:
        async with pool_server(store, workdir) as (_, _, queue):
            prefix = queue.prefix
            await ask(queue, "sql", "first", {"key": "first", "seconds": 0}, priority=10)
            await wait_until(lambda: store.nothing_pending_seen(prefix), within=30)
            statements = _recording_pipelined(monkeypatch)
            await ask(queue, "sql", "second", {"key": "second", "seconds": 0}, priority=10)
            assert any(s.startswith("DELETE FROM items") for s in statements), statements
            assert head_reads() == []
            # Another host queues work while this one runs a query, unseen by this store.
            running = asyncio.ensure_future(
                ask(queue, "sql", "third", {"key": "third", "seconds": 0.5}, priority=10)
            )
            await wait_until(
                lambda: any(t[:2] == ["start", "third"] for t in read_trace(workdir)), within=30
            )
            path = f"{prefix}:{queue.hash_query_key('fourth')}"
            query = {"queryHandler": "sql", "query": {"key": "fourth", "seconds": 0}}
            assert other.add(path, orjson.dumps(query).decode()).added
            assert store.nothing_pending_seen(prefix)
            assert (await asyncio.wait_for(running, 60))["key"] == "third"
            found = await queue.driver.result_blocking(path, 60_000)
            assert found is not None
            assert orjson.loads(found.payload)["result"]["key"] == "fourth"
    finally:
        other.close()


def test_an_item_added_past_a_full_head_waits_behind_the_rows_not_read() -> None:
    """The head read ahead is a window: full, what lies past its last row was not read.
    An item the batch adds past it is not put there (a row not read may come first), and
    a retrieval that needs more rows than the window still holds reads the listing."""
    from unittest import mock

    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        ids = [store.add(f"p:{key}", "{}", priority=p).id for key, p in (("a", 10), ("b", 5))]

        def work() -> Any:
            store.expect([("add", ("p:c", "{}"))])
            store.expect_retrieval("p", "pool", 1)
            store.add("p:c", "{}", priority=1)
            return store.retrieve_next("p", concurrency=2, process_id="pool")

        with mock.patch("queryqueue.driver_postgres.pipelined.HEAD_SPARE", 0):  # one row read
            retrieved = store.batched(work, lambda _: None, prefix="p")
        assert [r.id for r in retrieved] == ids
        assert [row.id for row in store.pending("p")] == ["c"]
    finally:
        store.close()


def test_an_item_read_ahead_and_changed_in_the_batch_is_read_again() -> None:
    """What a batch read ahead for an ACK is as it was before the batch's commands ran:
    one that changed the item first (a RETRIEVE that made it active, an ACK before it)
    has the ACK read it again, so the answers and counts are those of the commands run
    one by one (the in-memory store's)."""
    from queryqueue.engine.clock import ManualClock
    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    try:
        for target in (model, store):
            for key in ("p:a", "p:b", "p:c"):
                target.add(key, "{}")
            target.retrieve("p:c")
        script: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("retrieve", ("p:a",), {"concurrency": 5}),
            ("ack", (1, '"r"'), {}),  # p:a: active now, not pending as read ahead
            ("ack", (2, '"r"'), {}),
            ("ack", (2, '"again"'), {}),  # gone: not found
            ("heartbeat", (3,), {}),
            ("ack", (3, None), {}),
        ]
        expected = [getattr(model, name)(*args, **kw) for name, args, kw in script]

        def work() -> list[Any]:
            store.expect([(name, args) for name, args, _ in script])
            return [getattr(store, name)(*args, **kw) for name, args, kw in script]

        assert store.batched(work, lambda _: None, prefix="p") == expected
        assert store.result(2) == model.result(2)
        # The counts each store keeps (a stale read counted p:a as pending when it went).
        assert store.add("p:d", "{}") == model.add("p:d", "{}")
        assert store.retrieve("p:d") == model.retrieve("p:d")
    finally:
        store.close()


def test_an_add_takes_an_id_ahead_only_when_it_inserts() -> None:
    """The id a pipelined ADD takes with its reads (`nextval`, never rolled back) is taken
    only when the ADD inserts: joining an item, joining an unread result (its external id
    matching or absent), or refused for an external id taken, it takes none, so the ids
    are those the in-memory store gives, with no gaps."""
    from queryqueue.engine.clock import ManualClock
    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    model = MemoryQueueStore(clock=ManualClock())
    store = postgres_store(clock=model.clock)
    script: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("add", ("p:a", "{}"), {"external_id": "e1"}),
        ("add", ("p:a", "{}"), {"if_no_result": True}),  # joins the item
        ("ack", ("p:a", '"r1"'), {}),
        ("add", ("p:a", "{}"), {"if_no_result": True, "external_id": "e2"}),  # not e1's result
        ("ack", ("p:a", '"r2"'), {}),
        ("add", ("p:a", "{}"), {"if_no_result": True}),  # joins the unread result
        ("result", ("p:a",), {}),  # read by path: consumed
        ("add", ("p:a", "{}"), {"if_no_result": True}),  # nothing unread: inserts
        ("add", ("p:b", "{}"), {"external_id": "e3"}),
        ("add", ("p:c", "{}"), {"external_id": "e3"}),  # refused
        ("add_and_retrieve", ("p:d", "{}", 5), {"if_no_result": True}),
        ("add", ("p:e", "{}"), {}),
        ("ack", ("p:a", '"r3"'), {}),
        ("result", ("p:a",), {}),  # consumed
        ("add", ("p:a", "{}"), {"if_no_result": True, "max_age_ms": 60_000}),  # joins it
        ("add", ("p:a", "{}"), {"max_age_ms": 60_000}),  # asks no result: inserts
    ]
    try:
        for name, args, kwargs in script:
            expected = answers_or_errors(functools.partial(getattr(model, name), *args, **kwargs))
            command = functools.partial(getattr(store, name), *args, **kwargs)
            got = store.batched(lambda c=command: answers_or_errors(c), lambda _: None)
            if isinstance(expected[0], Exception):
                assert type(got[0]) is type(expected[0]), (name, args, got)
            else:
                assert got == expected, (name, args, kwargs)
        assert [row.id for row in store.pending("p")] == [row.id for row in model.pending("p")]
    finally:
        store.close()


def test_adds_with_a_max_age_read_ahead_join_or_insert_as_one_by_one() -> None:
    """A batch's ADDs with a max age, read with its first statements: one whose path's
    result was read already but is young enough joins it, taking no id; one whose result
    is too old inserts with the id it read ahead; the answers are the in-memory store's."""
    from queryqueue.engine.clock import ManualClock
    from queryqueue.engine.memory_store import MemoryQueueStore
    from tests.postgres_util import postgres_store

    clock = ManualClock()
    model = MemoryQueueStore(clock=clock)
    store = postgres_store(clock=clock)
    try:
        for target in (model, store):
            for key in ("p:young", "p:old"):
                target.ack(target.add(key, "{}").id, '"r"')
                target.result(key)  # read by path: consumed
        clock.advance(30_000)
        script: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
            ("add", ("p:young", "{}"), {"if_no_result": True, "max_age_ms": 60_000}),
            ("add", ("p:old", "{}"), {"if_no_result": True, "max_age_ms": 20_000}),
            ("add", ("p:new", "{}"), {"if_no_result": True, "max_age_ms": 60_000}),
        ]
        expected = [getattr(model, name)(*args, **kw) for name, args, kw in script]
        assert [(a.id, a.added) for a in expected] == [(1, False), (3, True), (4, True)]

        def work() -> list[Any]:
            store.expect([(name, args, kw) for name, args, kw in script])
            return [getattr(store, name)(*args, **kw) for name, args, kw in script]

        assert store.batched(work, lambda _: None, prefix="p") == expected
        assert store.add("p:next", "{}") == model.add("p:next", "{}")  # no gap before it
    finally:
        store.close()


async def test_a_store_is_not_woken_by_its_own_notify_but_by_another_hosts() -> None:
    """An ACK wakes its own store's waiters as it commits, with the result: the NOTIFY it
    also sends, back on that store's listener, is for the other hosts only (it would wake
    them a second time, with no result to read back)."""
    import orjson

    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        waiter = store.waiters.subscribe("p:a")
        note = {"id": 1, "path": "p:a", "null": False, "ext": None}
        store._publish(orjson.dumps({**note, "from": store.origin}).decode())
        assert not waiter.future.done()
        store._publish(orjson.dumps({**note, "from": "another host"}).decode())
        assert waiter.future.done() and waiter.future.result().id == 1
    finally:
        store.close()


@pytest.mark.parametrize("refused_by", ["the check", "the unique index"])
def test_a_conflict_in_a_pipelined_batch_is_its_commands_error_alone(
    monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    """A batch's first run is pipelined without savepoints. An ADD whose external id is
    taken by another prefix's item fails before writing (the check), or, when another
    host took it meanwhile, is refused by the database (the unique index): then the batch
    runs again guarded. Either way the conflict is that ADD's error alone, the others
    commit, the counts hold, and the connection is back out of autocommit."""
    from queryqueue.driver_postgres.transaction import PostgresTransaction
    from queryqueue.engine.errors import ExternalIdConflictError
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        store.add("q:x", "{}", external_id="e1")
        statements = _recording(store, monkeypatch)
        if refused_by == "the unique index":
            monkeypatch.setattr(PostgresTransaction, "external_id_taken", lambda *_: False)
        answers = store.batched(
            lambda: answers_or_errors(
                lambda: store.add("p:a", "{}"),
                lambda: store.add("p:b", "{}", external_id="e1"),
                lambda: store.add("p:c", "{}"),
            ),
            lambda _: None,
        )
        monkeypatch.undo()
        assert answers[0].added and answers[2].added
        assert isinstance(answers[1], ExternalIdConflictError)
        runs_again = refused_by == "the unique index"
        # The pipelined run's own BEGIN; the guarded run's is psycopg's (not recorded).
        assert statements.count("BEGIN") == 1
        assert ("SAVEPOINT command" in statements) is runs_again
        assert [row.id for row in store.pending("p")] == ["a", "c"]
        assert store.add("p:d", "{}").pending == 3
        assert not store.connection().autocommit
    finally:
        store.close()


def test_a_pipelined_batchs_statements_read_as_psycopgs_cursors_would() -> None:
    """A pipelined batch sends its statements through its Lean (lean.py): each prepared
    once per connection, its parameters as text, its answer read as a cursor's (rows one
    by one, the rest, the row count); a parameter of another type (a list) runs through
    psycopg's own `execute`; `%(name)s` used twice is one parameter."""
    import psycopg

    from queryqueue.driver_postgres.lean import Answer, numbered
    from tests.postgres_util import postgres_store

    assert numbered("a = %(x)s AND b = %(y)s OR c = %(x)s") == (
        b"a = $1 AND b = $2 OR c = $1",
        ("x", "y"),
    )
    assert numbered("VALUES (%s, %s)") == (b"VALUES ($1, $2)", 2)
    assert numbered("SELECT %s %% 7") == (b"SELECT $1 % 7", 1)
    with pytest.raises(ValueError, match="mixes"):
        numbered("%s and %(x)s")
    store = postgres_store()
    try:

        def work() -> list[Any]:
            lean = store._local.batch.lean
            assert lean is not None
            rows = lean.execute(
                "SELECT g, %s::text, %s::boolean, %s::bigint FROM generate_series(1, 3) g",
                (None, True, 2**40),
            )
            named = lean.execute("SELECT %(a)s::int + %(a)s::int, %(b)s::text", {"a": 2, "b": "é"})
            listed = lean.execute("SELECT %s::text[]", (["x", "y,z"],))
            assert isinstance(rows, Answer) and not isinstance(listed, Answer)
            # A NUL would cut a text parameter short in libpq: psycopg refuses it, as ever.
            with pytest.raises(psycopg.DataError, match="NUL"):
                lean.execute("SELECT %s::text", ("a\x00b",))
            return [
                rows.fetchone(),
                rows.fetchone(),
                rows.fetchall(),
                rows.fetchone(),
                rows.rowcount,
                named.fetchone(),
                listed.fetchone(),
            ]

        assert store.batched(work, lambda _: None) == [
            (1, None, True, 2**40),
            (2, None, True, 2**40),
            [(3, None, True, 2**40)],
            None,
            3,
            (4, "é"),
            (["x", "y,z"],),
        ]
    finally:
        store.close()


def test_a_statement_prepared_in_a_pipeline_that_failed_is_prepared_again() -> None:
    """A statement is the connection's, under its name, once the server answered its
    PREPARE: one whose PREPARE the pipeline skipped (an earlier statement failed) is
    prepared again by the next batch that runs it, and every name the store counts on
    is one the server holds."""
    from queryqueue import StoreError
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        sent: list[Any] = []

        def failing() -> None:
            lean = store._local.batch.lean
            sent.append(lean.execute("SELECT %s::int", (1,)))
            sent.append(lean.execute("SELECT 1 / %s::int", (0,)))
            sent.append(lean.execute("SELECT %s::text", ("skipped",)))
            sent[-1].fetchone()

        with pytest.raises(StoreError, match="division by zero"):
            store.batched(failing, lambda _: None)
        conn = store.connection()
        believed = store._statements._by_conn[conn].names
        assert "SELECT %s::int" in believed and "SELECT %s::text" not in believed
        held = {row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")}
        conn.rollback()  # left idle, as a batch leaves it
        assert {name.decode() for name in believed.values()} <= held

        def again() -> Any:
            return store._local.batch.lean.execute("SELECT %s::text", ("again",)).fetchone()

        assert store.batched(again, lambda _: None) == ("again",)
        assert "SELECT %s::text" in believed
    finally:
        store.close()


def test_before_commit_runs_as_the_commit_leaves_not_after_it_is_answered() -> None:
    """`before_commit` inside a batch: called once, on the batch's thread, after its
    commands ran and before its COMMIT went (another connection does not see its writes
    yet); outside a batch, never. What a server hands its workers then runs while the
    COMMIT makes its round trip."""
    import psycopg
    from psycopg import sql

    from tests.postgres_util import postgres_store

    store = postgres_store()
    seen: list[tuple[int, bool]] = []
    try:
        with psycopg.connect(URL, autocommit=True) as other:
            count = sql.SQL("SELECT count(*) FROM {}.items WHERE key = 'a'").format(
                sql.Identifier(store.schema)
            )

            def committing() -> None:
                row = other.execute(count).fetchone()
                assert row is not None
                seen.append((row[0], threading.current_thread() is threading.main_thread()))

            store.before_commit(lambda: seen.append((-1, False)))  # not in a batch: dropped

            def work() -> Any:
                store.before_commit(committing)
                return store.add("p:a", "{}")

            added = store.batched(work, lambda _: None)
            assert added.added
            assert seen == [(0, True)]  # once, here, before the COMMIT: nothing to see yet
            row = other.execute(count).fetchone()
            assert row is not None and row[0] == 1
    finally:
        store.close()


async def test_a_fast_tracked_query_goes_to_its_worker_before_its_batch_is_answered(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL a batch commits on a lane; the item its ADD_AND_RETRIEVE retrieved
    goes to the pool as the COMMIT leaves (`before_commit`), before the loop hears the
    batch is done, not when it settles the batch; handed over once, and the query
    answers."""
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    order: list[Any] = []
    async with pool_server(postgres_store(), workdir) as (server, pool, queue):
        submit, settle = pool.submit, server.runner.settle

        def submitting(prefix: str, retrieved: Any) -> None:
            order.append(("hand-off", retrieved.queue_id))
            submit(prefix, retrieved)

        def settling(batch: list[Any], *rest: Any) -> None:
            order.append(("settled", [r.method for r in batch]))
            settle(batch, *rest)

        monkeypatch.setattr(pool, "submit", submitting)
        monkeypatch.setattr(server.runner, "settle", settling)
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
    assert answer["key"] == "urgent"
    handed = [i for i, (kind, _) in enumerate(order) if kind == "hand-off"]
    assert len(handed) == 1, order
    fast = next(
        i
        for i, (kind, what) in enumerate(order)
        if kind == "settled" and "add_and_retrieve" in what
    )
    assert handed[0] < fast, order


async def test_a_batch_run_again_after_its_early_hand_off_answers_and_leaves_nothing(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast track's item went to the worker as the batch's COMMIT was leaving, and the
    batch did not commit: it runs again (guarded), and its item, inserted again under
    another id, goes to the pool too. The first hand-off ran a query of nothing (its ACK
    found no item); the caller gets its answer, and nothing is left queued or held."""
    from queryqueue.driver_postgres import batch as batch_module
    from queryqueue.driver_postgres import store as pg
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    commit = pg.PostgresQueueStore._commit_in_pipeline
    failed: list[int] = []

    def fails_once(batch: Any, ending: Any) -> None:
        if batch.wrote and not failed:  # the ADD_AND_RETRIEVE's (nothing else writes)
            failed.append(1)
            raise batch_module.Redo  # as a write refused at the pipeline's end would
        commit(batch, ending)

    async with pool_server(postgres_store(), workdir) as (server, pool, queue):
        store = server.store
        monkeypatch.setattr(pg.PostgresQueueStore, "_commit_in_pipeline", staticmethod(fails_once))
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
        monkeypatch.undo()
        assert answer["key"] == "urgent"
        assert failed == [1]
        assert pool.describe()["handed_off"] == 2  # the phantom and the real one
        await wait_until(lambda: not pool.running() and not pool.describe()["backlog"])
        assert store.pending(queue.prefix) == [] and store.active(queue.prefix) == []
    starts = [t for t in read_trace(workdir) if t[0] == "start"]
    assert len(starts) == 2


async def test_a_fast_tracked_querys_batch_reads_no_pending_head_for_the_pool(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADD_AND_RETRIEVE retrieves what it adds while the prefix has room, so its batch
    sends no read of PENDING's head for the pool ahead (an idle query's batch read it for
    nothing); nor does the ACK's, which frees a slot, as that batch left nothing pending
    (`nothing_pending_seen`)."""
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with pool_server(postgres_store(), workdir) as (_, _pool, queue):
        await queue.driver.call("ping")
        statements = _recording_pipelined(monkeypatch)
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
        monkeypatch.undo()
    assert answer["key"] == "urgent"
    transactions: list[list[str]] = []
    current: list[str] = []
    for statement in statements:
        current.append(statement)
        if statement == "COMMIT":
            transactions.append(current)
            current = []
    head = _HEAD_READ
    added = [t for t in transactions if any(s.startswith("INSERT INTO items") for s in t)]
    acked = [t for t in transactions if any(s.startswith("DELETE FROM items") for s in t)]
    assert len(added) == 1 and len(acked) == 1, transactions
    assert not [s for s in added[0] if head in s], added[0]
    assert not [s for s in acked[0] if head in s], acked[0]


def test_a_schema_name_postgresql_would_fold_is_refused_before_anything_is_written(
    workdir: Path,
) -> None:
    """Migrations quote a schema's name and sessions do not: "MixedCase" would be created
    as itself and used as "mixedcase", writing into another queue's tables. Only
    lower-case identifiers are taken, by the store and by the command line."""
    import subprocess
    import sys

    from queryqueue.driver_postgres import store as pg

    for name in ("MixedCase", "1st", "a-b", "x" * 64):
        with pytest.raises(ValueError, match="lower-case identifier"):
            pg.PostgresQueueStore("postgresql://nowhere.invalid/none", schema=name)
    refused = subprocess.run(
        [
            sys.executable, "-m", "queryqueue", "supervisor", "--store", URL,
            "--schema", "MixedCase", "--socket", str(workdir / "s.sock"),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--schema: a queue schema is a lower-case" in refused.stderr


def test_a_password_never_comes_from_the_command_line(workdir: Path) -> None:
    """Every local user reads the process list: a URL with a password is refused on the
    command line (without echoing it), and taken from --store-url-file or
    $QUERYQUEUE_STORE. (A bad --schema stops each run right after the URL is read.)"""
    import subprocess
    import sys

    secret = "postgresql://queue:hunter2@127.0.0.1:5432/queue"

    def supervisor(*options: str, env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            [sys.executable, "-m", "queryqueue", "supervisor", "--socket",
             str(workdir / "s.sock"), "--schema", "Bad", *options],
            capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
        )  # fmt: skip

    refused = supervisor("--store", secret)
    assert refused.returncode == 2 and "holds a password" in refused.stderr
    assert "hunter2" not in refused.stderr
    url_file = workdir / "store.url"
    url_file.write_text(secret + "\n")
    url_file.chmod(0o600)
    for taken in (supervisor("--store-url-file", str(url_file)),
                  supervisor(env={"QUERYQUEUE_STORE": secret})):  # fmt: skip
        assert taken.returncode == 2 and "--schema: a queue schema" in taken.stderr
    missing = supervisor("--store-url-file", str(workdir / "nothing"))
    assert missing.returncode == 2 and "--store-url-file:" in missing.stderr
