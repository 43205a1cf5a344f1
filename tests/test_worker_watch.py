"""A pool worker's watch over the sync handler it runs on its loop's thread
(supervisor/watch.py): on its own with a pipe, then in workers of a real supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import multiprocess
import orjson
import pytest

from queryqueue import SocketQueueDriver
from queryqueue.engine.errors import QueryError
from queryqueue.engine.loop_run import LoopRun
from queryqueue.supervisor.watch import CANCEL, CANCEL_HANDLER, DRAINING, TIMED_OUT, WorkerWatch
from tests.pool_util import ask
from tests.supervisor_util import SupervisorProcess, start_supervisor
from tests.trace import read_trace
from tests.waiting import wait_until

OUTCOME = '{"error": "stopped"}'


class _Stops:
    """A run's `stop`: what it was called with, and on which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, int]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, timed_out: bool) -> str:
        self.calls.append((timed_out, threading.get_ident()))
        self.release.wait(20)
        return OUTCOME


class _Pipe:
    """A worker's pipe: `pool` is the pool's end; the watch reads and writes the other."""

    def __init__(self) -> None:
        self.pool, self.worker = multiprocess.Pipe()
        self.heard: list[bytes] = []  # what the watch passed to the loop, in order


@pytest.fixture
async def pipe() -> AsyncIterator[tuple[_Pipe, WorkerWatch]]:
    ends = _Pipe()
    watch = WorkerWatch(
        ends.worker, ends.heard.append, asyncio.get_running_loop(), tick=0.005, park_after=0.1
    )
    try:
        yield ends, watch
    finally:
        watch.close()
        ends.pool.close()
        ends.worker.close()


def _run(queue_id: int, stops: _Stops, seconds: float = 60.0) -> LoopRun:
    return LoopRun(queue_id, time.monotonic() + seconds, stops)


async def _received(end: Any) -> bytes:
    await wait_until(lambda: end.poll(0), what="a message on the pipe")
    return bytes(end.recv_bytes())


async def test_a_cancel_of_the_run_is_carried_out_from_the_watchs_thread(
    pipe: tuple[_Pipe, WorkerWatch],
) -> None:
    """What comes before it goes to the loop in order; the run is stopped on the watch's
    thread and the pool told it is over; what comes after it stays in the pipe for the
    loop's own read once the run has ended."""
    ends, watch = pipe
    stops = _Stops()
    watch.begin(_run(7, stops))
    ends.pool.send_bytes(b"J1")
    ends.pool.send_bytes(CANCEL + b"8")  # another item's (one sent ahead): the loop's
    ends.pool.send_bytes(CANCEL + b"7")
    ends.pool.send_bytes(b"J2")
    assert await _received(ends.pool) == DRAINING + b"7"
    assert [timed_out for timed_out, _ in stops.calls] == [False]
    assert stops.calls[0][1] != threading.get_ident()
    looks = watch.looks
    await wait_until(lambda: watch.looks >= looks + 3, what="the watch looking on")
    watch.end()
    await wait_until(lambda: len(ends.heard) == 2)
    assert ends.heard == [b"J1", CANCEL + b"8"]
    assert ends.worker.poll(0) and ends.worker.recv_bytes() == b"J2"  # never read there
    assert len(stops.calls) == 1 and watch.stopped(7)


async def test_a_run_past_its_deadline_is_timed_out_once(
    pipe: tuple[_Pipe, WorkerWatch],
) -> None:
    ends, watch = pipe
    stops = _Stops()
    watch.begin(_run(3, stops, seconds=0.05))
    message = await _received(ends.pool)
    assert message.startswith(TIMED_OUT)
    assert orjson.loads(message[len(TIMED_OUT) :]) == [3, OUTCOME]
    ends.pool.send_bytes(CANCEL + b"3")  # late: the run is stopped already
    looks = watch.looks
    await wait_until(lambda: watch.looks >= looks + 3, what="the watch looking on")
    watch.end()
    assert stops.calls and [timed_out for timed_out, _ in stops.calls] == [True]
    assert ends.worker.recv_bytes() == CANCEL + b"3"
    assert not ends.pool.poll(0) and watch.stopped(3) and not watch.stopped(4)


