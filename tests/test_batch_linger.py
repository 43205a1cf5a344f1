"""How the supervisor orders and times a batch: the ACKs of its workers against the other
connections' commands, waking a lane's waiters, and lingering for an ACK it was told of
only while that pays."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.core import requests
from queryqueue.supervisor.core.requests import Request
from queryqueue.supervisor.server import QueueServer
from tests.hot_path_util import Told, on_loop, sql_query, started_keys, told_lane
from tests.trace import read_trace
from tests.waiting import wait_until


def _request(connection: object, method: str, n: int) -> Any:
    """A bare request of `connection`'s, its id and argument `n`: for the batch orders."""
    return Request(connection, n, method, [n], {}, None, 0.0)


_KINDS = pytest.mark.parametrize("kind", ["postgres", "sqlite"])


def _idle(server: QueueServer, prefix: str | None) -> bool:
    """No batch of `prefix` lingers, runs or waits: on a lane (a lane lingers only while
    its route is queued), or in the loop's turn."""
    return server.runner.idle(prefix)


async def _lingering_for_long(
    workdir: Path, server: QueueServer, told: Told, caller: SocketQueueDriver
) -> tuple[str, Any, asyncio.Future[Any]]:
    """The pool's prefix, a 5 s query running there, and an ADD whose batch waits for its
    ACK (told: a minute)."""
    prefix = (server.pool.prefix if server.pool is not None else None) or ""
    long = await caller.add(f"{prefix}:long", sql_query("long", 5))
    await started_keys(workdir, 1)
    told.awaited, told.until = {long.id}, 60.0
    adding = asyncio.ensure_future(caller.add(f"{prefix}:next", sql_query("next", 0)))
    await wait_until(server.runner.waiting_for_acks)
    return prefix, long, adding


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


@_KINDS
async def test_a_batch_waits_for_the_ack_it_was_told_of_and_runs_with_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A batch the linger says to wait (on PostgreSQL's lane, or SQLite's turn on the
    loop) waits for the ACK of the query a worker runs, and then runs with it as one batch
    (one transaction); an ACK that never comes holds it no longer than the linger's
    deadline. Nothing of it is lost either way."""

    async with told_lane(workdir, monkeypatch, kind) as (server, told, caller, batches):
        prefix = server.pool.prefix if server.pool is not None else ""
        first = await caller.add(f"{prefix}:first", sql_query("first", 0.5))
        await started_keys(workdir, 1)
        told.until = 60.0  # waits for the first query's ACK, whenever it comes
        second = await caller.add(f"{prefix}:second", sql_query("second", 0))
        answered = time.monotonic()
        ended = [float(t[3]) for t in read_trace(workdir) if t[:2] == ["end", "first"]]
        assert ended and answered > ended[0]  # held until the worker had ended the first
        (together,) = [b for b in batches if ("add", f"{prefix}:second") in b]
        assert ("ack", first.id) in together  # one batch, one transaction
        assert second.added

        await caller.add(f"{prefix}:busy", sql_query("busy", 1))
        await started_keys(workdir, 3)  # first, second, busy: the pool has no idle worker
        # No batch still lingering as told before (for `busy`, a minute): the next ADD
        # would join it, and go when `busy`'s ACK or a command about it ends that wait.
        await wait_until(lambda: _idle(server, prefix))
        told.awaited, told.until = {10**9}, 0.3  # an ACK that never comes
        began = time.monotonic()
        third = await caller.add(f"{prefix}:third", sql_query("third", 0))
        assert time.monotonic() - began >= 0.3
        assert third.added
        for key in ("second", "third"):  # both ran, answered once each
            result = await caller.result_blocking(f"{prefix}:{key}", 30_000)
            assert result is not None and f'"key":"{key}"' in str(result.payload)


async def test_on_sqlite_a_turn_never_lingers_while_a_worker_is_idle(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a worker idle, an ADD in the loop's turn may have work for it: the turn runs
    at once, whatever the linger says (here: wait a minute for the running query)."""
    async with told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, told, caller, _):
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:first", sql_query("first", 30))
        await started_keys(workdir, 1)
        # Each turn's decision, and how many were made by the time the ADD ran: a turn
        # after it (the second query's ACK, with both workers busy) may linger, and may
        # do so before this test reads anything.
        lingered: list[bool] = []
        runner = on_loop(server)
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
        second = await asyncio.wait_for(caller.add(f"{prefix}:second", sql_query("second", 0)), 3)
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

    async with told_lane(workdir, monkeypatch, kind) as (server, told, caller, batches):
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
    async with told_lane(workdir, monkeypatch, kind) as (server, told, caller, _):
        *_, adding = await _lingering_for_long(workdir, server, told, caller)
        await asyncio.wait_for(server.stop(), 30)
        added = await asyncio.wait_for(adding, 5)
        assert added.added
