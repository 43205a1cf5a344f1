"""The supervisor's loop on SQLite polls for what is due (a worker's ACK, a caller's next
command) only while it is due, and never when told not to."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import MemoryQueueStore, SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.loop_runner import LoopRunner
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.settings import Settings
from tests.hot_path_util import on_loop, sql_query, started_keys, told_lane
from tests.recording import record_calls
from tests.trace import read_trace
from tests.waiting import wait_until


class _DueFor:
    """`Linger.ack_due` as the test says: every running query's ACK due `seconds` from
    now (None: off), nothing when no query runs."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def __call__(self, running: Any, now: float, at_most: float) -> float | None:
        if self.seconds is None or not list(running):
            return None
        return now + self.seconds


class _NextIn:
    """`Gap.poll_until` as the test says: a caller's next command due `seconds` after its
    answer (None: not soon)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def __call__(self, since: float, at_most: float) -> float | None:
        return None if self.seconds is None else since + self.seconds


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


async def test_on_sqlite_the_loop_polls_for_a_due_ack_until_it_arrives(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACK due soon (linger.py says so, here: for a minute) keeps the loop polling
    from the turn that handed its query off; the ACK's arrival ends the poll at once,
    not the minute, and with no query left running no other starts."""
    async with told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        added = await caller.add(f"{prefix}:quick", sql_query("quick", 0.2))
        # The turn that handed it off polls from its end, before its answer was written.
        assert on_loop(server).polling.on and on_loop(server).polling.until > time.monotonic() + 30
        result = await caller.result_blocking(f"{prefix}:quick", 30_000)
        assert result is not None and added.added
        await wait_until(lambda: not on_loop(server).polling.on, within=10)


async def test_on_sqlite_a_poll_for_an_ack_ends_when_it_is_overdue(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ACK that does not come when due: the loop stops polling at the deadline and
    sleeps again while the query runs on."""
    async with told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(0.2))
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:long", sql_query("long", 30))
        assert on_loop(server).polling.on
        await wait_until(lambda: not on_loop(server).polling.on, within=10)
        assert server.pool is not None and server.pool.running()  # still running
        assert not [t for t in read_trace(workdir) if t[:2] == ["end", "long"]]


async def test_on_sqlite_the_loop_does_not_poll_while_its_pools_queue_is_saturated(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a query was handed to the pool with others still pending, nobody waits long
    for its next message: the loop polls neither for ACKs nor for callers' commands (its
    polls' yields gave the CPU away while it was the bottleneck), however due they are."""
    async with told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
        monkeypatch.setattr(on_loop(server).next_command, "poll_until", _NextIn(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        for key, seconds in (("short", 0.05), ("long", 30), ("third", 30), ("fourth", 30)):
            await caller.add(f"{prefix}:{key}", sql_query(key, seconds))
        # "short" ends, and its slot's next ("third") is handed over with "fourth" pending.
        await started_keys(workdir, 3)
        assert server.pool is not None and server.pool.saturated
        await wait_until(lambda: not on_loop(server).polling.on, within=10)
        assert on_loop(server).polling.until == 0.0  # no turn or answer since polled again
        await caller.add(f"{prefix}:fifth", sql_query("fifth", 30))  # answered: still no poll
        assert on_loop(server).polling.until == 0.0 and server.pool.saturated


@pytest.mark.parametrize("poll_s", [0.0, None])
async def test_on_sqlite_the_loop_never_polls_when_told_not_to_or_nothing_is_due(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, poll_s: float | None
) -> None:
    async with told_lane(workdir, monkeypatch, "sqlite", ("app", 2)) as (server, _, caller, _):
        if poll_s is None:  # polling on, but no ACK nor next command is due soon
            monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(None))
            monkeypatch.setattr(on_loop(server).next_command, "poll_until", _NextIn(None))
        else:
            server.settings = dataclasses.replace(server.settings, poll_s=poll_s)
            monkeypatch.setattr(server.runner.linger, "ack_due", _DueFor(60.0))
            monkeypatch.setattr(on_loop(server).next_command, "poll_until", _NextIn(60.0))
        prefix = server.pool.prefix if server.pool is not None else ""
        await caller.add(f"{prefix}:one", sql_query("one", 0.1))
        assert not on_loop(server).polling.on
        assert await caller.result_blocking(f"{prefix}:one", 30_000) is not None
        assert not on_loop(server).polling.on


async def test_on_sqlite_the_loop_polls_for_a_callers_next_command_until_it_arrives(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once it has answered a caller whose next command usually follows soon (here: within a
    minute), the loop polls rather than sleep. The next command ends the poll at once, not
    the minute, and teaches the gap how long it took."""
    async with _poolless(workdir, SqliteQueueStore(workdir / "q.db")) as (server, caller):
        monkeypatch.setattr(on_loop(server).next_command, "poll_until", _NextIn(60.0))
        await caller.add("p:one", sql_query("one", 0))
        # Polling from the write pass that answered, before the caller had the answer.
        assert on_loop(server).polling.on and on_loop(server).polling.until > time.monotonic() + 30
        heard = record_calls(monkeypatch, on_loop(server).next_command, "heard")
        monkeypatch.setattr(on_loop(server), "answered", lambda: None)  # not again
        await caller.add("p:two", sql_query("two", 0))
        await wait_until(lambda: not on_loop(server).polling.on, within=10)
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
        monkeypatch.setattr(on_loop(server).next_command, "poll_until", soon)
        if store_kind == "sqlite-off":
            server.settings = dataclasses.replace(server.settings, poll_s=0.0)
        for key in ("one", "two", "three"):
            await caller.add(f"p:{key}", sql_query(key, 0))
            assert not on_loop(server).polling.on


def test_a_negative_poll_is_refused(workdir: Path) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        Settings(poll_s=-1.0)
    with pytest.raises(ValueError, match="worker_poll_s"):
        WorkerPool(
            "tests.apps.pool_app:app", workdir / "s.sock", MemoryQueueStore(), worker_poll_s=-1.0
        )
