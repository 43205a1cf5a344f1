"""Workers that run several queries at once (`worker_concurrency`): each query in a
shared worker keeps what it has alone (its cancel, its timeout, its take-back), the queue's
budget stays the limit, and a worker that retires finishes what it runs first."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from queryqueue import QueryCancelledError, QueryTimeoutError, SocketQueueDriver, SqliteQueueStore
from queryqueue.supervisor.launch import launch
from queryqueue.supervisor.pool import WorkerPool
from tests.pool_util import ask, pool_server
from tests.supervisor_util import REPO, close_all, start_supervisor, stats_of
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until

LANES = "tests.apps.lanes_app:app"  # budget 4, 3 queries a worker
SHORT = "tests.apps.lanes_app:short"  # budget 3, 3 a worker, a 1 s execution timeout
EIGHT = "tests.apps.lanes_app:eight"  # budget 8, 8 a worker


@asynccontextmanager
async def _lanes(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    app_ref: str = LANES,
    workers: int = 1,
    **pool_options: Any,
) -> AsyncIterator[tuple[WorkerPool, Any, Path]]:
    """A supervisor here with a pool of `app_ref`, its handlers held at a gate (a file)
    until the test removes it: (pool, a queue on it, the gate)."""
    gate = workdir / "gate"
    gate.touch()
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    monkeypatch.setenv("POOL_GATE", str(gate))
    store = SqliteQueueStore(workdir / "q.db")
    async with pool_server(
        store,
        workdir,
        workers=workers,
        app_ref=app_ref,
        pool_options=pool_options,
        stop_grace=30,
    ) as (_, pool, queue):
        yield pool, queue, gate


def _started(workdir: Path) -> list[list[str]]:
    return [event for event in read_trace(workdir) if event[0] == "start"]


def _query(key: str, **more: Any) -> dict[str, Any]:
    return {"key": key, **more}


@pytest.mark.parametrize("handler", ["met", "met_async"])
async def test_a_worker_runs_its_queries_at_once(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    """Three queries meet inside one worker: each waits until three run in its process."""
    async with _lanes(workdir, monkeypatch) as (pool, queue, gate):
        gate.unlink()
        results = await asyncio.gather(
            *(ask(queue, handler, f"k{i}", _query(f"k{i}", n=3)) for i in range(3))
        )
        assert results == [True, True, True]
        assert pool.describe()["worker_concurrency"] == 3
        assert len(pool.pids()) == 1


async def test_the_budget_holds_across_workers_with_more_lanes_than_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers of three lanes each (six) under a budget of four: never more than four
    handlers run at once, counted in the handlers, and both workers take work."""
    async with _lanes(workdir, monkeypatch, workers=2) as (_, queue, gate):
        calls = [ask(queue, "held", f"k{i}", _query(f"k{i}", seconds=0.05)) for i in range(4)] + [
            ask(queue, "held_sync", f"s{i}", _query(f"s{i}", seconds=0.05)) for i in range(20)
        ]
        running = asyncio.gather(*calls)
        await wait_until(lambda: len(_started(workdir)) >= 4, within=30, what="4 started")
        # The least loaded worker first: the four spread over both.
        assert len({event[2] for event in _started(workdir)}) == 2
        gate.unlink()
        results = await running
    trace = read_trace(workdir)
    assert len(results) == 24 and len(_started(workdir)) == 24
    assert max_overlap(trace) == 4
    assert max(int(event[4]) for event in _started(workdir)) <= 3  # per worker, its lanes


