"""Several supervisors on one PostgreSQL queue: how a waiter learns of an ACK (on its own
host, or by LISTEN/NOTIFY from another), and how a lock or a lost answer held elsewhere
is borne."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from queryqueue import SocketQueueDriver, StoreError
from queryqueue.engine.clock import ManualClock
from tests.postgres_hosts_util import recorded_statements
from tests.postgres_util import URL, Proxy, break_store_connections, lock_waiters, pg_host
from tests.recording import record_calls, record_returns
from tests.waiting import wait_until, wait_until_sync


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
    starts listening says so (its hello), and ACKs of its queries notify again until it
    has gone."""
    from queryqueue.driver_postgres import listening
    from queryqueue.driver_postgres import store as pg

    monkeypatch.setattr(listening, "LISTEN_CHECK_S", 0.2)
    a = pg.PostgresQueueStore(URL, schema=schema)
    try:
        wait_until_sync(lambda: not a.others_listen, within=30, what="a counted alone")
        statements = recorded_statements(a, monkeypatch)
        assert a.ack(a.add("p:one", "{}").id, '"r1"').success
        assert any(s.startswith("INSERT INTO results") for s in statements), statements
        assert not [s for s in statements if "pg_notify" in s]
        b = pg.PostgresQueueStore(URL, schema=schema)
        try:
            wait_until_sync(lambda: a.others_listen, within=30, what="a heard of b")
            published = record_calls(monkeypatch, b, "_publish")
            two = b.add("p:two", "{}").id
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
    looks = record_returns(monkeypatch, b, "_lookup")  # what each of b's looks found
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
