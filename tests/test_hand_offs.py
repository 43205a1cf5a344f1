"""A query handed to its worker before its batch commits or is answered, and what is left
when that batch fails; a worker's next query started before its last ACK is answered."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from queryqueue import QueueError, SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.answering import Answers
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.core.slots import Slots
from queryqueue.supervisor.loop_runner import LoopRunner
from queryqueue.supervisor.pool import WorkerPool
from tests.hot_path_util import on_loop, sql_query, started_keys
from tests.sqlite_util import committed
from tests.trace import read_trace
from tests.waiting import wait_until


def _starts(workdir: Path) -> list[str]:
    return [t[1] for t in read_trace(workdir) if t[0] == "start"]


async def test_on_sqlite_a_fast_tracked_query_goes_to_its_worker_before_its_batch_commits(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The item ADD_AND_RETRIEVE retrieved goes to the pool as the batch's COMMIT starts
    (`before_commit`), so the worker starts while SQLite writes its WAL: handed over once,
    before another connection can see it, and the query answers."""
    from queryqueue import SqliteQueueStore
    from tests.pool_util import pool_server

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    db = tmp_path / "q.db"
    handed: list[tuple[int, bool]] = []
    async with pool_server(SqliteQueueStore(db), workdir) as (_, pool, queue):
        submit = pool.submit

        def submitting(prefix: str, retrieved: Any) -> None:
            handed.append((retrieved.queue_id, committed(db, retrieved.queue_id)))
            submit(prefix, retrieved)

        monkeypatch.setattr(pool, "submit", submitting)
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
    assert answer["key"] == "urgent"
    assert len(handed) == 1 and handed[0][1] is False, handed


