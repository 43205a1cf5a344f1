"""The supervisor's hot path: parked polls on one timer, a fan-out encoded once, a batch
that ends where an idle pool gets work, no pool listing when nothing is pending."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import MemoryQueueStore, QueueError, SqliteQueueStore
from queryqueue.driver_socket import protocol
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.supervisor import answering
from queryqueue.supervisor.answering import Answers
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.core import requests
from queryqueue.supervisor.core.requests import Request
from queryqueue.supervisor.core.slots import Slots
from queryqueue.supervisor.loop_runner import LoopRunner
from queryqueue.supervisor.polls import ParkedPoll
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.settings import Settings
from tests.recording import record_calls
from tests.sqlite_util import committed
from tests.trace import read_trace
from tests.waiting import wait_until


class _Timer:
    def __init__(self, at: float, callback: Callable[[], None]) -> None:
        self.at, self.callback, self.cancelled = at, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class _Clock:
    """The two things Deadlines asks of its loop, with time moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[_Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, at: float, callback: Callable[[], None]) -> _Timer:
        self.timers.append(_Timer(at, callback))
        return self.timers[-1]

    def armed(self) -> list[_Timer]:
        return [t for t in self.timers if not t.cancelled]

    def advance_to(self, when: float) -> None:
        self.now = when
        for timer in self.armed():
            if timer.at <= when:
                timer.cancelled = True
                timer.callback()


class _Poll:
    """What the parked polls' deadlines see of a ParkedPoll: `done`, and `cancel()`."""

    def __init__(self) -> None:
        self.done, self.timed_out = False, False

    def cancel(self) -> None:
        if not self.done:
            self.timed_out = self.done = True

    def answer(self) -> None:
        self.done = True


def _deadlines(clock: _Clock) -> Deadlines[_Poll]:
    return Deadlines(clock, expire=_Poll.cancel, live=lambda poll: not poll.done)  # type: ignore[arg-type]


def test_parked_polls_time_out_in_deadline_order_behind_one_timer() -> None:
    clock = _Clock()
    deadlines = _deadlines(clock)
    late, early, answered = _Poll(), _Poll(), _Poll()
    deadlines.add(late, 5.0)
    deadlines.add(early, 1.0)
    deadlines.add(answered, 2.0)
    # One timer, for the earliest deadline, whatever the order the polls parked in.
    assert [t.at for t in clock.armed()] == [101.0]
    answered.answer()
    clock.advance_to(101.0)
    assert (early.timed_out, late.timed_out) == (True, False)
    # The answered poll's deadline passes without a word; the timer goes on to the next.
    assert [t.at for t in clock.armed()] == [102.0]
    clock.advance_to(102.0)
    assert (answered.timed_out, late.timed_out) == (False, False)
    clock.advance_to(105.0)
    assert late.timed_out and clock.armed() == []
    assert len(deadlines) == 0


def test_answered_polls_do_not_pile_up_in_the_heap() -> None:
    clock = _Clock()
    deadlines = _deadlines(clock)
    for _ in range(5000):
        poll = _Poll()
        deadlines.add(poll, 60.0)
        poll.answer()
    assert len(deadlines) <= 1025
    assert len(clock.armed()) == 1


