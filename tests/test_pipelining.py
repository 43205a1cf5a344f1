"""A request process sends its ADD and the RESULT_BLOCKING that follows it in one frame
(`then_wait`): the supervisor runs the long poll on the id the ADD answers, in the same
batch (a blocking store: as soon as the ADD is answered), and the caller's later
`result_blocking` is answered from it, with no second command."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import InvalidCommandError, MemoryQueueStore, QueueStore, SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.engine.driver import LocalQueueDriver
from queryqueue.engine.queue import QueryQueue
from queryqueue.supervisor.server import QueueServer
from tests.waiting import wait_until


def _store(kind: str, tmp_path: Path) -> QueueStore:
    if kind == "memory":
        return MemoryQueueStore()
    if kind == "sqlite":
        return SqliteQueueStore(tmp_path / "q.db")
    from tests.postgres_util import postgres_store

    return postgres_store()  # type: ignore[no-any-return]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def served(
    request: pytest.FixtureRequest, workdir: Path, tmp_path: Path
) -> AsyncIterator[QueueServer]:
    store = _store(request.param, tmp_path)
    server = QueueServer(store, workdir / "s.sock")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        store.close()


async def _sent(driver: SocketQueueDriver, command: str) -> int:
    commands = (await driver.stats())["commands"]
    return int(commands.get(command, {}).get("count", 0))


async def test_the_long_poll_sent_with_its_add_waits_and_answers_the_later_call(
    served: QueueServer,
) -> None:
    caller, worker = SocketQueueDriver(served.socket_path), SocketQueueDriver(served.socket_path)
    try:
        added = await caller.add("p:k", orjson.dumps({"q": 1}).decode(), then_wait_ms=10_000)
        assert added.added
        # Parked on the supervisor before the caller asked for it.
        await wait_until(
            lambda: _long_polls(caller, 1), what="the pipelined long poll parked at the supervisor"
        )
        polls_before = await _sent(caller, "result_blocking")
        assert (await worker.ack(added.id, '{"result": 42}')).success
        got = await caller.result_blocking(added.id, 10_000)
        assert got is not None and orjson.loads(got.payload or "null") == {"result": 42}
        # One long poll answered (they are counted when answered): no second one was sent.
        assert await _sent(caller, "result_blocking") == polls_before + 1
        # Answered by id, as the ordinary long poll is: the result still reads by id.
        assert await caller.result(added.id) is not None
    finally:
        await caller.close()
        await worker.close()


async def _long_polls(driver: SocketQueueDriver, count: int) -> bool:
    return int((await driver.stats())["long_polls"]) == count


async def test_the_long_poll_sent_with_its_add_looks_in_the_adds_batch(
    served: QueueServer,
) -> None:
    """On every store, a blocking one included: the ADD and its long poll's first look are
    one batch (one transaction), not a transaction each."""
    caller, worker = SocketQueueDriver(served.socket_path), SocketQueueDriver(served.socket_path)
    try:
        added = await caller.add("p:k", "{}", then_wait_ms=10_000)
        await wait_until(lambda: _long_polls(caller, 1), what="the pipelined long poll parked")
        assert (served.stats.batches, served.stats.batched_commands) == (1, 2)
        assert (await worker.ack(added.id, '{"result": 5}')).success
        got = await caller.result_blocking(added.id, 10_000)
        assert got is not None and got.payload == '{"result": 5}'
    finally:
        await caller.close()
        await worker.close()


async def test_a_result_already_there_answers_the_pipelined_poll_at_once(
    served: QueueServer,
) -> None:
    driver = SocketQueueDriver(served.socket_path)
    try:
        first = await driver.add("p:k", "{}")
        await driver.ack(first.id, '{"result": 1}')
        # `if_no_result`: the unread result's item is the id to read.
        again = await driver.add("p:k", "{}", if_no_result=True, then_wait_ms=10_000)
        got = await driver.result_blocking(again.id, 10_000)
        assert got is not None and got.payload == '{"result": 1}'
    finally:
        await driver.close()


async def test_callers_of_one_process_joining_one_item_each_claim_their_own_long_poll(
    served: QueueServer,
) -> None:
    """Dedup inside one request process: several callers add the same key through one
    driver, with the same timeout. Each pipelined long poll is claimed by one of them;
    none is sent twice, none is left parked for nobody."""
    driver, worker = SocketQueueDriver(served.socket_path), SocketQueueDriver(served.socket_path)
    try:
        added = await asyncio.gather(
            *(driver.add("p:same", "{}", then_wait_ms=10_000) for _ in range(6))
        )
        assert len({a.id for a in added}) == 1
        await wait_until(lambda: _long_polls(driver, 6), what="six pipelined long polls parked")
        polls_before = await _sent(driver, "result_blocking")
        waits = [
            asyncio.ensure_future(driver.result_blocking(added[0].id, 10_000)) for _ in range(6)
        ]
        await asyncio.sleep(0)  # each has claimed its poll or sent one of its own
        assert (await driver.stats())["long_polls"] == 6
        assert (await worker.ack(added[0].id, '{"result": 7}')).success
        got = await asyncio.gather(*waits)
        assert [g.payload if g else None for g in got] == ['{"result": 7}'] * 6
        assert await _sent(driver, "result_blocking") == polls_before + 6
        assert len(driver.pipelined) == 0
    finally:
        await driver.close()
        await worker.close()


async def test_a_failing_add_leaves_no_long_poll_behind(served: QueueServer) -> None:
    driver = SocketQueueDriver(served.socket_path)
    try:
        with pytest.raises(InvalidCommandError, match="payload"):
            await driver.add("p:k", "not json", then_wait_ms=10_000)
        assert len(driver.pipelined) == 0
        await wait_until(lambda: _long_polls(driver, 0), what="no long poll left parked")
        assert (await driver.add("p:k", "{}")).added  # the connection goes on
    finally:
        await driver.close()


async def test_an_unclaimed_long_poll_lost_with_its_connection_leaves_no_warning(
    server: QueueServer,
) -> None:
    """A caller that added with its long poll and has not asked for the result yet, when
    the connection goes: the poll's loss is kept for its claim, not left to be reported
    as an exception nobody retrieved when the future is collected (at the latest when
    the loop closes, in whatever runs then)."""
    driver = SocketQueueDriver(server.socket_path)
    try:
        added = await driver.add("p:k", orjson.dumps({"q": 1}).decode(), then_wait_ms=10_000)
        (kept,) = driver.pipelined.kept((added.id, 10_000))
        kept.link.close()  # the connection goes while the poll is parked, unclaimed
        await wait_until(kept.waited.done, what="the pipelined poll failed with its connection")
        await asyncio.sleep(0)  # its done callbacks have run
        # What asyncio logs "exception was never retrieved" from, as the future is freed.
        assert not kept.waited._log_traceback
        assert await kept.reply(1.0) is None  # its claim still sees the loss
    finally:
        await driver.close()


async def test_a_malformed_then_wait_is_refused_by_name(server: QueueServer) -> None:
    driver = SocketQueueDriver(server.socket_path)
    try:
        for bad in ([1], ["x", 10], [1, -5], {"id": 1}):
            with pytest.raises(InvalidCommandError, match="then_wait"):
                await driver.call("add", "p:k", "{}", then_wait=bad)
        assert await driver.list_items("p") == []  # nothing was added by a refused ADD
    finally:
        await driver.close()


async def test_the_request_side_announces_its_long_poll_with_the_add() -> None:
    """What `execute_in_queue` tells its driver: the timeout of the long poll it makes
    next (none for a job, which waits for nothing)."""
    seen: list[Any] = []

    class Recording(LocalQueueDriver):
        async def add(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("then_wait_ms"))
            return await super().add(*args, **kwargs)

    async def handler(query: Any, set_cancel_handler: Any) -> int:
        return 1

    queue = QueryQueue(
        "p", query_handlers={"q": handler}, driver=Recording(), continue_wait_timeout=2.5
    )
    try:
        assert await queue.execute_in_queue("q", "k", {}) == 1
        assert await queue.execute_in_queue("q", "j", {"isJob": True}) is None
    finally:
        await queue.shutdown(grace=0)
    assert seen == [2500, None]


async def test_requests_time_out_on_one_deadline_heap_and_the_link_goes_on(
    workdir: Path,
) -> None:
    """Every request's deadline sits in its connection's one heap, behind one timer: the
    unanswered ones fail with CommandTimeoutError at their deadline, nothing of them is
    left pending, and the connection still answers what is answered."""
    from queryqueue import CommandTimeoutError
    from queryqueue.driver_socket.protocol import encode_frame, read_frame

    async def half_deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers hello and ping; swallows everything else.
        try:
            while True:
                body = await read_frame(reader, 1 << 20)
                if body is None:
                    break
                message = orjson.loads(body)
                if message.get("cmd") in ("hello", "ping"):
                    ok = "pong" if message["cmd"] == "ping" else {"pid": 0, "pool": []}
                    writer.write(encode_frame({"id": message["id"], "ok": ok}))
        finally:
            writer.close()

    path = workdir / "deaf.sock"
    listener = await asyncio.start_unix_server(half_deaf, str(path))
    driver = SocketQueueDriver(path, request_timeout=0.3)
    try:
        calls = [asyncio.ensure_future(driver.get(f"p:k{i}")) for i in range(50)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        timed_out = [o for o in outcomes if isinstance(o, CommandTimeoutError)]
        assert len(timed_out) == 50, outcomes
        link = driver.connection.link
        assert link is not None and link.pending == {}
        assert await driver.ping() == "pong"
    finally:
        await driver.close()
        listener.close()
        await listener.wait_closed()
