"""The supervisor's hot path: long polls parked behind one timer and answered with one
encoding, and the batch that gives an idle pool its work."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import MemoryQueueStore, QueueError, SqliteQueueStore
from queryqueue.driver_socket import protocol
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.driver_socket.deadlines import Deadlines
from queryqueue.supervisor import answering
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.polls import ParkedPoll
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer
from tests.hot_path_util import record_batches
from tests.recording import record_calls
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


def _park(
    store: MemoryQueueStore, key: int, deadlines: Deadlines[Any], answered: list[bool]
) -> None:
    """A poll parked as the server parks one: its `finish` is a closure that holds it."""

    def finish(ok: bool, answer: Any, event: Any) -> None:
        answered.append(poll.done)

    poll = ParkedPoll(store, key, 30_000, store.waiters.subscribe(key), finish, deadlines)


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


async def test_a_batch_ends_at_the_add_that_gives_an_idle_pool_work(
    pooled: QueueServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ADD of a storm inserts the item an idle worker can run: its batch commits
    and hands it off before the joins that arrived with it run (they go next, first)."""
    batches = record_batches(pooled, monkeypatch)
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
    batches = record_batches(pooled, monkeypatch)
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
        batches = record_batches(server, monkeypatch)
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