async def test_end_waits_for_a_stop_in_progress(pipe: tuple[_Pipe, WorkerWatch]) -> None:
    """The cancel handler runs while the run is current: a handler that ends meanwhile
    does not go on to its next query (whose statement the cancel could interrupt)."""
    ends, watch = pipe
    stops = _Stops()
    stops.release.clear()
    watch.begin(_run(5, stops))
    ends.pool.send_bytes(CANCEL + b"5")
    await wait_until(lambda: stops.calls, what="the stop under way")
    ending = threading.Thread(target=watch.end)
    ending.start()
    ending.join(0.2)
    assert ending.is_alive()  # held until the stop is done
    stops.release.set()
    ending.join(10)
    assert not ending.is_alive()
    assert await _received(ends.pool) == DRAINING + b"5"


async def test_a_parked_watch_wakes_for_the_next_run(pipe: tuple[_Pipe, WorkerWatch]) -> None:
    ends, watch = pipe
    await wait_until(lambda: watch._parked, what="the watch parked, no query begun")
    looks = watch.looks
    stops = _Stops()
    watch.begin(_run(9, stops, seconds=0.05))
    message = await _received(ends.pool)
    watch.end()
    assert message.startswith(TIMED_OUT) and watch.looks > looks


async def test_a_failing_stop_leaves_the_watch_watching_the_next_run(
    pipe: tuple[_Pipe, WorkerWatch],
) -> None:
    ends, watch = pipe

    def broken(timed_out: bool) -> str:
        raise RuntimeError("a bug in a stop")

    watch.begin(LoopRun(1, time.monotonic() - 1, broken))  # due at the first look
    looks = watch.looks
    await wait_until(lambda: watch.looks >= looks + 2, what="the watch past the failure")
    watch.end()
    stops = _Stops()
    watch.begin(_run(2, stops, seconds=0.01))
    message = await _received(ends.pool)
    watch.end()
    assert message.startswith(TIMED_OUT) and [t for t, _ in stops.calls] == [True]


async def test_the_cancel_handler_is_carried_to_the_pool(
    pipe: tuple[_Pipe, WorkerWatch],
) -> None:
    ends, watch = pipe
    run = _run(11, _Stops())
    watch.begin(run)
    assert watch.carry_cancel_handler(run, {"pid": 42})
    message = await _received(ends.pool)
    assert message.startswith(CANCEL_HANDLER)
    queue_id, extra = orjson.loads(message[len(CANCEL_HANDLER) :])
    assert (queue_id, orjson.loads(extra)) == (11, {"cancelHandler": {"pid": 42}})
    assert not watch.carry_cancel_handler(run, object())  # not JSON: not carried
    watch.end()
    assert not ends.pool.poll(0)


# -- in a supervisor's workers -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def _supervised(
    workdir: Path, app_name: str, *options: str, **queue_options: Any
) -> AsyncIterator[tuple[SupervisorProcess, SocketQueueDriver, Any, list[asyncio.Future[Any]]]]:
    """A supervisor with a pool of `tests.apps.pool_app:<app_name>` (its trace where the
    test's $POOL_TRACE says), a pool queue on it, and a list for the test's asking tasks:
    all stopped afterwards (the tasks cancelled)."""
    from tests.apps import pool_app

    supervisor = start_supervisor(
        workdir / "queue.db",
        workdir / "s.sock",
        "--app",
        f"tests.apps.pool_app:{app_name}",
        *options,
    )
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = getattr(pool_app, app_name).pool_queue(driver, **queue_options)
    asking: list[asyncio.Future[Any]] = []
    try:
        yield supervisor, driver, queue, asking
    finally:
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


