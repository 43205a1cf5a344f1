"""End to end: a supervisor with a worker pool, and request processes that submit to it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import SocketQueueDriver
from tests.supervisor_util import REPO, SupervisorProcess
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until_sync
from tests.worker_pool_util import pool_env, start_pool

REQUESTS = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from pathlib import Path
    from queryqueue.engine.errors import QueueError
    from tests.apps.pool_app import app

    go, keys = Path(sys.argv[1]), sys.argv[2].split(",")
    seconds = float(sys.argv[3])
    # Wait for results without going back in between: a caller that retries after another
    # process consumed the result (by path, once) would enqueue the query again, by design.
    app.queue_options["continue_wait_timeout"] = float(sys.argv[4])

    async def ask(key):
        while True:
            try:
                return await app.execute_in_queue("sql", key, {"key": key, "seconds": seconds})
            except QueueError:  # continue wait: ask again
                pass

    async def main():
        print("ready", flush=True)
        while not go.exists():
            await asyncio.sleep(0.005)
        results = await asyncio.gather(*(ask(key) for key in keys))
        stream = await app.execute_in_queue("stream", "rows", {"rows": 3})
        rows = await stream.rows()
        ran_in = sorted({r["pid"] for r in results})
        print("pids", json.dumps([os.getpid(), ran_in, sorted({r["pid"] for r in rows})]))
        print("results", ",".join(r["key"] for r in results), flush=True)
        queue = app.client_queue()
        await queue.shutdown()
        await queue.driver.close()

    asyncio.run(main())
    """
)


@pytest.fixture
def pool(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_pool(workdir, 3)
    try:
        yield process
    finally:
        assert process.stop() == 0


def _pool(supervisor: SupervisorProcess) -> dict[str, Any]:
    async def ask() -> dict[str, Any]:
        driver = SocketQueueDriver(supervisor.socket_path)
        try:
            return dict((await driver.stats())["pool"])
        finally:
            await driver.close()

    return asyncio.run(ask())


def _worker_pids(supervisor: SupervisorProcess) -> list[int]:
    return [worker["pid"] for worker in _pool(supervisor)["workers"]]


def test_requests_from_many_processes_run_once_in_the_pool_within_concurrency(
    pool: SupervisorProcess, workdir: Path
) -> None:
    keys = [f"k{i}" for i in range(6)]
    go = workdir / "go"
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", REQUESTS, str(go), ",".join(keys), "0.3", "30"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=pool_env(workdir),
            cwd=REPO,
        )
        for _ in range(3)
    ]
    try:
        for client in clients:
            assert client.stdout is not None and client.stdout.readline().strip() == "ready"
        go.touch()  # everyone submits the same six queries at once
        # Well under the clients' 30 s long poll: a stream owner that waited for one (its
        # item behind the budget, nobody nudging it) would miss this deadline.
        outputs = [client.communicate(timeout=25) for client in clients]
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(timeout=20)
    workers = set(_worker_pids(pool))
    for client, (out, err) in zip(clients, outputs, strict=True):
        assert client.returncode == 0, err[-3000:]
        lines = dict(line.split(" ", 1) for line in out.splitlines())
        assert lines["results"] == ",".join(keys)
        pid, ran_in, streamed_in = orjson.loads(lines["pids"])
        assert set(ran_in) <= workers  # queries ran in the pool...
        assert streamed_in == [pid]  # ...the stream in the process that asked
    trace = read_trace(workdir)
    starts = [t for t in trace if t[0] == "start"]
    assert sorted(t[1] for t in starts) == keys  # one execution per key for all 18 requests
    assert max_overlap(trace) == 2  # concurrency 2, although the pool has 3 workers