async def test_on_sqlite_a_batch_that_fails_to_commit_after_its_hand_off_leaves_nothing(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast track's item went to the worker as the batch's COMMIT started, and the
    COMMIT failed: the caller hears of it, the worker ran a query of nothing (its ACK found
    no item), and nothing is left queued, active or held. The failed batch's id is never
    given again (driver_sqlite/ids.py): the next item takes another, runs its own query
    and answers (under the same id, its ACK could have been the phantom's)."""
    from queryqueue import SqliteQueueStore
    from tests.pool_util import pool_server

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = SqliteQueueStore(tmp_path / "q.db")
    commit, failed = store._commit, list[int]()
    handed: list[int] = []

    def fails_after_a_hand_off() -> None:
        if handed and not failed:
            failed.append(1)
            raise sqlite3.OperationalError("disk I/O error")
        commit()

    async with pool_server(store, workdir) as (_, pool, queue):
        submit = pool.submit

        def submitting(prefix: str, retrieved: Any) -> None:
            handed.append(retrieved.queue_id)
            submit(prefix, retrieved)

        monkeypatch.setattr(pool, "submit", submitting)
        monkeypatch.setattr(store, "_commit", fails_after_a_hand_off)
        with pytest.raises(QueueError):
            await queue.execute_in_queue("sql", "lost", {"key": "lost", "seconds": 0}, priority=10)
        assert failed == [1] and len(handed) == 1
        await wait_until(lambda: not pool.running() and not pool.describe()["backlog"])
        assert store.pending(queue.prefix) == [] and store.active(queue.prefix) == []
        answer = await queue.execute_in_queue(
            "sql", "next", {"key": "next", "seconds": 0}, priority=10
        )
        assert answer["key"] == "next"
    assert len(handed) == 2 and handed[1] > handed[0], handed
    starts = [t[1] for t in read_trace(workdir) if t[0] == "start"]
    assert starts == ["lost", "next"], starts


def _record_writes(monkeypatch: pytest.MonkeyPatch, iteration: list[int]) -> list[tuple[str, int]]:
    """(method, loop iteration) of every answer, in the order its connection wrote it."""
    unwritten: dict[int, list[str]] = {}  # id(connection) -> methods answered, not written
    written: list[tuple[str, int]] = []
    answer, flush = Answers.answer, Connection.flush

    def answering(answers: Answers, request: Any, *args: Any, **options: Any) -> None:
        unwritten.setdefault(id(request.connection), []).append(request.method)
        answer(answers, request, *args, **options)

    def flushing(connection: Any) -> None:
        if connection.outbox:
            written.extend((m, iteration[0]) for m in unwritten.pop(id(connection), []))
        flush(connection)

    monkeypatch.setattr(Answers, "answer", answering)
    monkeypatch.setattr(Connection, "flush", flushing)
    return written


def _schedule_a_pass_before_acks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write pass scheduled earlier in the loop iteration of every turn with an ACK."""
    execute_turn = LoopRunner.execute_turn

    def after_a_pass(runner: LoopRunner) -> None:
        server = runner.server
        waiting = [*server.inbox.freeing, *server.inbox.queued]
        if any(r.method == "ack" for r in waiting) and server.connections:
            server.flush_soon(next(iter(server.connections)))  # nothing to write
        execute_turn(runner)

    monkeypatch.setattr(LoopRunner, "execute_turn", after_a_pass)


@pytest.mark.parametrize("pass_pending", [False, True], ids=["alone", "pass-pending"])
async def test_an_acks_woken_long_poll_is_written_before_its_workers_ack_answer(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pass_pending: bool
) -> None:
    """The answers of a loop iteration leave in one write pass, callers' first: the long
    poll an ACK woke (its waiter's callback runs an iteration after the ACK's batch) is
    written in the same pass as the worker's ACK answer, ahead of it, not an iteration
    behind it (each write that wakes a process costs the loop tens of microseconds).
    `pass-pending`: a write pass was scheduled earlier in the ACK's loop iteration (as an
    ADD's deferred answer released by its timer does on a loaded machine): it goes after
    the polls the ACK woke, not before them."""
    from tests.pool_util import pool_server

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    iteration, counting = [0], [True]
    written = _record_writes(monkeypatch, iteration)
    if pass_pending:
        _schedule_a_pass_before_acks(monkeypatch)
    loop = asyncio.get_running_loop()

    def count_iterations() -> None:
        iteration[0] += 1
        if counting[0]:
            loop.call_soon(count_iterations)

    async with pool_server(SqliteQueueStore(tmp_path / "q.db"), workdir) as (_, _pool, queue):
        loop.call_soon(count_iterations)
        try:
            for key in ("first", "second", "third"):
                del written[:]
                value = await queue.execute_in_queue(
                    "sql", key, {"key": key, "seconds": 0}, priority=10
                )
                assert value["key"] == key
                await wait_until(lambda: any(m == "ack" for m, _ in written), what=str(written))
                ends = [(m, i) for m, i in written if m in ("result_blocking", "ack")]
                assert [m for m, _ in ends] == ["result_blocking", "ack"], written
                assert ends[0][1] == ends[1][1], written  # in one pass
        finally:
            counting[0] = False


async def test_a_worker_starts_its_next_query_before_its_last_acks_answer(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next query goes to a worker as the batch with its last ACK starts to commit,
    and the worker starts it at once: here that ACK's answer is held back until the next
    query has started (a worker that waited for it would never start it), then sent, and
    both queries answer, each run once, by the one worker, one at a time."""
    from queryqueue import SqliteQueueStore
    from tests.pool_util import pool_server
    from tests.trace import max_overlap

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    held: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    answer = Answers.answer

    def holding_the_first_ack(answers: Answers, request: Any, *args: Any, **kw: Any) -> None:
        if request.method == "ack" and not held:
            held.append((request, args, kw))
            return
        answer(answers, request, *args, **kw)

    def started() -> list[str]:
        return [t[1] for t in read_trace(workdir) if t[0] == "start"]

    monkeypatch.setattr(Answers, "answer", holding_the_first_ack)
    async with pool_server(SqliteQueueStore(tmp_path / "q.db"), workdir, workers=1) as (
        server,
        pool,
        queue,
    ):
        runs = [
            asyncio.ensure_future(queue.execute_in_queue("sql", key, {"key": key, "seconds": 0.01}))
            for key in ("a", "b")
        ]
        await wait_until(lambda: held, what="the first ACK")
        await wait_until(lambda: len(started()) == 2, what=f"the next start: {started()}")
        request, args, kw = held[0]
        answer(server.answers, request, *args, **kw)
        values = await asyncio.gather(*runs)
        assert sorted(v["key"] for v in values) == ["a", "b"]
        assert len({v["pid"] for v in values}) == 1
        await wait_until(lambda: not pool.running() and pool.held == 0)
    trace = read_trace(workdir)
    assert sorted(started()) == ["a", "b"], trace
    assert max_overlap(trace) == 1, trace


async def test_on_postgresql_the_pool_is_touched_only_on_the_loops_thread(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch runs on a lane (a thread of the store's) and hands its pool what it
    retrieved and the workers whose ACKs it carries (`WorkerPool.acking`) through the
    loop: the pool, the loop's, is never read or changed from a lane, where its backlog
    may be changing under the reader."""
    import threading

    from tests.pool_util import pool_server
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    threads: set[int] = set()
    for owner, name in [
        *((Slots, name) for name in ("holding", "assign", "acking", "acked", "submit", "job")),
        *((WorkerPool, name) for name in ("acking", "acked", "submit", "holds", "job")),
    ]:
        method = getattr(owner, name)

        def noting(self: Any, *args: Any, _method: Any = method, **kw: Any) -> Any:
            threads.add(threading.get_ident())
            return _method(self, *args, **kw)

        monkeypatch.setattr(owner, name, noting)
    async with pool_server(postgres_store(), workdir, workers=2) as (_, _pool, queue):
        values = await asyncio.gather(
            *(
                queue.execute_in_queue("sql", key, {"key": key, "seconds": 0.01})
                for key in [f"q{i}" for i in range(12)]
            )
        )
    assert sorted(v["key"] for v in values) == sorted(f"q{i}" for i in range(12))
    assert threads == {threading.get_ident()}


def _record_order(
    monkeypatch: pytest.MonkeyPatch, pool: Any, store: Any, order: list[tuple[str, str]]
) -> None:
    """Every hand-off to the pool and every ADD of the store, in `order`, by key."""
    submit, add = pool.submit, store.add

    def submitting(to: str, retrieved: Any) -> None:
        order.append(("hand-off", retrieved.query["query"]["key"]))
        submit(to, retrieved)

    def adding(path: str, *args: Any, **kw: Any) -> Any:
        order.append(("add", path.rpartition(":")[2]))
        return add(path, *args, **kw)

    monkeypatch.setattr(pool, "submit", submitting)
    monkeypatch.setattr(store, "add", adding)


@pytest.mark.parametrize("priority", [0, 10])
async def test_on_sqlite_an_acks_freed_slot_is_filled_before_the_rest_of_its_batch_runs(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, priority: int
) -> None:
    """A worker's ACK that arrived with a caller's ADD ahead of it runs first, and the
    slot it frees goes to the head of PENDING, handed to the worker, before the ADD runs
    (not as the batch's COMMIT leaves, after it). Unless the ADD may bring something more
    urgent than that head (`priority` 10 over 0): then the batch's end retrieves, and the
    urgent item goes first, as it always did."""
    from tests.pool_util import pool_server

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = SqliteQueueStore(tmp_path / "q.db")
    order: list[tuple[str, str]] = []
    async with pool_server(store, workdir, workers=2) as (server, pool, _):
        prefix = pool.prefix or ""
        caller = SocketQueueDriver(server.socket_path)
        try:
            await caller.add(f"{prefix}:first", sql_query("first", 1.0))
            await caller.add(f"{prefix}:long", sql_query("long", 30))
            await caller.add(f"{prefix}:queued", sql_query("queued", 0))
            await started_keys(workdir, 2)
            runner = on_loop(server)
            execute_turn = runner.execute_turn
            _record_order(monkeypatch, pool, store, order)
            held = [True]

            def held_turn() -> None:  # the turn runs once both have arrived
                if held[0]:
                    runner.turn = None
                else:
                    execute_turn()

            monkeypatch.setattr(runner, "execute_turn", held_turn)
            assert [r.id for r in store.pending(prefix)] == ["queued"]  # first still runs
            adding_later = asyncio.ensure_future(
                caller.add(f"{prefix}:later", sql_query("later", 0), priority=priority)
            )
            inbox = server.inbox  # the running workers' heartbeats may be there too

            def waiting() -> list[str]:
                return [r.method for r in (*inbox.freeing, *inbox.queued)]

            await wait_until(lambda: "add" in waiting(), what=str(waiting()))
            await wait_until(lambda: "ack" in waiting(), what=str(waiting()))
            held[0] = False
            runner.schedule()
            assert (await asyncio.wait_for(adding_later, 10)).added
            await wait_until(lambda: len(order) == 3, what=str(order))
            await wait_until(lambda: len(_starts(workdir)) == 4, what=str(read_trace(workdir)))
        finally:
            await caller.close()
    if priority == 0:
        assert order == [("hand-off", "queued"), ("add", "later"), ("hand-off", "later")]
    else:
        assert order == [("add", "later"), ("hand-off", "later"), ("hand-off", "queued")]
    starts = _starts(workdir)
    handed = [key for kind, key in order if kind == "hand-off"]
    assert sorted(starts[:2]) == ["first", "long"] and starts[2:] == handed
