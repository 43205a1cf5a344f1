"""The worker pool when things go wrong on purpose: spawns that fail, a query that kills
its worker, a worker that is stopped, a supervisor that dies under its workers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import multiprocess
import orjson
import psutil
import pytest

from queryqueue import (
    MemoryQueueStore,
    QueryCancelledError,
    QueryTimeoutError,
    SocketQueueDriver,
    WorkerLostError,
)
from queryqueue.supervisor.pool import WorkerPool
from tests.apps.harsh_app import app
from tests.pool_util import pool_server
from tests.supervisor_util import SupervisorProcess, start_supervisor
from tests.trace import read_trace
from tests.waiting import wait_until

APP = "tests.apps.harsh_app:app"


@pytest.fixture
async def harsh(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    supervisor = start_supervisor(
        workdir / "queue.db",
        workdir / "s.sock",
        "--app",
        APP,
        "--workers",
        "2",
        "--cancel-grace",
        "1",
    )
    app.socket_path = supervisor.socket_path
    try:
        yield supervisor
    finally:
        await app.aclose(grace=0)
        if supervisor.process.poll() is None:
            assert supervisor.stop() == 0


async def _pool(supervisor: SupervisorProcess) -> dict[str, Any]:
    driver = SocketQueueDriver(supervisor.socket_path)
    try:
        return dict((await driver.stats())["pool"])
    finally:
        await driver.close()


def _starts(workdir: Path, key: str) -> list[list[str]]:
    return [t for t in read_trace(workdir) if t[0] == "start" and t[1] == key]


def _one_long_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers of one key keep their long polls open throughout: between two polls
    (the app's 0.5 s), a caller whose re-ADD comes after the other's has read the result
    by path runs the query again, by design, which these tests count."""
    monkeypatch.setitem(app.queue_options, "continue_wait_timeout", 60.0)