async def test_a_timed_out_handler_that_runs_on_fails_for_its_waiters_at_its_timeout(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timeout 0.5 s, grace 60 s, a handler that sleeps through its cancel on the worker's
    loop thread: the waiter hears of the timeout from the worker's watch (through the
    pool) at once, not from the supervisor a grace later."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with _supervised(workdir, "short", "--workers", "1", "--cancel-grace", "60") as (
        _,
        driver,
        queue,
        _,
    ):
        asked_at = time.monotonic()
        with pytest.raises(
            QueryError, match=r"Query execution timeout after .* s \(execution_timeout .* s\)"
        ):
            await ask(queue, "sql", "slow", {"key": "slow", "seconds": 30})
        assert time.monotonic() - asked_at < 20
        (start,) = [t for t in read_trace(workdir) if t[0] == "start"]
        await wait_until(
            lambda: ["cancel", "slow", start[2]] in [t[:3] for t in read_trace(workdir)],
            what="the cancel handler, in the worker",
        )
        assert not [t for t in read_trace(workdir) if t[:2] == ["end", "slow"]]  # runs on
        assert (await driver.stats())["pool"]["terminated"] == 0  # within its grace


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_handler_that_heeds_its_cancel_keeps_its_worker(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The handler runs on the worker's loop thread; its cancel handler, called from the
    watch's thread, makes it stop: the worker is not terminated and runs the next query."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with _supervised(
        workdir, "short", "--workers", "1", "--cancel-grace", "60", continue_wait_timeout=0.2
    ) as (_, driver, queue, asking):
        seconds = {"seconds": 30} if how == "cancel" else {}  # none: the execution timeout
        asking.append(asyncio.ensure_future(ask(queue, "polite", "p", {"key": "p", **seconds})))
        await wait_until(lambda: [t for t in read_trace(workdir) if t[:2] == ["start", "p"]])
        (start,) = [t for t in read_trace(workdir) if t[:2] == ["start", "p"]]
        assert start[4] == "MainThread"  # the worker's loop thread
        if how == "cancel":
            (item,) = await driver.list_items(queue.prefix)
            assert await driver.cancel(item.queue_id) is not None
            await asyncio.gather(*asking, return_exceptions=True)
        else:
            with pytest.raises(QueryError, match="Query execution timeout"):
                await asking[0]
        await wait_until(
            lambda: ["cancel", "p", start[2]] in [t[:3] for t in read_trace(workdir)],
            what="the cancel handler, in the worker",
        )
        answer = await ask(queue, "sql", "next", {"key": "next", "seconds": 0})
        assert answer["pid"] == int(start[2])
        assert (await driver.stats())["pool"]["terminated"] == 0


async def test_a_killed_workers_item_is_reclaimed_with_the_cancel_handler_its_query_set(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel handler a query sets while it runs on the worker's loop thread reaches
    its item at once (the loop could not send it): after a kill -9, the supervisor calls
    the cancel handler with it."""
    from queryqueue.engine.connection import decode_def

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with _supervised(workdir, "app", continue_wait_timeout=0.2) as (
        supervisor,
        driver,
        queue,
        asking,
    ):
        path = f"{queue.prefix}:{queue.hash_query_key('k')}"
        asking.append(asyncio.ensure_future(ask(queue, "sql", "k", {"key": "k", "seconds": 60})))

        async def recorded() -> Any:
            definition = decode_def(await driver.get(path))
            return (definition or {}).get("cancelHandler")

        await wait_until(recorded, within=30, what="the cancel handler recorded")
        victim = (await recorded())["pid"]
        os.kill(victim, signal.SIGKILL)
        await wait_until(
            lambda: [t for t in read_trace(workdir) if t[:2] == ["cancel", "k"]], what="reclaim"
        )
        (cancelled,) = [t for t in read_trace(workdir) if t[:2] == ["cancel", "k"]]
        assert int(cancelled[2]) == supervisor.pid and cancelled[4] == str(victim)


async def test_workers_notes_go_in_the_next_batch_and_one_refused_is_dropped(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel handlers the watches carry are merged in the server's next batch (one
    transaction with what else came), one run for them if nothing else comes; one the
    store refuses costs only itself."""
    from queryqueue import SqliteQueueStore
    from tests.pool_util import pool_server

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = SqliteQueueStore(workdir / "q.db")
    async with pool_server(store, workdir) as (server, pool, _):
        added = store.add("elsewhere:k", '{"queryHandler": "sql", "query": 1}')
        batches = server.stats.batches
        pool.note(added.id, "not json")
        pool.note(added.id, '{"cancelHandler": {"pid": 5}}')
        await wait_until(lambda: server.stats.batches > batches and not server.inbox)
        await wait_until(lambda: getattr(store.get(added.id), "extra", None) is not None)
        found = store.get(added.id)
        assert found is not None and found.extra is not None
        assert orjson.loads(found.extra) == {"cancelHandler": {"pid": 5}}