async def test_an_ack_answers_every_poll_it_wakes_with_one_encoding(
    server: QueueServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dedup storm's waiters: each gets the answer under its own request id, and the
    answer is encoded once for all of them."""
    encoded = record_calls(monkeypatch, answering, "encode_body")
    callers = [SocketQueueDriver(server.socket_path) for _ in range(3)]
    try:
        added = await callers[0].add("p:k", orjson.dumps({"q": 1}).decode())
        polls = [
            asyncio.ensure_future(caller.result_blocking(added.id, 30_000))
            for caller in callers
            for _ in range(4)
        ]
        await wait_until(
            lambda: server.store.waiters.count() == 12, what="the twelve long polls parked"
        )
        assert (await callers[0].ack(added.id, '{"rows": [1, 2, 3]}')).success
        answers = await asyncio.wait_for(asyncio.gather(*polls), 10)
    finally:
        for caller in callers:
            await caller.close()
    assert [orjson.loads(a.payload or "null") for a in answers if a] == [{"rows": [1, 2, 3]}] * 12
    assert all(a is not None and a.id == added.id for a in answers)
    assert len(encoded) == 1


def _park(
    store: MemoryQueueStore, key: int, deadlines: Deadlines[Any], answered: list[bool]
) -> None:
    """A poll parked as the server parks one: its `finish` is a closure that holds it."""

    def finish(ok: bool, answer: Any, event: Any) -> None:
        answered.append(poll.done)

    poll = ParkedPoll(store, key, 30_000, store.waiters.subscribe(key), finish, deadlines)


@pytest.mark.parametrize("ending", ["woken by its ACK", "timed out"])
async def test_an_answered_long_poll_leaves_no_reference_cycle(ending: str) -> None:
    """Once answered, a parked poll is freed by its reference count: under load a cycle
    per poll (the poll, the closure that answers it, its waiter's future) left ~10
    objects a query for the collector's full passes to find."""
    store, clock, answered = MemoryQueueStore(), _Clock(), list[bool]()
    deadlines: Deadlines[ParkedPoll] | None = Deadlines(
        clock,  # type: ignore[arg-type]
        expire=ParkedPoll.cancel,
        live=lambda poll: not poll.done,
    )
    added = store.add("p:k", "{}")
    assert deadlines is not None
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept to look at
    try:
        _park(store, added.id, deadlines, answered)
        if ending == "timed out":
            clock.advance_to(clock.now + 31)
        else:
            assert store.ack(added.id, '{"rows": [1]}').success
            await wait_until(lambda: answered, what="the poll answered")
        assert answered == [True] and store.waiters.count() == 0
        deadlines.close()  # its timer and its heap held the poll until now
        deadlines = None
        clock.timers.clear()
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, ParkedPoll)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []


@pytest.fixture
async def pooled(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A server whose pool (one worker, tests.apps.pool_app) runs on a store in memory."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=1)
    server = QueueServer(store, workdir / "s.sock", pool=pool)
    await server.start()
    try:
        await pool.start()
        yield server
    finally:
        await pool.stop(grace=0)
        await server.stop()
        store.close()


def _record_batches(server: QueueServer, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The commands of each batch the server answers, as (method, first argument)."""
    batches: list[list[Any]] = []
    answer_batch = server.answers.answer_batch

    def recording(batch: list[Any], answers: list[Any], **options: Any) -> None:
        batches.append([(r.method, r.args[0] if r.args else None) for r in batch])
        answer_batch(batch, answers, **options)

    monkeypatch.setattr(server.answers, "answer_batch", recording)
    return batches


async def test_a_batch_ends_at_the_add_that_gives_an_idle_pool_work(
    pooled: QueueServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ADD of a storm inserts the item an idle worker can run: its batch commits
    and hands it off before the joins that arrived with it run (they go next, first)."""
    batches = _record_batches(pooled, monkeypatch)
    assert pooled.pool is not None
    prefix = pooled.pool.prefix
    definition = orjson.dumps(
        {"queryHandler": "stubborn", "query": {"key": "storm"}, "priority": 0}
    ).decode()
    caller = SocketQueueDriver(pooled.socket_path)
    try:
        await caller.call("ping")
        # Sent in one loop turn: one write, read together, one batch without the change.
        adds = await asyncio.gather(
            *(caller.add(f"{prefix}:storm", definition) for _ in range(4)),
            caller.add(f"{prefix}:other", definition),
        )
    finally:
        await caller.close()
    assert [a.added for a in adds] == [True, False, False, False, True]
    assert len({a.id for a in adds[:4]}) == 1
    ours = [
        b for b in batches if any(arg in (f"{prefix}:storm", f"{prefix}:other") for _, arg in b)
    ]
    assert ours[0] == [("add", f"{prefix}:storm")]
    assert [c for b in ours[1:] for c in b] == [("add", f"{prefix}:storm")] * 3 + [
        ("add", f"{prefix}:other")
    ]


async def test_a_fast_tracked_query_lists_nothing_for_the_pool_in_its_own_batch(
    pooled: QueueServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADD_AND_RETRIEVE answered that nothing else is pending: its batch runs no pending
    listing for the pool (the ACK's batch still looks: it cannot know)."""
    from tests.apps.pool_app import app

    retrievals = record_calls(monkeypatch, pooled.transaction, "retrieve_for_pool")
    driver = SocketQueueDriver(pooled.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=10.0)
    try:
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
    assert answer["key"] == "urgent"
    assert len(retrievals) == 1


async def test_a_fast_tracked_hand_off_leaves_before_its_batchs_answers(
    pooled: QueueServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADD_AND_RETRIEVE's item goes to the pool with the batch's other hand-offs, before
    any of the batch's answers is written: behind an ADD that came first in its batch it
    would wait for that answer (the queued path's retrieval never did)."""
    assert pooled.pool is not None
    prefix, order = pooled.pool.prefix, []
    submit, queue_frame = pooled.pool.submit, Connection._queue

    def submitting(prefix: str, retrieved: Any) -> None:
        order.append(("hand-off", retrieved.queue_id))
        submit(prefix, retrieved)

    def queueing(connection: Any, frame: bytes, **options: Any) -> None:
        order.append(("answer", orjson.loads(frame[protocol.HEADER.size :]).get("id")))
        queue_frame(connection, frame, **options)

    monkeypatch.setattr(pooled.pool, "submit", submitting)
    monkeypatch.setattr(Connection, "_queue", queueing)
    batches = _record_batches(pooled, monkeypatch)
    definition = orjson.dumps({"queryHandler": "sql", "query": {"key": "u", "seconds": 0}})
    caller = SocketQueueDriver(pooled.socket_path)
    try:
        await caller.call("ping")
        del order[:]
        # Sent in one loop turn: one write, read together, one batch.
        _, urgent = await asyncio.gather(
            caller.add("elsewhere:first", "{}"),
            caller.add_and_retrieve(f"{prefix}:urgent", definition.decode(), 2),
        )
    finally:
        await caller.close()
    assert urgent.dispatched
    # Not echoed back: the caller sent the query, and the pool runs the store's copy.
    assert urgent.payload is None and urgent.extra is None
    assert [c for c, _ in batches[0]] == ["add", "add_and_retrieve"]
    assert order[0] == ("hand-off", urgent.id)
    assert [kind for kind, _ in order[1:3]] == ["answer", "answer"]


async def test_a_batch_run_again_with_savepoints_leaves_no_long_poll_of_its_first_run(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite runs a batch without savepoints first; an ACK failing after its write has the
    batch rolled back and run again, guarded. The long poll the first run subscribed for
    the pipelined ADD is forgotten: one waiter, the second run's, not two."""
    from queryqueue.driver_sqlite.transaction import SqliteTransaction

    store = SqliteQueueStore(tmp_path / "q.db")
    server = QueueServer(store, workdir / "s.sock")
    await server.start()
    caller = SocketQueueDriver(server.socket_path)
    try:
        done = (await caller.add("p:done", "{}")).id

        def refused(self: SqliteTransaction, result: object) -> None:
            raise sqlite3.OperationalError("insert_result refused")

        monkeypatch.setattr(SqliteTransaction, "insert_result", refused)
        batches = _record_batches(server, monkeypatch)
        added, acked = await asyncio.gather(
            caller.add("p:new", "{}", then_wait_ms=30_000),
            caller.ack(done, '{"r": 1}'),
            return_exceptions=True,
        )
        assert [c for c, _ in batches[-1]] == ["add", "result_blocking", "ack"]  # one batch
        assert isinstance(acked, QueueError) and "insert_result refused" in str(acked)
        assert not isinstance(added, BaseException) and added.added
        assert store.waiters.count() == 1
        assert [r.id for r in store.pending("p")] == ["done", "new"]  # the ACK undone alone
    finally:
        await caller.close()
        await server.stop()
        store.close()


def _request(connection: object, method: str, n: int) -> Any:
    """A bare request of `connection`'s, its id and argument `n`: for the batch orders."""
    return Request(connection, n, method, [n], {}, None, 0.0)


def test_a_batch_runs_the_acks_connections_last_on_a_lane_and_first_on_the_loop() -> None:
    """On a blocking store's lane a batch runs the commands of connections that sent an
    ACK after the others (the ADDs' reads then wait together with the ACKs' items, read
    ahead); on the loop before them (the slots they free are filled before the rest
    runs). Either way each connection's commands keep their order, and a batch with no
    ACK, only ACKing connections or already so ordered is left as it came."""
    worker, caller, other = object(), object(), object()
    batch = [
        _request(worker, "heartbeat", 1),
        _request(caller, "add", 2),
        _request(worker, "ack", 3),
        _request(other, "ack", 4),
        _request(caller, "result_blocking", 5),
        _request(worker, "add", 6),
    ]
    last, first = requests.acks_last(batch), requests.acks_first(batch)
    assert [r.id for r in last] == [2, 5, 1, 3, 4, 6]
    assert [r.id for r in first] == [1, 3, 4, 6, 2, 5]
    assert sorted(r.id for r in last) == sorted(r.id for r in first) == [r.id for r in batch]
    assert requests.acking_end(first) == 4 and requests.acking_end(last) == -1
    assert requests.acks_first(first) is first
    no_ack = [_request(caller, "add", 1), _request(other, "add", 2)]
    only_acking = [_request(worker, "ack", 1), _request(other, "add", 2), _request(other, "ack", 3)]
    for unchanged in (no_ack, only_acking):
        assert requests.acks_last(unchanged) is unchanged
        assert requests.acks_first(unchanged) is unchanged
        assert requests.acking_end(unchanged) == -1  # none lead, or nothing after


async def test_a_lanes_batch_wakes_its_waiters_on_the_loop_with_its_answers(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking store's batch runs on a lane thread; the waiters its ACK wakes (a long
    poll of another connection) are woken on the server's loop, with the batch's answers
    (`deferring_effects`), not from the lane, which cost the loop a wake-up for each;
    the long poll gets the result."""
    import threading

    from queryqueue.engine.waiters import ResultWaiters
    from tests.postgres_util import postgres_store

    store = postgres_store()
    server = QueueServer(store, workdir / "s.sock")
    await server.start()
    caller, worker = SocketQueueDriver(server.socket_path), SocketQueueDriver(server.socket_path)
    published: list[int] = []
    publish = ResultWaiters.publish

    def recorded(self: ResultWaiters, event: Any) -> int:
        published.append(threading.get_ident())
        return publish(self, event)

    monkeypatch.setattr(ResultWaiters, "publish", recorded)
    try:
        added = await caller.add("p:a", "{}")
        waiting = asyncio.ensure_future(caller.result_blocking(added.id, 30_000))
        await wait_until(lambda: store.waiters.count() == 1)
        assert (await worker.ack(added.id, '{"r": 1}')).success
        answer = await asyncio.wait_for(waiting, 30)
        assert answer is not None and answer.payload == '{"r": 1}'
        assert published == [threading.get_ident()]  # the loop's thread, this one
    finally:
        await caller.close()
        await worker.close()
        await server.stop()
        store.close()


class _Told:
    """A linger that waits as the test says: for every query on a worker whose
    ACK is not queued yet (`until` from now), or for `awaited` (ids) alone."""

    def __init__(self) -> None:
        self.until: float | None = None  # None: waits for nothing
        self.awaited: set[Any] | None = None

    def awaited_for(self, running: Any, coming: Any, now: float) -> tuple[set[Any], float]:
        if self.until is None:
            return set(), now
        awaited = self.awaited or {q for q, _ in running if q not in coming}
        return set(awaited), now + self.until


@contextlib.asynccontextmanager
async def _told_lane(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str = "postgres",
    pool_of: tuple[str, int] | None = None,
) -> AsyncIterator[tuple[QueueServer, _Told, SocketQueueDriver, list[list[Any]]]]:
    """A server with a pool of two workers (tests.apps.pool_app) whose batches linger as
    the test says (`_Told`), recorded: on a PostgreSQL store, its lane's; on SQLite, the
    loop's turns."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    if kind == "postgres":
        from tests.postgres_util import postgres_store

        store: Any = postgres_store()
    else:
        store = SqliteQueueStore(workdir / "q.db")
    # The loop's turn lingers only while no worker is idle: there, one query fills the pool.
    app, workers = pool_of or (("app", 2) if kind == "postgres" else ("single", 1))
    pool = WorkerPool(f"tests.apps.pool_app:{app}", workdir / "s.sock", store, workers=workers)
    server = QueueServer(store, workdir / "s.sock", pool=pool)
    told = _Told()
    monkeypatch.setattr(server.runner.linger, "awaited", told.awaited_for)
    await server.start()
    caller = SocketQueueDriver(server.socket_path)
    try:
        await pool.start()
        yield server, told, caller, _record_batches(server, monkeypatch)
    finally:
        await caller.close()
        await pool.stop(grace=0)
        if not server.stopping:  # a test may have stopped it
            await server.stop()
        store.close()


def _sql(key: str, seconds: float) -> str:
    query = {"key": key, "seconds": seconds}
    return orjson.dumps({"queryHandler": "sql", "query": query, "priority": 0}).decode()


async def _started(workdir: Path, queries: int) -> None:
    """Until that many queries started: a worker then says nothing more about its query
    until its ACK (the cancel handler it sets goes through the pool, not the socket)."""
    await wait_until(lambda: len([t for t in read_trace(workdir) if t[0] == "start"]) == queries)


_KINDS = pytest.mark.parametrize("kind", ["postgres", "sqlite"])


@_KINDS
async def test_a_batch_waits_for_the_ack_it_was_told_of_and_runs_with_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A batch the linger says to wait (on PostgreSQL's lane, or SQLite's turn on the
    loop) waits for the ACK of the query a worker runs, and then runs with it as one batch
    (one transaction); an ACK that never comes holds it no longer than the linger's
    deadline. Nothing of it is lost either way."""

    async with _told_lane(workdir, monkeypatch, kind) as (server, told, caller, batches):
        prefix = server.pool.prefix if server.pool is not None else ""
        first = await caller.add(f"{prefix}:first", _sql("first", 0.5))
        await _started(workdir, 1)
        told.until = 60.0  # waits for the first query's ACK, whenever it comes
        second = await caller.add(f"{prefix}:second", _sql("second", 0))
        answered = time.monotonic()
        ended = [float(t[3]) for t in read_trace(workdir) if t[:2] == ["end", "first"]]
        assert ended and answered > ended[0]  # held until the worker had ended the first
        (together,) = [b for b in batches if ("add", f"{prefix}:second") in b]
        assert ("ack", first.id) in together  # one batch, one transaction
        assert second.added

        await caller.add(f"{prefix}:busy", _sql("busy", 1))
        await _started(workdir, 3)  # first, second, busy: the pool has no idle worker
        # No batch still lingering as told before (for `busy`, a minute): the next ADD
        # would join it, and go when `busy`'s ACK or a command about it ends that wait.
        await wait_until(lambda: _idle(server, prefix))
        told.awaited, told.until = {10**9}, 0.3  # an ACK that never comes
        began = time.monotonic()
        third = await caller.add(f"{prefix}:third", _sql("third", 0))
        assert time.monotonic() - began >= 0.3
        assert third.added
        for key in ("second", "third"):  # both ran, answered once each
            result = await caller.result_blocking(f"{prefix}:{key}", 30_000)
            assert result is not None and f'"key":"{key}"' in str(result.payload)


def _idle(server: QueueServer, prefix: str | None) -> bool:
    """No batch of `prefix` lingers, runs or waits: on a lane (a lane lingers only while
    its route is queued), or in the loop's turn."""
    return server.runner.idle(prefix)


async def _lingering_for_long(
    workdir: Path, server: QueueServer, told: _Told, caller: SocketQueueDriver
) -> tuple[str, Any, asyncio.Future[Any]]:
    """The pool's prefix, a 5 s query running there, and an ADD whose batch waits for its
    ACK (told: a minute)."""
    prefix = (server.pool.prefix if server.pool is not None else None) or ""
    long = await caller.add(f"{prefix}:long", _sql("long", 5))
    await _started(workdir, 1)
    told.awaited, told.until = {long.id}, 60.0
    adding = asyncio.ensure_future(caller.add(f"{prefix}:next", _sql("next", 0)))
    await wait_until(server.runner.waiting_for_acks)
    return prefix, long, adding


async def test_on_sqlite_a_turn_never_lingers_while_a_worker_is_idle(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a worker idle, an ADD in the loop's turn may have work for it: the turn runs
    at once, whatever the linger says (here: wait a minute for the running query)."""
    async with _told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, told, caller, _):
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:first", _sql("first", 30))
        await _started(workdir, 1)
        # Each turn's decision, and how many were made by the time the ADD ran: a turn
        # after it (the second query's ACK, with both workers busy) may linger, and may
        # do so before this test reads anything.
        lingered: list[bool] = []
        runner = _on_loop(server)
        lingers, add = runner.lingers, server.store.add
        decided_by_add: list[int] = []

        def deciding() -> bool:
            lingered.append(decided := lingers())
            return decided

        def adding(*args: Any, **kwargs: Any) -> Any:
            decided_by_add.append(len(lingered))
            return add(*args, **kwargs)

        monkeypatch.setattr(runner, "lingers", deciding)
        monkeypatch.setattr(server.store, "add", adding)
        told.until = 60.0
        second = await asyncio.wait_for(caller.add(f"{prefix}:second", _sql("second", 0)), 3)
        assert second.added and decided_by_add and not any(lingered[: decided_by_add[0]])
        assert not [t for t in read_trace(workdir) if t[:2] == ["end", "first"]]


@_KINDS
async def test_a_batch_stops_waiting_for_a_worker_that_waits_for_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A command by queue id about the query a batch waits for (a worker's extra, here
    a GET) queues behind that batch, and its worker may wait for the answer before it
    ACKs: it ends the wait for that query. A heartbeat does not (the worker beats on its
    own; the first test's batch waited through several)."""
    from tests.trace import read_trace

    async with _told_lane(workdir, monkeypatch, kind) as (server, told, caller, batches):
        prefix, long, adding = await _lingering_for_long(workdir, server, told, caller)
        assert not adding.done()
        got = await caller.get(long.id)
        added = await asyncio.wait_for(adding, 30)
        assert got is not None and added.added
        assert not [t for t in read_trace(workdir) if t[:2] == ["end", "long"]]
        (together,) = [b for b in batches if ("add", f"{prefix}:next") in b]
        assert ("get", long.id) in together


@_KINDS
async def test_a_stopping_server_runs_a_lingering_batch_at_once(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Stopping does not wait out a linger (its deadline here a minute away): the batch
    runs, and its ADD is answered, before the server has stopped."""
    async with _told_lane(workdir, monkeypatch, kind) as (server, told, caller, _):
        *_, adding = await _lingering_for_long(workdir, server, told, caller)
        await asyncio.wait_for(server.stop(), 30)
        added = await asyncio.wait_for(adding, 5)
        assert added.added


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
    unwritten: dict[int, list[str]] = {}  # id(connection) -> methods answered, not written
    written: list[tuple[str, int]] = []  # (method, loop iteration), in the order written
    iteration, counting = [0], [True]
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
    if pass_pending:
        execute_turn = LoopRunner.execute_turn

        def after_a_pass(runner: LoopRunner) -> None:
            server = runner.server
            waiting = [*server.inbox.freeing, *server.inbox.queued]
            if any(r.method == "ack" for r in waiting) and server.connections:
                server.flush_soon(next(iter(server.connections)))  # nothing to write
            execute_turn(runner)

        monkeypatch.setattr(LoopRunner, "execute_turn", after_a_pass)
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
            await caller.add(f"{prefix}:first", _sql("first", 1.0))
            await caller.add(f"{prefix}:long", _sql("long", 30))
            await caller.add(f"{prefix}:queued", _sql("queued", 0))
            await _started(workdir, 2)
            runner = _on_loop(server)
            submit, add, execute_turn = pool.submit, store.add, runner.execute_turn

            def submitting(to: str, retrieved: Any) -> None:
                order.append(("hand-off", retrieved.query["query"]["key"]))
                submit(to, retrieved)

            def adding(path: str, *args: Any, **kw: Any) -> Any:
                order.append(("add", path.rpartition(":")[2]))
                return add(path, *args, **kw)

            held = [True]

            def held_turn() -> None:  # the turn runs once both have arrived
                if held[0]:
                    runner.turn = None
                else:
                    execute_turn()

            monkeypatch.setattr(pool, "submit", submitting)
            monkeypatch.setattr(store, "add", adding)
            monkeypatch.setattr(runner, "execute_turn", held_turn)
            assert [r.id for r in store.pending(prefix)] == ["queued"]  # first still runs
            adding_later = asyncio.ensure_future(
                caller.add(f"{prefix}:later", _sql("later", 0), priority=priority)
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


def _starts(workdir: Path) -> list[str]:
    return [t[1] for t in read_trace(workdir) if t[0] == "start"]


class _DueFor:
    """`Linger.ack_due` as the test says: every running query's ACK due `seconds` from
    now (None: off), nothing when no query runs."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def __call__(self, running: Any, now: float, at_most: float) -> float | None:
        if self.seconds is None or not list(running):
            return None
        return now + self.seconds


async def test_on_sqlite_the_loop_polls_for_a_due_ack_until_it_arrives(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACK due soon (linger.py says so, here: for a minute) keeps the loop polling
    from the turn that handed its query off; the ACK's arrival ends the poll at once,
    not the minute, and with no query left running no other starts."""
    async with _told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        added = await caller.add(f"{prefix}:quick", _sql("quick", 0.2))
        # The turn that handed it off polls from its end, before its answer was written.
        assert (
            _on_loop(server).polling.on and _on_loop(server).polling.until > time.monotonic() + 30
        )
        result = await caller.result_blocking(f"{prefix}:quick", 30_000)
        assert result is not None and added.added
        await wait_until(lambda: not _on_loop(server).polling.on, within=10)


async def test_on_sqlite_a_poll_for_an_ack_ends_when_it_is_overdue(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACK that does not come when due: the loop stops polling at the deadline and
    sleeps again while the query runs on."""
    async with _told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(0.2))
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:long", _sql("long", 30))
        assert _on_loop(server).polling.on
        await wait_until(lambda: not _on_loop(server).polling.on, within=10)
        assert server.pool is not None and server.pool.running()  # still running
        assert not [t for t in read_trace(workdir) if t[:2] == ["end", "long"]]


class _NextIn:
    """`Gap.poll_until` as the test says: a caller's next command due `seconds` after its
    answer (None: not soon)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def __call__(self, since: float, at_most: float) -> float | None:
        return None if self.seconds is None else since + self.seconds


async def test_on_sqlite_the_loop_does_not_poll_while_its_pools_queue_is_saturated(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a query was handed to the pool with others still pending, nobody waits long
    for its next message: the loop polls neither for ACKs nor for callers' commands (its
    polls' yields gave the CPU away while it was the bottleneck), however due they are."""
    async with _told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
        monkeypatch.setattr(_on_loop(server).next_command, "poll_until", _NextIn(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        for key, seconds in (("short", 0.05), ("long", 30), ("third", 30), ("fourth", 30)):
            await caller.add(f"{prefix}:{key}", _sql(key, seconds))
        # "short" ends, and its slot's next ("third") is handed over with "fourth" pending.
        await _started(workdir, 3)
        assert server.pool is not None and server.pool.saturated
        await wait_until(lambda: not _on_loop(server).polling.on, within=10)
        assert _on_loop(server).polling.until == 0.0  # no turn or answer since polled again
        await caller.add(f"{prefix}:fifth", _sql("fifth", 30))  # answered: still no poll
        assert _on_loop(server).polling.until == 0.0 and server.pool.saturated


@pytest.mark.parametrize("poll_s", [0.0, None])
async def test_on_sqlite_the_loop_never_polls_when_told_not_to_or_nothing_is_due(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, poll_s: float | None
) -> None:
    async with _told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        if poll_s is None:  # polling on, but no ACK nor next command is due soon
            monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(None))
            monkeypatch.setattr(_on_loop(server).next_command, "poll_until", _NextIn(None))
        else:
            server.settings = dataclasses.replace(server.settings, poll_s=poll_s)
            monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
            monkeypatch.setattr(_on_loop(server).next_command, "poll_until", _NextIn(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:one", _sql("one", 0.1))
        assert not _on_loop(server).polling.on
        assert await caller.result_blocking(f"{prefix}:one", 30_000) is not None
        assert not _on_loop(server).polling.on


@contextlib.asynccontextmanager
async def _poolless(workdir: Path, store: Any) -> AsyncIterator[tuple[QueueServer, Any]]:
    """A server with no pool (no worker's ACK comes in between) and one caller."""
    server = QueueServer(store, workdir / "s.sock")
    await server.start()
    caller = SocketQueueDriver(server.socket_path)
    try:
        yield server, caller
    finally:
        await caller.close()
        await server.stop()
        store.close()


async def test_on_sqlite_the_loop_polls_for_a_callers_next_command_until_it_arrives(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once it has answered a caller whose next command usually follows soon (here: within a
    minute), the loop polls rather than sleep. The next command ends the poll at once, not
    the minute, and teaches the gap how long it took."""
    async with _poolless(workdir, SqliteQueueStore(workdir / "q.db")) as (server, caller):
        monkeypatch.setattr(_on_loop(server).next_command, "poll_until", _NextIn(60.0))
        await caller.add("p:one", _sql("one", 0))
        # Polling from the write pass that answered, before the caller had the answer.
        assert (
            _on_loop(server).polling.on and _on_loop(server).polling.until > time.monotonic() + 30
        )
        heard = record_calls(monkeypatch, _on_loop(server).next_command, "heard")
        monkeypatch.setattr(_on_loop(server), "answered", lambda: None)  # not again
        await caller.add("p:two", _sql("two", 0))
        await wait_until(lambda: not _on_loop(server).polling.on, within=10)
        assert len(heard) == 1 and 0 <= heard[0][0] < 10


@pytest.mark.parametrize("store_kind", ["sqlite-off", "sqlite-not-soon", "postgres"])
async def test_the_loop_never_polls_for_a_next_command_when_off_not_soon_or_off_the_loop(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, store_kind: str
) -> None:
    """Off (0), when callers do not usually come back that soon, and on a store whose
    commands run off the loop (PostgreSQL: its lanes' threads would wait for the GIL)."""
    if store_kind == "postgres":
        from tests.postgres_util import postgres_store

        store: Any = postgres_store()
    else:
        store = SqliteQueueStore(workdir / "q.db")
    async with _poolless(workdir, store) as (server, caller):
        if store_kind == "postgres":  # its runner has no polling to turn on
            assert not isinstance(server.runner, LoopRunner)
            return
        soon = _NextIn(None if store_kind == "sqlite-not-soon" else 60.0)
        monkeypatch.setattr(_on_loop(server).next_command, "poll_until", soon)
        if store_kind == "sqlite-off":
            server.settings = dataclasses.replace(server.settings, poll_s=0.0)
        for key in ("one", "two", "three"):
            await caller.add(f"p:{key}", _sql(key, 0))
            assert not _on_loop(server).polling.on


def test_a_negative_poll_is_refused(workdir: Path) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        Settings(poll_s=-1.0)
    with pytest.raises(ValueError, match="worker_poll_s"):
        WorkerPool(
            "tests.apps.pool_app:app", workdir / "s.sock", MemoryQueueStore(), worker_poll_s=-1.0
        )


def _on_loop(server: QueueServer) -> LoopRunner:
    """The runner of a server whose store runs on the loop (SQLite, memory)."""
    assert isinstance(server.runner, LoopRunner)
    return server.runner