def test_a_killed_worker_is_replaced_and_its_item_reclaimed_at_once(
    pool: SupervisorProcess, workdir: Path
) -> None:
    go = workdir / "go"
    go.touch()
    client = subprocess.Popen(
        [sys.executable, "-c", REQUESTS, str(go), "slow", "30", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=pool_env(workdir),
        cwd=REPO,
    )
    try:
        wait_until_sync(
            lambda: any(t[0] == "start" for t in read_trace(workdir)),
            within=60,
            what="query running",
        )
        victim = int(next(t for t in read_trace(workdir) if t[0] == "start")[2])
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # reclaimed through the store at once, not a heartbeat timeout later
        wait_until_sync(
            lambda: any(t[0] == "cancel" for t in read_trace(workdir)), within=10, what="reclaim"
        )
        reclaimed_in = time.monotonic() - killed_at
        assert reclaimed_in < 2.0
        wait_until_sync(lambda: _pool(pool)["replaced"] == 1, within=30, what="worker replaced")
        assert len(_worker_pids(pool)) == 3 and victim not in _worker_pids(pool)
        # the caller's retry runs it afresh (in another worker) and gets a result
        wait_until_sync(lambda: sum(t[0] == "start" for t in read_trace(workdir)) == 2, within=60)
        second = [t for t in read_trace(workdir) if t[0] == "start"][1]
        assert int(second[2]) != victim
        client.send_signal(signal.SIGTERM)
    finally:
        if client.poll() is None:
            client.kill()
        client.communicate(timeout=20)  # reaps it and closes its pipes


async def test_the_fast_track_is_dispatched_by_the_supervisor_in_two_round_trips(
    pool: SupervisorProcess,
) -> None:
    """Priority 10 with room: ADD_AND_RETRIEVE retrieves it and the supervisor hands it to
    its pool in the same turn; the caller sends no DISPATCH and no RESULT read first."""
    from tests.apps.pool_app import app

    driver = SocketQueueDriver(pool.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=10.0)
    try:
        before = (await driver.stats())["commands"]
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0.01}, priority=10
        )
        assert answer["pid"] in {w["pid"] for w in (await driver.stats())["pool"]["workers"]}
        after = (await driver.stats())["commands"]
    finally:
        await queue.shutdown(grace=0)
        await driver.close()

    def sent(name: str) -> int:
        return int(after.get(name, {}).get("count", 0)) - int(before.get(name, {}).get("count", 0))

    assert sent("add_and_retrieve") == 1
    assert sent("result_blocking") == 1
    assert sent("dispatch") == 0 and sent("result") == 0 and sent("add") == 0
    # startQueryTime was recorded in the batch that retrieved it, and the handler's cancel
    # handler goes through the worker's pipe (`WorkerWatch`): no MERGE_EXTRA at all.
    assert sent("merge_extra") == 0


async def test_a_batch_that_retrieved_for_the_pool_starts_no_reconcile_of_its_own(
    pool: SupervisorProcess,
) -> None:
    """A fast-tracked query's ADD batch and its ACK batch each try the pool's retrieval in
    the transaction (finding nothing more): each used to poke a reconcile as well, two
    ACTIVE and PENDING listings per query for nothing. Only the periodic ones remain: the
    sweep's (every 0.5 s) and the pool's heartbeat round's (this app's 0.25 s)."""
    from tests.apps.pool_app import app

    driver = SocketQueueDriver(pool.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=10.0)
    queries = 30
    try:
        await queue.execute_in_queue("sql", "warm", {"key": "warm", "seconds": 0}, priority=10)
        before = (await driver.stats())["pool"]["reconciles"]
        started = time.monotonic()
        for i in range(queries):
            answer = await queue.execute_in_queue(
                "sql", f"q{i}", {"key": f"q{i}", "seconds": 0}, priority=10
            )
            assert answer["key"] == f"q{i}"
        elapsed = time.monotonic() - started
        after = (await driver.stats())["pool"]["reconciles"]
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
    # The sweep's and the heartbeat round's, each with one in flight at either end (30
    # queries take well under a second: per-query reconciles, 62 before, exceed this).
    periodic = int(elapsed / 0.5) + int(elapsed / 0.25) + 3
    assert after - before <= periodic, (after - before, elapsed)


async def test_the_retrieving_batch_records_when_a_queued_query_started(
    pool: SupervisorProcess,
) -> None:
    """Cube's processQuery records startQueryTime right after RETRIEVE: the supervisor
    writes it in the transaction that retrieved the item for its pool, so the worker sends
    no MERGE_EXTRA of its own. The cancel handler its sync handler sets while it runs on
    the worker's loop thread is recorded while it runs (through the pool: no MERGE_EXTRA)."""
    from queryqueue.engine.connection import decode_def
    from tests.apps.pool_app import app
    from tests.waiting import wait_until

    driver = SocketQueueDriver(pool.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=10.0)
    path = f"{queue.prefix}:{queue.hash_query_key('slow')}"
    seen: dict[str, Any] = {}

    async def started() -> bool:
        definition = decode_def(await driver.get(path))
        seen.update(definition or {})
        return definition is not None and "cancelHandler" in definition

    try:
        before = (await driver.stats())["commands"]
        asked_ms = time.time() * 1000
        running = asyncio.ensure_future(
            queue.execute_in_queue("sql", "slow", {"key": "slow", "seconds": 0.5})
        )
        await wait_until(started, what="the query running, its cancel handler recorded")
        assert asked_ms - 1 <= seen["startQueryTime"] <= time.time() * 1000
        answer = await running
        assert answer["key"] == "slow"
        after = (await driver.stats())["commands"]
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
    merges = after.get("merge_extra", {}).get("count", 0)
    assert merges == before.get("merge_extra", {}).get("count", 0)
    assert seen["cancelHandler"] == {"pid": answer["pid"]}


def test_pool_workers_are_batch_scheduled(pool: SupervisorProcess) -> None:
    """Workers run queries, the supervisor coordinates: a worker it wakes (a hand-off, an
    ACK's answer) does not preempt it (SCHED_BATCH), so the supervisor's turn finishes."""
    pids = _worker_pids(pool)
    assert pids
    for pid in pids:
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH
    assert os.sched_getscheduler(pool.pid) == os.SCHED_OTHER
