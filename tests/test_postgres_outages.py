"""A PostgreSQL queue under outages: large results across hosts, a frozen or terminated
connection, a restart under load, a batch whose connection dies, a database error inside
a batch."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import SocketQueueDriver, StoreError
from tests.batches import answers_or_errors
from tests.pool_util import ask
from tests.postgres_hosts_util import ask_sql, pool_host, two_pool_hosts, until_done
from tests.postgres_util import URL, Proxy, pg_host
from tests.trace import read_trace
from tests.waiting import wait_until


async def _adds(driver: SocketQueueDriver) -> int:
    commands = (await driver.stats())["commands"]
    return sum(int(commands.get(c, {}).get("count", 0)) for c in ("add", "add_and_retrieve"))


async def _ask_through_errors(queue: Any, key: str, seconds: float) -> Any:
    """A caller that asks again after a StoreError (the database is away), as one would."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await ask_sql(queue, key, seconds)
        except StoreError:
            assert time.monotonic() < deadline, f"no result for {key}"
            await asyncio.sleep(0.1)


def _terminate(psycopg: Any, pid: int) -> None:
    with psycopg.connect(URL, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the backend did not go away"
            time.sleep(0.01)


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
    async with two_pool_hosts(workdir, schema) as (hosts, drivers, queues):
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
            assert (await until_done(driver.add, "p:c", "{}")).added
            pending = {row.id for row in await until_done(driver.pending, "p")}
            assert {"a", "c"} <= pending  # what was committed before the freeze is there
        finally:
            await driver.close()
            assert host.stop() == 0
    finally:
        proxy.close()


@contextlib.asynccontextmanager
async def _proxied_pool_host(
    workdir: Path, schema: str, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[Proxy, SocketQueueDriver, Any]]:
    """A supervisor with a pool, its database behind a proxy: (the proxy, a driver on the
    supervisor, a pool queue on it); all stopped (the supervisor by its pid) afterwards."""
    from tests.apps.pool_app import app

    proxy = Proxy()
    try:
        host = pool_host(workdir, "a", schema, url=proxy.url, env=env)
        driver = SocketQueueDriver(host.socket_path)
        queue = app.pool_queue(driver, continue_wait_timeout=30.0)
        try:
            yield proxy, driver, queue
        finally:
            await queue.shutdown(grace=0)
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
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with _proxied_pool_host(workdir, schema) as (proxy, driver, queue):
        keys = [f"r{i}" for i in range(10)]
        asks = [asyncio.ensure_future(_ask_through_errors(queue, key, 0.4)) for key in keys]
        await wait_until(lambda: read_trace(workdir) != [], within=30)  # queries run
        proxy.cut()
        await asyncio.sleep(2.0)  # the outage itself, not a wait for something
        proxy.resume()
        answers = await asyncio.wait_for(asyncio.gather(*asks), 60)
        assert [answer["key"] for answer in answers] == keys
        started = [event[1] for event in read_trace(workdir) if event[0] == "start"]
        assert sorted(started) == sorted(keys), "a query ran twice, or never"
        assert await until_done(driver.active, "sql") == []
        assert await until_done(driver.pending, "sql") == []


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


async def test_a_short_cut_under_steady_load_is_over_within_seconds_of_the_outage(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten queries a second, heartbeats every 30 s (a stall timeout of two minutes), and
    the database away for 2 s in the middle: every caller has its answer within 10 s of
    the database's return, none waits out a command timeout (a `CommandTimeoutError`
    fails the test), and every query ran once."""
    import os

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    env = {**os.environ, "POOL_HEARTBEAT": "30"}
    async with _proxied_pool_host(workdir, schema, env) as (proxy, _, queue):
        keys = [f"s{i}" for i in range(60)]
        answered: dict[str, float] = {}

        async def caller(i: int, key: str) -> None:
            await asyncio.sleep(i * 0.1)
            assert (await _ask_through_errors(queue, key, 0.1))["key"] == key
            answered[key] = time.monotonic()

        callers = asyncio.gather(*(caller(i, key) for i, key in enumerate(keys)))
        await asyncio.sleep(2.0)  # under load
        proxy.cut()
        await asyncio.sleep(2.0)  # the outage itself, not a wait for something
        proxy.resume()
        back = time.monotonic()
        await asyncio.wait_for(callers, 60)
        late = {k: round(t - back, 1) for k, t in answered.items() if t - back > 10}
        assert not late, f"answered more than 10 s after the database was back: {late}"
        started = [event[1] for event in read_trace(workdir) if event[0] == "start"]
        assert sorted(started) == sorted(keys), "a query ran twice, or never"