@pytest.mark.parametrize("handler", ["held", "held_sync"])
async def test_cancelling_one_of_three_runs_its_cancel_handler_only(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    async with _lanes(workdir, monkeypatch) as (pool, queue, gate):
        (worker,) = pool.pids()
        calls = [
            asyncio.ensure_future(ask(queue, handler, key, _query(key))) for key in ("a", "b", "c")
        ]
        await wait_until(lambda: len(_started(workdir)) == 3, within=30, what="three started")
        assert len({event[2] for event in _started(workdir)}) == 1  # one worker runs all three
        assert await queue.cancel_query(queue.hash_query_key("b"))
        with pytest.raises(QueryCancelledError):
            await calls[1]
        await wait_until(
            lambda: _cancelled_in(workdir, worker), within=30, what="the worker's cancel handler"
        )
        gate.unlink()
        assert [(await call)["key"] for call in (calls[0], calls[2])] == ["a", "c"]
    assert _cancelled_in(workdir, worker) == ["b"]


def _cancelled_in(workdir: Path, pid: int) -> list[str]:
    """The keys whose cancel handler ran in process `pid` (the caller's own runs too)."""
    return [
        event[1]
        for event in read_trace(workdir)
        if event[:1] == ["cancel"] and event[2] == str(pid)
    ]


@pytest.mark.parametrize("handler", ["held", "held_sync"])
async def test_a_timed_out_query_in_a_shared_worker_fails_alone(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    async with _lanes(workdir, monkeypatch, SHORT) as (pool, queue, gate):
        slow = asyncio.ensure_future(ask(queue, handler, "slow", _query("slow", seconds=3)))
        others = [
            asyncio.ensure_future(ask(queue, handler, key, _query(key))) for key in ("a", "b")
        ]
        await wait_until(lambda: len(_started(workdir)) == 3, within=30, what="three started")
        gate.unlink()  # the others end; the slow one sleeps past its timeout
        assert [(await call)["key"] for call in others] == ["a", "b"]
        with pytest.raises(QueryTimeoutError):
            await slow
        assert len(pool.pids()) == 1 and pool.describe()["terminated"] == 0


async def test_a_killed_worker_gives_back_all_it_ran_and_each_runs_again(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of a worker holding eight queries: each is taken back on its own and run
    again by its replacement; every waiter gets its result and no lane stays held."""
    async with _lanes(workdir, monkeypatch, EIGHT) as (pool, queue, gate):
        keys = [f"k{i}" for i in range(8)]
        calls = asyncio.gather(*(ask(queue, "held", key, _query(key)) for key in keys))
        await wait_until(lambda: len(_started(workdir)) == 8, within=30, what="eight started")
        (victim,) = pool.pids()
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: len(_started(workdir)) == 16, within=60, what="run again")
        gate.unlink()
        results = await calls
        assert sorted(result["key"] for result in results) == keys
        assert {result["pid"] for result in results} == set(pool.pids()) != {victim}
        await wait_until(lambda: pool.held == 0, within=30, what="no lane held")
        described = pool.describe()
        assert described["reclaimed"] == 8 and described["backlog"] == 0
        assert [worker["queries"] for worker in described["workers"]] == [[]]


async def test_a_retiring_worker_finishes_what_it_runs_and_takes_nothing_more(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _lanes(workdir, monkeypatch) as (pool, queue, gate):
        first = asyncio.gather(*(ask(queue, "held", key, _query(key)) for key in ("a", "b")))
        await wait_until(lambda: len(_started(workdir)) == 2, within=30, what="two started")
        (retiring,) = pool.pids()
        assert await pool.reload()  # every worker retires after what it holds
        later = asyncio.ensure_future(ask(queue, "held", "c", _query("c")))
        # Nothing takes it: pending in the store, for a worker that can start it.
        await wait_until(lambda: len(pool.store.pending("lanes")) == 1, within=30, what="c waits")
        assert pool.describe()["workers"][0]["state"] == "retiring"
        gate.unlink()
        assert {result["pid"] for result in await first} == {retiring}
        assert (await later)["pid"] not in (retiring, None)
    assert [event[1] for event in _started(workdir)] == ["a", "b", "c"]


async def test_worker_hooks_open_what_its_queries_share_and_close_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _lanes(workdir, monkeypatch) as (pool, queue, _):
        (pid,) = pool.pids()
        assert await ask(queue, "opened_by", "who", _query("who")) == pid
    events = [(event[0], event[2]) for event in read_trace(workdir) if event[1] == "-"]
    assert events == [("worker-start", str(pid)), ("worker-stop", str(pid))]


def test_the_pool_is_sized_by_its_budget_over_each_workers_lanes(workdir: Path) -> None:
    """Budget 4, 3 queries a worker: two workers by default; one is refused with the
    arithmetic, unless each runs 4."""
    command = [
        sys.executable, "-m", "queryqueue", "supervisor", "--db", str(workdir / "q.db"),
        "--socket", str(workdir / "s.sock"), "--app", LANES, "--workers", "1",
    ]  # fmt: skip
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--workers 1 runs 1 x 3 = 3: start it with --workers 2" in refused.stderr
    for options, size, each in (
        ((), 2, 3),
        (("--workers", "1", "--worker-concurrency", "4"), 1, 4),
    ):
        process = start_supervisor(
            workdir / "queue.db", workdir / "s.sock", "--app", LANES, *options
        )
        try:
            pool = asyncio.run(stats_of(process.socket_path))["pool"]
            assert (pool["size"], pool["worker_concurrency"]) == (size, each)
            assert [worker["concurrency"] for worker in pool["workers"]] == [each] * size
        finally:
            assert process.stop() == 0


async def test_the_budget_holds_across_hosts_whose_workers_run_more_or_fewer_at_once(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two supervisors on one PostgreSQL queue (budget 4): one with 4 workers x 1, one with
    2 x 3. Counted in the handlers, never more than 4 run at once, and each query once."""
    from tests.apps.lanes_app import app
    from tests.postgres_util import URL, drop_schema, fresh_schema, require_postgres

    require_postgres()
    schema = fresh_schema()
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    shapes = {"a": ("--workers", "4", "--worker-concurrency", "1"), "b": ("--workers", "2")}
    hosts = [
        launch(
            workdir / f"{name}.db", workdir / f"{name}.sock", "--schema", schema, "--app",
            LANES, *options, store=URL, cwd=REPO,
        )
        for name, options in shapes.items()
    ]  # fmt: skip
    drivers = [SocketQueueDriver(host.socket_path) for host in hosts]
    queues = [app.pool_queue(driver, continue_wait_timeout=30.0) for driver in drivers]
    try:
        keys = [f"k{i}" for i in range(16)]
        asked = [
            ask(queues[i % 2], "held_sync", key, _query(key, seconds=0.1))
            for i, key in enumerate(keys)
        ]
        results = await asyncio.gather(*asked)
        workers = [len((await driver.stats())["pool"]["workers"]) for driver in drivers]
    finally:
        await close_all(queues, drivers, hosts)
        drop_schema(schema)
    assert sorted(result["key"] for result in results) == sorted(keys)
    assert sorted(event[1] for event in _started(workdir)) == sorted(keys)  # each ran once
    assert 2 <= max_overlap(read_trace(workdir)) <= 4
    assert workers == [4, 2]


async def test_identical_queries_asked_without_a_key_share_one_execution(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`app.run(handler, query)`: the key is the query, so three identical calls share
    one execution and a different query runs apart."""
    from tests.apps.lanes_app import app

    async with _lanes(workdir, monkeypatch) as (_, _queue, gate):
        monkeypatch.setattr(app, "socket_path", workdir / "s.sock")
        try:
            same = [app.run("held", _query("same")) for _ in range(3)]
            running = asyncio.gather(*same, app.run("held", _query("other")))
            await wait_until(lambda: len(_started(workdir)) == 2, within=30, what="both started")
            gate.unlink()
            results = await running
        finally:
            await app.aclose()
    assert [result["key"] for result in results] == ["same", "same", "same", "other"]
    assert sorted(event[1] for event in _started(workdir)) == ["other", "same"]