async def test_a_query_that_kills_its_worker_three_times_fails_for_every_waiter(
    harsh: SupervisorProcess, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _one_long_poll(monkeypatch)
    waiters = [app.run("suicide", {"key": "doom"}, key="doom", timeout=60) for _ in range(2)]
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert [type(o) for o in outcomes] == [WorkerLostError] * 2
    assert "killed its worker 3 times" in str(outcomes[0])
    assert len(_starts(workdir, "doom")) == 3  # not a fourth time
    await wait_until(lambda: _pool_size(harsh, 2), within=30, what="workers replaced")
    assert (await _pool(harsh))["replaced"] == 3
    assert "killed its worker 3 times" in harsh.log.read_text()
    assert f"harsh:{app.client_queue().hash_query_key('doom')}" in harsh.log.read_text()


async def _pool_size(supervisor: SupervisorProcess, size: int) -> bool:
    return bool((await _pool(supervisor))["alive"] == size)


async def test_a_stopped_worker_is_timed_out_by_the_supervisor_and_replaced(
    harsh: SupervisorProcess, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _one_long_poll(monkeypatch)
    waiters = [
        asyncio.ensure_future(app.run("sleep", {"key": "stuck", "seconds": 30}, key="stuck"))
        for _ in range(2)
    ]
    await wait_until(lambda: _starts(workdir, "stuck"), within=30, what="started")
    victim = int(_starts(workdir, "stuck")[0][2])
    os.kill(victim, signal.SIGSTOP)  # it cannot enforce its own timeout now
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 30)
    finally:
        # The supervisor may end it between any look and the signal: none is needed then.
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert [type(o) for o in outcomes] == [QueryTimeoutError] * 2
    assert "the worker did not stop it" in str(outcomes[0])
    await wait_until(lambda: not psutil.pid_exists(victim) or _zombie(victim), within=10)
    await wait_until(lambda: _pool_size(harsh, 2), within=30, what="replaced")
    assert (await _pool(harsh))["terminated"] == 1
    assert len(_starts(workdir, "stuck")) == 1


def _zombie(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


async def test_a_worker_whose_supervisor_dies_finishes_its_query_without_spinning(
    harsh: SupervisorProcess, workdir: Path
) -> None:
    caller = asyncio.ensure_future(app.run("sleep", {"key": "orphan", "seconds": 2}, key="orphan"))
    await wait_until(lambda: _starts(workdir, "orphan"), within=30, what="started")
    worker = psutil.Process(int(_starts(workdir, "orphan")[0][2]))
    queue_id = next(
        q["queueId"] for q in await app.client_queue().get_queries() if q["status"] == ["active"]
    )
    harsh.kill9()
    # Its supervisor is gone: the worker waits for its query, it does not spin.
    assert worker.cpu_percent(interval=1.0) < 30.0
    # A supervisor back on the socket gets the finished query's ACK: no work lost.
    back = start_supervisor(workdir / "queue.db", harsh.socket_path)
    try:
        await wait_until(lambda: not worker.is_running() or _zombie(worker.pid), within=40)
        # Asked of the supervisor: it holds its database for as long as it runs.
        driver = SocketQueueDriver(back.socket_path)
        try:
            found = await driver.result(queue_id)
        finally:
            await driver.close()
        assert found is not None and '"slept":2' in str(found.payload)
    finally:
        assert back.stop() == 0
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
    assert len(_starts(workdir, "orphan")) == 1


class _FlakyContext:
    """multiprocess's spawn context, but the first `failures` spawns fail with EMFILE and
    the processes are stand-ins (no real worker is needed to count them)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.started = 0

    def Pipe(self) -> Any:
        return multiprocess.get_context("spawn").Pipe()

    def Process(self, **_: Any) -> _StandIn:
        return _StandIn(self)


class _StandIn:
    def __init__(self, context: _FlakyContext) -> None:
        self.context = context
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self.pid = 4_000_000 + context.started
        self.exitcode: int | None = None

    def start(self) -> None:
        if self.context.failures:
            self.context.failures -= 1
            os.close(self._read)
            os.close(self._write)
            raise OSError(errno.EMFILE, "Too many open files")
        self.context.started += 1

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


async def test_failed_spawns_are_retried_and_the_pool_says_it_is_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    context = _FlakyContext(failures=3)
    pool = WorkerPool(APP, "/tmp/unused.sock", MemoryQueueStore(), workers=2, context=context)
    with caplog.at_level("WARNING", logger="queryqueue.pool"):
        await pool.start()
        try:
            short = pool.describe()
            assert short["alive"] == 0 and short["size"] == 2
            assert "Too many open files" in str(short["spawn_error"])
            await wait_until(lambda: pool.describe()["alive"] == 2, within=10, what="refilled")
            assert pool.describe()["spawn_failures"] == 3
            assert pool.describe()["spawn_error"] is None
        finally:
            await pool.stop(grace=0)
    assert "worker spawn failed (OSError: [Errno 24] Too many open files)" in caplog.text
    assert "the pool has 0 of 2 workers" in caplog.text


def _kill_as_its_ack_commits(
    monkeypatch: pytest.MonkeyPatch, server: Any, pool: WorkerPool
) -> list[tuple[int, str, Any]]:
    """Once: the worker whose ACK a batch settled, killed right after the settle sent it
    its next query; (its pid, that query's path, the acknowledged queue id)."""
    killed: list[tuple[int, str, Any]] = []
    settle = server.runner.settle

    def settle_then_kill(batch: list[Any], answers: Any, for_pool: Any) -> None:
        keys = [r.args[0] for r in batch if r.method == "ack" and r.args]
        holders = [
            w
            for w in pool.slots.workers
            if w.job is not None and any(k in (w.job.queue_id, w.job.path) for k in keys)
        ]
        settle(batch, answers, for_pool)  # the ACK ends its query; the next is sent
        for worker in holders:
            sent, finished = worker.job, worker.finished
            if not killed and sent is not None and finished is not None:
                killed.append((worker.process.pid, sent.path, finished.queue_id))
                os.kill(worker.process.pid, signal.SIGKILL)

    monkeypatch.setattr(server.runner, "settle", settle_then_kill)
    return killed


async def test_a_worker_killed_as_its_ack_commits_loses_nothing(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ACK's commit ends a worker's query: its next is sent to it in that same turn,
    with no word from the worker. Killed right then, holding that next query (sent, maybe
    not started): the acknowledged query is not reclaimed (its result stands), and the one
    sent goes back to the queue and runs in a live worker."""
    from queryqueue.supervisor.server import QueueServer
    from tests.apps.pool_app import app as pool_app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=2)
    server = QueueServer(store, workdir / "s.sock", pool=pool)
    killed = _kill_as_its_ack_commits(monkeypatch, server, pool)
    await server.start()
    driver = SocketQueueDriver(server.socket_path)
    queue = pool_app.pool_queue(driver)
    try:
        await pool.start()
        asks = [
            asyncio.ensure_future(queue.run("sql", key, {"key": key, "seconds": seconds}))
            for key, seconds in (("fast0", 0.05), ("fast1", 0.05))
        ]
        await wait_until(lambda: len(_starts(workdir, "fast1")) == 1, within=30)
        asks += [
            asyncio.ensure_future(queue.run("sql", key, {"key": key, "seconds": 3.0}))
            for key in ("slow2", "slow3")
        ]
        await wait_until(lambda: killed, within=30, what="a worker killed as its ACK committed")
        pid, sent, finished_id = killed[0]
        results = await asyncio.wait_for(asyncio.gather(*asks), timeout=60)
        assert [r["key"] for r in results] == ["fast0", "fast1", "slow2", "slow3"]
        paths = {f"{queue.prefix}:{queue.hash_query_key(r['key'])}": r for r in results}
        assert paths[sent]["key"].startswith("slow")
        assert paths[sent]["pid"] != pid, "it ran again, in a live worker"
        described = pool.describe()
        assert described["replaced"] == 1
        assert finished_id not in pool.takeback.reclaimed, (
            "the acknowledged query was done, not lost"
        )
        assert len(pool.takeback.reclaimed) == 1  # the one sent to it
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        await pool.stop(grace=0)
        await server.stop()


async def test_a_query_that_comes_while_a_cancelled_handler_thread_drains_waits_for_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled sync handler's thread runs on: its worker ACKs, says it is draining,
    and takes nothing new until the thread ends. The query that waits meanwhile runs
    there once the thread has ended."""
    from queryqueue.supervisor.server import QueueServer
    from tests.apps.pool_app import app as pool_app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=1)
    server = QueueServer(store, workdir / "s.sock", pool=pool)
    await server.start()
    driver = SocketQueueDriver(server.socket_path)
    queue = pool_app.pool_queue(driver)
    try:
        await pool.start()
        first = asyncio.ensure_future(queue.run("sql", "s1", {"key": "s1", "seconds": 2.0}))
        second: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await wait_until(lambda: _starts(workdir, "s1"), within=30, what="s1 running")
        second = asyncio.ensure_future(queue.run("sql", "s2", {"key": "s2", "seconds": 0.05}))
        # No lane to start it: pending in the store, not retrieved to wait in the pool.
        await wait_until(lambda: len(store.pending(queue.prefix)) == 1, what="s2 pending")
        s1 = queue.hash_query_key("s1")
        (running,) = [i for i in await driver.list_items(queue.prefix) if i.id == s1]
        assert await driver.cancel(running.queue_id) is not None
        await wait_until(
            lambda: pool.slots.workers[0].draining_since is not None, what="the worker draining"
        )
        assert not _starts(workdir, "s2"), "nothing starts beside a draining thread"
        result = await asyncio.wait_for(second, timeout=30)
        (worker,) = pool.slots.workers
        assert result["pid"] == worker.process.pid  # the same worker, once it had drained
        ((end_s1,),) = [[float(t[3])] for t in read_trace(workdir) if t[:2] == ["end", "s1"]]
        ((start_s2,),) = [[float(t[3])] for t in _starts(workdir, "s2")]
        assert start_s2 >= end_s1
        assert worker.draining_since is None and worker.next is None
        assert pool.describe()["terminated"] == 0
    finally:
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await queue.shutdown(grace=0)
        await driver.close()
        await pool.stop(grace=0)
        await server.stop()


async def test_a_live_workers_query_is_not_reaped_while_its_heartbeats_cannot_land(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store loses every heartbeat (it is away for them) while the store's clock runs
    past the stall timeout: the item looks stalled to the pool's reaper, which runs every
    round. But the pool holds it for a live worker: not reclaimed, it runs once, and its
    caller gets its answer."""
    from queryqueue.engine.clock import ManualClock
    from queryqueue.engine.errors import StoreError

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    clock = ManualClock()
    store = MemoryQueueStore(clock=clock)
    lost: list[Any] = []
    looked: list[Any] = []
    heartbeat, to_cancel = store.heartbeat, store.to_cancel

    def away(key: Any) -> bool:
        lost.append(key)
        raise StoreError("the queue database went away")

    def counted(*args: Any, **kwargs: Any) -> Any:
        found = to_cancel(*args, **kwargs)
        looked.append(found)
        return found

    async with pool_server(store, workdir) as (_, pool, queue):
        ask = asyncio.ensure_future(queue.run("sql", "late", {"key": "late", "seconds": 60.0}))
        await wait_until(lambda: len(_starts(workdir, "late")) == 1, within=30)
        (running,) = store.active(queue.prefix)
        monkeypatch.setattr(store, "heartbeat", away)
        monkeypatch.setattr(store, "to_cancel", counted)
        clock.advance(60_000)  # far past the stall timeout (4 heartbeat intervals: 1 s)
        assert [row.queue_id for row in store.stalled(1_000, queue.prefix)] == [running.queue_id]
        # The reaper looked, and found the item stalled, twice.
        await wait_until(lambda: sum(1 for found in looked if found) >= 2, within=30)
        assert lost, "heartbeats were tried, and lost"
        assert [row.queue_id for row in store.active(queue.prefix)] == [running.queue_id]
        monkeypatch.setattr(store, "heartbeat", heartbeat)
        assert (await queue.cancel_query(queue.hash_query_key("late"))) is True  # end it
        with pytest.raises(QueryCancelledError):
            await asyncio.wait_for(ask, 30)
        assert len(_starts(workdir, "late")) == 1
        assert pool.takeback.reclaimed == []


class _Process:
    pid, exitcode, sentinel = 999_999, -9, -1

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.reports: list[bytes] = []

    def send_bytes(self, blob: bytes) -> None:
        self.sent.append(blob)

    def recv_bytes(self) -> bytes:
        return self.reports.pop(0)

    def close(self) -> None:
        pass


def _active(store: MemoryQueueStore, keys: tuple[str, ...]) -> dict[str, int]:
    """Items `p:<key>`, added and retrieved (active), by key."""
    ids = {}
    for key in keys:
        ids[key] = store.add(f"p:{key}", "{}").id
        retrieved = store.retrieve(f"p:{key}", concurrency=len(keys))
        assert retrieved is not None and retrieved.id == ids[key]
    return ids


async def test_a_worker_on_to_its_next_query_before_its_ack_is_answered_loses_nothing(
    workdir: Path,
) -> None:
    """A worker whose ACK is in a committing batch is sent its next query (`acking`), and
    the query it ACKed ends only when that ACK is answered. Should the ACK never be stored
    (the worker says it is lost), or the worker die before that, its item is given back
    with no death counted against it; the query it died running is reclaimed as any."""
    from queryqueue.supervisor import worker as worker_module
    from queryqueue.supervisor.core import slots

    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=1)
    ids = _active(store, ("a", "b", "c", "d"))

    def job(key: str) -> Any:
        return slots.Job(ids[key], f"p:{key}", key.encode())

    def outcome(key: str) -> Any:
        return orjson.loads(getattr(store.result(ids[key]), "payload", None) or "null")

    def queued() -> set[str]:
        return {key for key, queue_id in ids.items() if store.get(queue_id) is not None}

    pipe = _Pipe()
    worker = slots.Worker(_Process(), pipe)

    def holds() -> tuple[str | None, ...]:
        """What the worker runs, whose ACK is committing, what it ended last."""
        return tuple(
            None if j is None else j.path[2:] for j in (worker.job, worker.acking, worker.finished)
        )

    pool.slots.workers.append(worker)
    for key in ("a", "b"):
        pool.send(pool.slots.submit(job(key)))
    assert holds() == ("a", None, None) and pipe.sent == [b"a"]

    pool.acking(ids["a"])  # its ACK's batch commits: the next goes now
    assert holds() == ("b", "a", None) and pipe.sent == [b"a", b"b"]
    assert store.ack(ids["a"], '"A"').success
    assert pool.acked(ids["a"])
    assert holds() == ("b", None, "a") and worker.executed == 1

    pool.acking(ids["b"])  # nothing waits: the worker is idle, b's ACK not answered yet
    assert holds() == (None, "b", "a")
    pipe.reports.append(worker_module.report(worker_module.LOST, ids["b"]))
    pool.heard(worker)  # b's ACK was not stored through every retry
    await wait_until(lambda: queued() == {"c", "d"})
    assert outcome("b")["retry"] is True and holds() == (None, None, "a")

    for key in ("c", "d"):
        pool.send(pool.slots.submit(job(key)))
    pool.acking(ids["c"])
    assert holds() == ("d", "c", "a")
    pool.size = 0  # no replacement spawned here
    pool.processes.exited(worker)  # died running d, c's ACK not stored
    await wait_until(lambda: not queued())
    assert outcome("c")["retry"] is True and outcome("d")["retry"] is True
    assert pool.takeback.reclaimed == [ids["d"]]
    assert dict(pool.takeback.deaths) == {"p:d": 1}
