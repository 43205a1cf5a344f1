"""The supervisor is the authority on the queues its pool runs: their concurrency is its
app's, whatever a client's own QueueApp says; SIGHUP reloads its app instead of stopping
it; and a caller whose supervisor is away fails within its own timeout, told where it
looked."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import (
    Client,
    QueryTimeoutError,
    QueueApp,
    SocketQueueDriver,
    SqliteQueueStore,
    SupervisorUnavailableError,
    UnknownHandlerError,
    UnknownQueueError,
)
from queryqueue.engine.hashing import hash_query_key
from tests.supervisor_util import SupervisorProcess, start_supervisor, stats_of
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until

APP = "tests.apps.pool_app:app"  # concurrency 2


@pytest.fixture
def pool(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", APP, "--workers", "4"
    )
    try:
        yield process
    finally:
        assert process.stop() == 0


def _greedy_app(pool: SupervisorProcess) -> QueueApp:
    """A caller's app for the pool's queue whose code says concurrency 8 (a deploy that
    disagrees with the supervisor's)."""
    app = QueueApp("pool", concurrency=8, continue_wait_timeout=1.0, socket_path=pool.socket_path)
    app.handler("sql")(_runs_in_the_pool)
    return app


def _runs_in_the_pool(query: Any, set_cancel_handler: Any) -> Any:
    raise AssertionError("a caller ran a query its supervisor's pool runs")


async def test_a_callers_concurrency_never_exceeds_the_supervisors_budget(
    pool: SupervisorProcess, workdir: Path
) -> None:
    app = _greedy_app(pool)
    try:
        results = await asyncio.gather(
            *(
                app.run("sql", {"key": f"k{i}", "seconds": 0.2}, key=f"k{i}", priority=priority)
                for i in range(12)
                for priority in ((10,) if i % 2 else (0,))
            )
        )
    finally:
        await app.aclose()
    assert sorted(r["key"] for r in results) == sorted(f"k{i}" for i in range(12))
    trace = read_trace(workdir)
    assert len([t for t in trace if t[0] == "start"]) == 12
    assert max_overlap(trace) == 2  # the pool has 4 workers; the supervisor's budget is 2


async def test_sighup_leaves_the_supervisor_serving(pool: SupervisorProcess) -> None:
    os.kill(pool.pid, signal.SIGHUP)
    await wait_until(
        lambda: "reloading tests.apps.pool_app:app" in pool.log.read_text(),
        what="the supervisor's word on SIGHUP",
    )
    driver = SocketQueueDriver(pool.socket_path)
    try:
        assert await driver.ping() == "pong"
        assert (await driver.add("other:k", "{}")).added
    finally:
        await driver.close()
    assert pool.process.poll() is None


async def test_a_caller_with_a_timeout_is_not_held_by_a_missing_supervisor(
    workdir: Path,
) -> None:
    app = QueueApp("pool", continue_wait_timeout=1.0)
    app.handler("sql")(_runs_in_the_pool)
    app.socket_path = workdir / "nobody.sock"  # the driver would retry for 30 s
    try:
        # Bounded well below those 30 s: a caller held past its own timeout fails here.
        with pytest.raises(QueryTimeoutError, match="within 2 s"):
            await asyncio.wait_for(app.run("sql", {"key": "k"}, key="k", timeout=2), 15)
    finally:
        await app.aclose()


async def test_no_supervisor_names_the_socket_and_where_its_path_came_from(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUERYQUEUE_SOCKET", str(workdir / "env.sock"))
    from_env = SocketQueueDriver(reconnect_timeout=0.1)
    given = SocketQueueDriver(workdir / "given.sock", reconnect_timeout=0.1)
    try:
        with pytest.raises(SupervisorUnavailableError, match=r"env\.sock.*\$QUERYQUEUE_SOCKET"):
            await from_env.ping()
        with pytest.raises(SupervisorUnavailableError, match=r"given\.sock.*the one given"):
            await given.ping()
    finally:
        await from_env.close()
        await given.close()


async def test_a_stop_gives_back_what_ran_past_its_grace_for_the_next_supervisor(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    db, socket_path = workdir / "queue.db", workdir / "s.sock"
    first = start_supervisor(db, socket_path, "--app", APP, "--workers", "2", "--stop-grace", "0.3")
    second: SupervisorProcess | None = None
    app = _greedy_app(first)
    keys = ["slow1", "slow2"]
    callers = [
        asyncio.ensure_future(app.run("sql", {"key": key, "seconds": 3.0}, key=key, timeout=90))
        for key in keys
    ]
    try:
        await wait_until(
            lambda: len([t for t in read_trace(workdir) if t[0] == "start"]) == 2,
            what="both queries running",
        )
        assert await asyncio.to_thread(first.stop) == 0  # SIGTERM, past the grace
        log = first.log.read_text()
        for key in keys:
            assert "gave back queue item" in log and f"pool:{hash_query_key(key)}" in log
        store = SqliteQueueStore(db)
        try:
            assert sorted(item.id for item in store.pending("pool")) == sorted(
                hash_query_key(key) for key in keys
            )
            assert store.active("pool") == []
        finally:
            store.close()
        second = start_supervisor(db, socket_path, "--app", APP, "--workers", "2")
        results = await asyncio.wait_for(asyncio.gather(*callers), 60)
    finally:
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await app.aclose()
        if first.process.poll() is None:
            first.stop()
        if second is not None:
            assert second.stop() == 0
    assert sorted(result["key"] for result in results) == keys
    trace = read_trace(workdir)
    for key in keys:  # killed once at the stop, run once (to its end) by the next
        assert [t[0] for t in trace if t[1] == key] == ["start", "start", "end"]


async def test_status_shows_the_budget_of_the_queue_the_pool_runs(
    pool: SupervisorProcess,
) -> None:
    driver = SocketQueueDriver(pool.socket_path)
    try:
        assert (await driver.stats())["pool"]["budget"] == {"pool": 2}
    finally:
        await driver.close()
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "queryqueue", "status", "--socket", str(pool.socket_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # a row for the pool's queue, with no item in it yet
    assert shown.returncode == 0, shown.stderr
    header = next(line for line in shown.stdout.splitlines() if line.startswith("prefix"))
    row = next(line for line in shown.stdout.splitlines() if line.startswith("pool "))
    cells = dict(zip(header.split(" | "), row.split(" | "), strict=True))
    assert cells["budget"].strip() == "2"


async def test_an_add_for_a_queue_or_handler_the_pool_lacks_is_refused_at_once(
    pool: SupervisorProcess,
) -> None:
    """A caller whose queue name (a typo, another project on the same socket) or handler
    the supervisor does not serve gets an error naming what it does serve, at once,
    instead of waiting for a worker that never comes; nothing of it is queued."""
    driver = SocketQueueDriver(pool.socket_path)
    try:
        with pytest.raises(UnknownQueueError, match=r"no queue 'pooll' .* runs 'pool'"):
            await driver.add("pooll:k", '{"queryHandler": "sql", "query": 1}')
        with pytest.raises(UnknownHandlerError, match=r"no handler 'sqll' \(it has .*'sql'"):
            await driver.add("pool:k", '{"queryHandler": "sqll", "query": 1}')
        assert await driver.list_items("pooll") == [] and await driver.list_items("pool") == []
    finally:
        await driver.close()


async def test_a_thin_client_gets_results_without_the_handlers_code(
    pool: SupervisorProcess,
) -> None:
    client = Client(pool.socket_path)
    try:
        result = await client.run("pool", "sql", {"key": "thin", "seconds": 0}, key="thin")
        assert result["key"] == "thin" and result["pid"] != os.getpid()
        with pytest.raises(UnknownHandlerError):
            await client.run("pool", "nope", {}, key="k")
    finally:
        await client.aclose()
    loop_free = await asyncio.to_thread(
        Client(pool.socket_path).run_sync, "pool", "sql", {"key": "sync", "seconds": 0}
    )
    assert loop_free["key"] == "sync"


def test_a_budget_its_workers_cannot_run_is_refused_and_the_default_pool_follows_it(
    workdir: Path,
) -> None:
    refused = subprocess.run(
        [
            sys.executable, "-m", "queryqueue", "supervisor", "--db", str(workdir / "q.db"),
            "--socket", str(workdir / "s.sock"), "--app", APP, "--workers", "1",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "may run 2 queries at once (concurrency=2), but --workers 1 runs 1" in refused.stderr
    assert not (workdir / "q.db").exists()  # refused before anything was opened
    process = start_supervisor(workdir / "queue.db", workdir / "s.sock", "--app", APP)
    try:
        stats = asyncio.run(stats_of(process.socket_path))
        assert stats["pool"]["size"] == 2  # the queue's concurrency
    finally:
        assert process.stop() == 0


async def test_two_queues_on_one_supervisor_each_run_within_their_own_budget(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One supervisor serves several queues (an --app each), each with its own budget and
    workers; a thin client gets results from both, and a handler one queue lacks is
    refused though the other has it."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_supervisor(
        workdir / "queue.db", workdir / "s.sock",
        "--app", "tests.apps.pool_app:one", "--app", "tests.apps.pool_app:three",
    )  # fmt: skip
    client = Client(process.socket_path)
    try:
        asked = [("one", f"one-{i}") for i in range(4)] + [
            ("three", f"three-{i}") for i in range(9)
        ]
        results = await asyncio.gather(
            *(
                client.run(queue, "sql", {"key": key, "seconds": 0.2}, key=key)
                for queue, key in asked
            )
        )
        assert sorted(r["key"] for r in results) == sorted(key for _, key in asked)
        with pytest.raises(UnknownHandlerError, match="queue 'one' has no handler 'hoard'"):
            await client.run("one", "hoard", {"bytes": 1}, key="h")
        stats = await client.queue("one").driver.stats()
    finally:
        await client.aclose()
        assert process.stop() == 0
    trace = read_trace(workdir)
    peaks = {
        queue: max_overlap([t for t in trace if t[1].startswith(f"{queue}-")])
        for queue in ("one", "three")
    }
    assert peaks == {"one": 1, "three": 3}
    assert stats["pool"]["budget"] == {"one": 1, "three": 3} and stats["pool"]["size"] == 4
    assert [p["budget"] for p in stats["pools"]] == [{"one": 1}, {"three": 3}]
