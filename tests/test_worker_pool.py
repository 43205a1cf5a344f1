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

from queryqueue import ContinueWaitError, SocketQueueDriver, SqliteQueueStore
from tests.pool_util import ask
from tests.supervisor_util import REPO, SupervisorProcess, start_supervisor
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until_sync

APP = "tests.apps.pool_app:app"
SINGLE = "tests.apps.pool_app:single"  # one query at a time

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


def _start_pool(workdir: Path, workers: int, *options: str, app: str = APP) -> SupervisorProcess:
    return start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", app, "--workers", str(workers), *options
    )


@pytest.fixture
def pool(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = _start_pool(workdir, 3)
    try:
        yield process
    finally:
        assert process.stop() == 0


def _env(workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "QUERYQUEUE_SOCKET": str(workdir / "s.sock"),
        "POOL_TRACE": str(workdir / "trace"),
    }


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
            env=_env(workdir),
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
        env=_env(workdir),
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


def test_a_worker_holding_the_gil_is_not_reaped_while_alive(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = _start_pool(workdir, 2)
    try:
        gil = subprocess.run(
            [sys.executable, "-c", GIL_CLIENT],
            capture_output=True,
            text=True,
            env=_env(workdir),
            cwd=REPO,
            timeout=100,
        )
        assert gil.returncode == 0, gil.stderr[-3000:]
        held, beats = gil.stdout.split()
        assert float(held) > 1.0  # longer than the 1 s heartbeat timeout (4 x 0.25 s)
        assert int(beats) > 3  # other queries kept reconciling meanwhile
        assert not [t for t in read_trace(workdir) if t[0] == "cancel"]
    finally:
        assert supervisor.stop() == 0
    store = SqliteQueueStore(workdir / "queue.db")
    try:
        assert store.list_items("pool") == []
    finally:
        store.close()


GIL_CLIENT = textwrap.dedent(
    """
    import asyncio, time
    from queryqueue.engine.errors import QueueError
    from tests.apps.pool_app import app

    async def main():
        queue = app.client_queue()
        # 4 s asked: a loaded machine's calibration can make the call shorter by half or
        # more (0.93 s of 2.5 asked, once), and it must outlast the 1 s heartbeat timeout.
        long = asyncio.ensure_future(ask("gil", "gil-key", {"seconds": 4.0}))
        beats = 0
        while not long.done():  # keep reconciling: a stale heartbeat would be reaped now
            await ask("sql", f"beat-{beats}", {"key": f"beat-{beats}", "seconds": 0.01})
            beats += 1
        print(await long, beats)
        await queue.shutdown()
        await queue.driver.close()

    async def ask(handler, key, query):
        while True:
            try:
                return await app.execute_in_queue(handler, key, query)
            except QueueError:
                pass

    asyncio.run(main())
    """
)


async def test_a_cancelled_query_that_does_not_stop_costs_its_worker(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app
    from tests.waiting import wait_until

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = _start_pool(workdir, 2, "--cancel-grace", "1")
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=0.2)
    caller = asyncio.ensure_future(queue.execute_in_queue("stubborn", "s1", {"key": "s1"}))
    try:
        await wait_until(
            lambda: any(t[:2] == ["start", "s1"] for t in read_trace(workdir)), within=30
        )
        victim = int(next(t for t in read_trace(workdir) if t[:2] == ["start", "s1"])[2])
        (item,) = await driver.list_items("pool")
        cancelled_at = time.monotonic()
        assert await driver.cancel(item.queue_id) is not None  # removed by someone else
        # the worker's heartbeat notices and calls the cancel handler where the query runs...
        await wait_until(
            lambda: ["cancel", "s1", str(victim)] in [t[:3] for t in read_trace(workdir)], within=10
        )
        # ...and the query ignores it: after the grace period the worker is terminated
        await wait_until(lambda: _stats_pool(driver, "terminated", 1), within=15)
        assert time.monotonic() - cancelled_at < 1 + 5  # grace + a few heartbeat rounds
        await wait_until(lambda: _stats_pool(driver, "replaced", 1), within=15)
        pids = [w["pid"] for w in (await driver.stats())["pool"]["workers"]]
        assert victim not in pids and len(pids) == 2
    finally:
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


async def _stats_pool(driver: SocketQueueDriver, counter: str, value: int) -> bool:
    return bool((await driver.stats())["pool"][counter] == value)


async def test_workers_are_recycled_after_max_tasks(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import single as app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = _start_pool(workdir, 1, "--max-tasks-per-worker", "2", app=SINGLE)
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = app.pool_queue(driver)
    try:
        pids = []
        for i in range(5):  # one after the other: each waits for its own result
            deadline = time.monotonic() + 60
            while True:
                try:
                    result = await queue.execute_in_queue(
                        "sql", f"r{i}", {"key": f"r{i}", "seconds": 0}
                    )
                    break
                except ContinueWaitError:  # a recycled worker is still starting: ask again
                    assert time.monotonic() < deadline
            assert result["key"] == f"r{i}"
            pids.append(result["pid"])
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        stats = (await driver.stats())["pool"]
        assert stats["recycled"] >= 2 and stats["replaced"] == 0 and len(stats["workers"]) == 1
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


async def test_large_results_travel_through_shared_memory_and_leave_nothing(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from queryqueue.driver_socket.segments import SHM_DIR, name_prefix
    from tests.apps.pool_app import app, big_text
    from tests.waiting import wait_until

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    prefix = name_prefix(workdir / "s.sock")
    supervisor = _start_pool(workdir, 2)
    drivers = [SocketQueueDriver(supervisor.socket_path) for _ in range(3)]
    queues = [app.pool_queue(driver) for driver in drivers]
    try:
        size = 100 * 1024 * 1024
        text = await ask(queues[0], "big", "huge", {"key": "huge", "size": size})
        expected = hashlib.sha256(big_text(size, "huge").encode()).hexdigest()
        assert len(text) == size and hashlib.sha256(text.encode()).hexdigest() == expected
        del text
        # Three connections wait for one 3 MiB result: one execution, three readers.
        size = 3 * 1024 * 1024
        texts = await asyncio.gather(
            *(ask(q, "big", "shared", {"key": "shared", "size": size}) for q in queues)
        )
        assert texts == [big_text(size, "shared")] * 3
        assert [t[1] for t in read_trace(workdir) if t[0] == "start"] == ["huge", "shared"]
        shm = (await drivers[0].stats())["shared_memory"]
        assert shm["created"] >= 1 and shm["segments"] == len(list(SHM_DIR.glob(prefix + "*")))

        async def all_returned() -> bool:
            shm = (await drivers[0].stats())["shared_memory"]
            return bool(shm["stored"] == 0 and shm["writing"] == 0)

        await wait_until(all_returned, within=15)  # every reader released its lease
    finally:
        for queue, driver in zip(queues, drivers, strict=True):
            await queue.shutdown(grace=0)
            await driver.close()
        assert supervisor.stop() == 0
    assert list(SHM_DIR.glob(prefix + "*")) == []


async def test_priority_decides_who_runs_next_through_the_pool(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app
    from tests.waiting import wait_until

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = _start_pool(workdir, 2)
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = app.pool_queue(driver)
    try:
        # Both slots of the prefix (concurrency 2) busy...
        blockers = [
            asyncio.ensure_future(ask(queue, "sql", f"b{i}", {"key": f"b{i}", "seconds": 1.5}))
            for i in range(2)
        ]
        await wait_until(lambda: sum(t[0] == "start" for t in read_trace(workdir)) == 2, within=30)
        # ...then background work, then urgent work, all waiting for a slot.
        low = [
            asyncio.ensure_future(ask(queue, "sql", f"low{i}", {"key": f"low{i}"}, priority=0))
            for i in range(3)
        ]
        await asyncio.sleep(0)
        high = [
            asyncio.ensure_future(ask(queue, "sql", f"high{i}", {"key": f"high{i}"}, priority=5))
            for i in range(3)
        ]
        await asyncio.gather(*blockers, *low, *high)
        # The supervisor retrieved and handed off every item itself: no process did it
        # over the socket (priority 5 is below the fast track).
        assert "retrieve" not in (await driver.stats())["commands"]
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0
    started = {t[1]: float(t[3]) for t in read_trace(workdir) if t[0] == "start"}
    assert len(started) == 8  # each once
    # Slots are filled in priority order: every urgent item is retrieved before any
    # background one. Two retrieved in one batch (two slots freed together) race to their
    # workers, so one background item may start a moment before the last urgent one.
    last_high = max(started[f"high{i}"] for i in range(3))
    early = [i for i in range(3) if started[f"low{i}"] < last_high]
    assert len(early) <= 1, (early, started)
    assert min(started[f"high{i}"] for i in range(3)) <= min(started[f"low{i}"] for i in range(3))
    assert max_overlap(read_trace(workdir)) == 2


async def test_an_execution_timeout_in_a_worker_reaches_its_cancel_handler(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from queryqueue.engine.errors import QueryError
    from tests.apps.pool_app import short
    from tests.waiting import wait_until

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = start_supervisor(
        workdir / "queue.db",
        workdir / "s.sock",
        "--app",
        "tests.apps.pool_app:short",
        "--workers",
        "1",
        "--cancel-grace",
        "1",
    )
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = short.pool_queue(driver)
    try:
        asked_at = time.monotonic()
        with pytest.raises(QueryError, match="timeout"):
            await ask(queue, "sql", "slow", {"key": "slow", "seconds": 30})
        assert time.monotonic() - asked_at < 10
        (start,) = [t for t in read_trace(workdir) if t[0] == "start"]
        # The cancel handler ran in the worker that ran the query (in the background: the
        # timeout's ACK may reach the caller before its record is written)...
        await wait_until(
            lambda: ["cancel", "slow", start[2]] in [t[:3] for t in read_trace(workdir)],
            within=10,
            what="the cancel handler's record",
        )
        # ...whose thread kept sleeping: the worker is terminated after the grace, replaced.
        await wait_until(lambda: _stats_pool(driver, "terminated", 1), within=15)
        await wait_until(lambda: _stats_pool(driver, "replaced", 1), within=15)
        fresh = await ask(queue, "sql", "quick", {"key": "quick", "seconds": 0})
        assert fresh["pid"] != int(start[2])
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


async def test_workers_are_recycled_above_max_memory(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import single as app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = _start_pool(workdir, 1, "--max-memory-per-worker", "150", app=SINGLE)
    driver = SocketQueueDriver(supervisor.socket_path)
    queue = app.pool_queue(driver)
    try:
        small = [await ask(queue, "hoard", f"s{i}", {"bytes": 1024}) for i in range(2)]
        assert small[0] == small[1]  # well under the limit: the same worker
        big = [await ask(queue, "hoard", f"b{i}", {"bytes": 200 * 1024 * 1024}) for i in range(2)]
        assert big[0] == small[0]  # over the limit only after this query...
        assert big[1] != big[0]  # ...so the next one runs in a fresh worker
        stats = (await driver.stats())["pool"]
        assert stats["recycled"] >= 1 and stats["replaced"] == 0
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert supervisor.stop() == 0


def test_each_event_loop_gets_its_own_client_queue(workdir: Path) -> None:
    from queryqueue.app import QueueApp

    app = QueueApp("loops")
    app.socket_path = workdir / "s.sock"

    async def mine() -> Any:
        queue = app.client_queue()
        assert app.client_queue() is queue  # one per loop...
        return queue

    first, second = asyncio.run(mine()), asyncio.run(mine())
    assert first is not second  # ...and a new loop never inherits a closed loop's queue


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
