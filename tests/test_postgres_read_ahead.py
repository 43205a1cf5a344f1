"""What a PostgreSQL batch read ahead, when it is read again: an idle queue, a full head,
rows changed in the batch, ids taken ahead only for inserts, conflicts in a pipelined
batch."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue.engine.clock import ManualClock
from tests.batches import answers_or_errors
from tests.pool_util import ask, pool_server
from tests.postgres_hosts_util import HEAD_READ, pipelined_statements, recorded_statements
from tests.postgres_util import URL
from tests.trace import read_trace
from tests.waiting import wait_until


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
        return [s for s in statements if HEAD_READ in s]

    try:
        async with pool_server(store, workdir) as (_, _, queue):
            prefix = queue.prefix
            await ask(queue, "sql", "first", {"key": "first", "seconds": 0}, priority=10)
            await wait_until(lambda: store.nothing_pending_seen(prefix), within=30)
            statements = pipelined_statements(monkeypatch)
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
        statements = recorded_statements(store, monkeypatch)
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
