"""SQLite FULL in a supervisor: the WAL is synced on a thread, once for many commits, and
every answer waits for the sync that covers its commit (driver_sqlite/syncer.py,
supervisor/synced.py). The sync is injected: it blocks until a test lets it go."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest

from queryqueue import SocketQueueDriver, SqliteQueueStore, StoreError, SupervisorUnavailableError
from queryqueue.engine.group_commit import GroupCommit
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.synced import SyncGate
from tests.pool_util import pool_server
from tests.trace import read_trace
from tests.waiting import wait_until, wait_until_sync


class HeldSync:
    """An fdatasync that, once armed, waits to be let go, on the syncer's thread only (the
    shutdown's own sync goes through); it records what it synced."""

    def __init__(self, armed: bool = True) -> None:
        self.armed = armed
        self.go = threading.Event()
        self.entered = 0
        self.synced: list[int] = []  # the inode of each fd synced
        self.failure: OSError | None = None

    def __call__(self, fd: int) -> None:
        if self.armed and threading.current_thread().name.startswith("queryqueue-wal-sync"):
            self.entered += 1
            self.go.wait(30)
        if self.failure is not None:
            raise self.failure
        os.fdatasync(fd)
        self.synced.append(os.fstat(fd).st_ino)


@pytest.fixture
def held() -> Iterator[HeldSync]:
    sync = HeldSync()
    yield sync
    sync.go.set()  # whatever a test left waiting ends


def _store(path: Path, sync: HeldSync, **options: Any) -> SqliteQueueStore:
    return SqliteQueueStore(
        path, synchronous="FULL", sync_in_background=True, wal_sync=sync, **options
    )


def _added(store: SqliteQueueStore, key: str) -> int:
    """ADD an item; the commit its answer waits for."""
    store.add(f"p:{key}", "{}", priority=0, orphaned=60)
    commit = store.unsynced_commit()
    assert commit is not None
    return commit


def test_a_commit_is_unsynced_until_the_syncer_has_synced_the_wal(
    tmp_path: Path, held: HeldSync
) -> None:
    store = _store(tmp_path / "q.db", held)
    try:
        told: list[BaseException | None] = []
        commit = _added(store, "a")
        store.when_synced(commit, told.append)
        wait_until_sync(lambda: held.entered == 1, what="the syncer syncs")
        assert told == [] and store.unsynced_commit() == commit
        held.go.set()
        wait_until_sync(lambda: told == [None], what="told once synced")
        assert store.unsynced_commit() is None
        store.pending("p")  # a read commits too, but has nothing to sync
        assert store.unsynced_commit() is None
        # What it synced is the database's WAL.
        assert held.synced == [os.stat(f"{tmp_path / 'q.db'}-wal").st_ino]
        done: list[BaseException | None] = []
        store.when_synced(commit, done.append)  # synced already: told at once
        assert done == [None]
    finally:
        store.close()


def test_one_sync_covers_every_commit_made_before_it_began(tmp_path: Path, held: HeldSync) -> None:
    store = _store(tmp_path / "q.db", held)
    try:
        told: list[tuple[int, BaseException | None]] = []

        def tell(commit: int) -> Callable[[BaseException | None], None]:
            return lambda error: told.append((commit, error))

        first = _added(store, "a")
        store.when_synced(first, tell(first))
        wait_until_sync(lambda: held.entered == 1, what="the first sync begins")
        for key in "bcd":  # committed while the first sync runs: it does not cover them
            commit = _added(store, key)
            store.when_synced(commit, tell(commit))
        held.go.set()
        wait_until_sync(lambda: len(told) == 4, what="every commit told")
        assert told == [(first + i, None) for i in range(4)]
        assert store.syncer is not None and store.syncer.syncs == 2
    finally:
        store.close()


def test_a_failed_sync_stops_the_store_committing(tmp_path: Path, held: HeldSync) -> None:
    """A failed fsync cannot be retried (the kernel may have dropped what it failed to
    write): who waits is told, and nothing more commits."""
    store = _store(tmp_path / "q.db", held)
    try:
        told: list[BaseException | None] = []
        commit = _added(store, "a")
        held.failure = OSError(errno.EIO, "Input/output error")
        store.when_synced(commit, told.append)
        held.go.set()
        wait_until_sync(lambda: len(told) == 1, what="told of the failure")
        assert told == [held.failure]
        with pytest.raises(StoreError, match="could not be synced"):
            store.add("p:b", "{}", priority=0, orphaned=60)
        with sqlite3.connect(tmp_path / "q.db") as reader:
            assert reader.execute("SELECT key FROM items").fetchall() == [("a",)]
        late: list[BaseException | None] = []
        store.when_synced(commit, late.append)
        assert late == [held.failure]
    finally:
        store.close()


@pytest.mark.parametrize("synchronous", ["NORMAL", "FULL"])
def test_a_store_that_syncs_in_its_commits_has_nothing_to_wait_for(
    tmp_path: Path, synchronous: Any
) -> None:
    """FULL in its COMMIT (the default), or NORMAL (which never syncs a commit, even when
    asked to sync in the background): answers need not wait."""
    store = SqliteQueueStore(
        tmp_path / "q.db", synchronous=synchronous, sync_in_background=synchronous == "NORMAL"
    )
    try:
        store.add("p:a", "{}", priority=0, orphaned=60)
        assert store.unsynced_commit() is None and store.syncer is None
        assert not store.background_sync
    finally:
        store.close()


async def _started(store: SqliteQueueStore, workdir: Path, **options: Any) -> QueueServer:
    server = QueueServer(store, workdir / "s.sock", **options)
    await server.start()
    return server


async def _armed(held: HeldSync, driver: SocketQueueDriver) -> None:
    """Once the server's own first commits are synced and the client has connected: the
    next sync is the test's."""
    held.armed = False
    await driver.add("warm:up", "{}", priority=0, orphaned=60)
    held.armed = True


@asynccontextmanager
async def _serving(
    workdir: Path, held: HeldSync, **driver_options: Any
) -> AsyncIterator[tuple[SqliteQueueStore, QueueServer, SocketQueueDriver]]:
    """A server on a FULL store syncing in the background, a client, the sync armed."""
    store = _store(workdir / "q.db", held)
    server = await _started(store, workdir)
    driver = SocketQueueDriver(server.socket_path, **driver_options)
    try:
        await _armed(held, driver)
        yield store, server, driver
    finally:
        held.go.set()
        await driver.close()
        await server.stop()
        store.close()


async def _add_awaiting_its_sync(driver: SocketQueueDriver, held: HeldSync) -> asyncio.Future[Any]:
    adding = asyncio.ensure_future(driver.add("p:a", '{"q": 1}', priority=0, orphaned=60))
    await wait_until(lambda: held.entered == 1, what="the sync of the ADD's commit begins")
    return adding


async def test_an_answer_leaves_only_once_its_commit_is_synced(
    workdir: Path, held: HeldSync
) -> None:
    async with _serving(workdir, held) as (_, server, driver):
        adding = await _add_awaiting_its_sync(driver, held)
        await wait_until(lambda: server.gate is not None and server.gate.held >= 1)
        assert not adding.done()
        (connection,) = [c for c in server.connections if c.unsynced]
        assert connection.buffered() >= sum(len(frame) for _, frame in connection.unsynced)
        with sqlite3.connect(workdir / "q.db") as reader:  # committed, not answered
            assert reader.execute("SELECT key FROM items WHERE prefix = 'p'").fetchall() == [("a",)]
        held.go.set()
        answer = await asyncio.wait_for(adding, 30)
        assert answer.added and answer.pending == 1
        # The held answer was counted out as it left.
        await wait_until(lambda: connection.buffered() == 0, what="nothing left unsent")
        wal = (await server.describe())["wal"]
        assert wal["answers_held_for_sync"] >= 1 and wal["wal_syncs"] >= 1


async def test_answers_held_at_shutdown_are_synced_and_sent_before_the_hang_up(
    workdir: Path, held: HeldSync
) -> None:
    async with _serving(workdir, held) as (_, server, driver):
        before = len(held.synced)
        adding = await _add_awaiting_its_sync(driver, held)
        await server.stop()  # the background sync never ends: the shutdown syncs itself
        answer = await asyncio.wait_for(adding, 30)
        assert answer.added
        assert held.entered == 1 and len(held.synced) == before + 1  # the shutdown's sync


async def test_a_failed_sync_hangs_up_on_everyone_and_stops_the_server(
    workdir: Path, held: HeldSync
) -> None:
    """Nothing the store holds unsynced can be promised any more, and it commits nothing
    more: the server hangs up on every client, accepts no more, and says it failed (its
    process exits with the error, to be restarted)."""
    async with _serving(workdir, held, reconnect_timeout=0.5) as (_, server, driver):
        bystander = SocketQueueDriver(server.socket_path, reconnect_timeout=0.5)
        try:
            await bystander.stats()
            adding = await _add_awaiting_its_sync(driver, held)
            held.failure = OSError(errno.EIO, "Input/output error")
            held.go.set()
            await asyncio.wait_for(server.failed.wait(), 30)
            assert server.failure is held.failure
            with pytest.raises(SupervisorUnavailableError):
                await asyncio.wait_for(adding, 30)
            with pytest.raises(SupervisorUnavailableError):
                await bystander.stats()
        finally:
            await bystander.close()


async def test_the_pools_worker_goes_on_to_its_next_query_while_answers_wait_for_a_sync(
    workdir: Path, held: HeldSync, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own ACK is answered at once (it dies with this host in the power loss
    a sync guards against); its callers' answers wait for the sync."""
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with pool_server(_store(workdir / "q.db", held), workdir) as (_, _, queue):
        try:
            await _armed(held, queue.driver)
            asks = [
                asyncio.ensure_future(queue.run("sql", key, {"key": key, "seconds": 0.0}))
                for key in ("one", "two", "three")
            ]

            def ended() -> set[str]:
                return {t[1] for t in read_trace(workdir) if t[0] == "end"}

            await wait_until(lambda: ended() == {"one", "two", "three"}, within=60)
            assert held.entered == 1 and not any(ask.done() for ask in asks)
            held.go.set()
            answers = await asyncio.wait_for(asyncio.gather(*asks), 30)
            assert [answer["key"] for answer in answers] == ["one", "two", "three"]
        finally:
            held.go.set()  # the sync the server's stop waits for


async def test_a_supervisor_whose_sync_failed_exits_with_the_error(
    workdir: Path, held: HeldSync, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve` (the supervisor's process) stops once its server failed, and says why."""
    from queryqueue.supervisor import process

    held.armed = False
    monkeypatch.setattr(process, "open_store", lambda db, **_: _store(Path(db), held))
    ready = asyncio.Event()
    serving = asyncio.ensure_future(
        process.serve(workdir / "q.db", workdir / "s.sock", synchronous="FULL", ready=ready)
    )
    driver = SocketQueueDriver(workdir / "s.sock", reconnect_timeout=0.5)
    try:
        await asyncio.wait_for(ready.wait(), 30)
        held.failure = OSError(errno.EIO, "Input/output error")
        with pytest.raises(SupervisorUnavailableError):
            await driver.add("p:a", "{}", priority=0, orphaned=60)
        with pytest.raises(StoreError, match="Input/output error"):
            await asyncio.wait_for(serving, 30)
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await driver.close()


# -- the gate's delay: a sync waits for a commit that is due (synced.py) ----------------------


class _Store:
    """The store's side of the gate: the asks for a sync, answered by the test."""

    def __init__(self) -> None:
        self.asks: list[tuple[int, Callable[[BaseException | None], object]]] = []

    def unsynced_commit(self) -> int | None:
        return None

    def when_synced(self, commit: int, callback: Callable[[BaseException | None], object]) -> None:
        self.asks.append((commit, callback))

    def sync_now(self) -> None:
        raise AssertionError("not in these tests")


class _Holder:
    def __init__(self) -> None:
        self.unsynced: deque[tuple[int, bytes]] = deque()
        self.released: list[bytes] = []

    def held(self, gate: SyncGate, commit: int) -> None:
        self.unsynced.append((commit, b"frame %d" % commit))
        gate.hold(self, commit)

    def release_synced(self, commit: int | None) -> None:
        while self.unsynced and (commit is None or self.unsynced[0][0] <= commit):
            self.released.append(self.unsynced.popleft()[1])


def _gate(store: _Store, due: list[bool], delay: float) -> SyncGate:
    return SyncGate(
        cast(GroupCommit, store),
        asyncio.get_running_loop(),
        lambda error: pytest.fail(f"no sync fails here: {error}"),
        expecting=lambda: due[0],
        delay=delay,
    )


async def _synced(store: _Store, ask: int) -> None:
    """The syncer's answer to ask number `ask`, as it comes: through the loop."""
    _, callback = store.asks[ask]
    callback(None)
    await asyncio.sleep(0)  # call_soon_threadsafe's callback runs


async def test_with_no_commit_due_a_held_frame_asks_for_its_sync_at_once() -> None:
    store, holder = _Store(), _Holder()
    gate = _gate(store, [False], delay=3600)
    holder.held(gate, 1)
    assert [commit for commit, _ in store.asks] == [1]
    await _synced(store, 0)
    assert holder.released == [b"frame 1"] and not gate.holding


async def test_while_a_commit_is_due_the_sync_waits_for_it_and_covers_both() -> None:
    """The pool runs a query: its ACK will commit soon. The first frame's sync waits; the
    ACK's frame, once nothing more is due, asks for one sync that covers both."""
    store, holder, due = _Store(), _Holder(), [True]
    gate = _gate(store, due, delay=3600)
    holder.held(gate, 1)
    await asyncio.sleep(0)
    assert store.asks == []  # waits (the delay is an hour here)
    due[0] = False
    holder.held(gate, 2)
    assert [commit for commit, _ in store.asks] == [2]
    await _synced(store, 0)
    assert holder.released == [b"frame 1", b"frame 2"] and not gate.holding


async def test_a_sync_waits_for_a_due_commit_no_longer_than_its_delay() -> None:
    store, holder = _Store(), _Holder()
    gate = _gate(store, [True], delay=0.01)
    holder.held(gate, 1)
    assert store.asks == []
    await wait_until(lambda: len(store.asks) == 1, what="the delayed ask")
    assert store.asks[0][0] == 1
    await _synced(store, 0)
    assert holder.released == [b"frame 1"]


async def test_frames_held_while_a_sync_runs_wait_for_the_next_one_as_the_first_did() -> None:
    """Under load (a commit always due) each sync covers what was held while the one
    before it ran: asked for `delay` after the first of those was held, not at once."""
    loop = asyncio.get_running_loop()
    store, holder, due = _Store(), _Holder(), [False]
    gate = _gate(store, due, delay=0.2)
    holder.held(gate, 1)  # asked at once: nothing due
    due[0] = True
    first_held = loop.time()
    holder.held(gate, 2)
    holder.held(gate, 3)
    await _synced(store, 0)  # covers 1 only
    assert holder.released == [b"frame 1"] and len(store.asks) == 1  # 2 and 3 wait
    await wait_until(lambda: len(store.asks) == 2, what="the next ask")
    assert loop.time() >= first_held + 0.2 - 0.001  # the timer's own slack
    assert store.asks[1][0] == 3
    await _synced(store, 1)
    assert holder.released == [b"frame %d" % n for n in (1, 2, 3)] and not gate.holding


async def test_in_a_supervisor_a_commit_is_due_while_its_pool_runs_a_query(
    workdir: Path, held: HeldSync, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    held.armed = False
    async with pool_server(_store(workdir / "q.db", held), workdir) as (server, _, queue):
        gate = server.gate
        assert gate is not None and not gate.expecting()
        asking = asyncio.ensure_future(queue.run("sql", "slow", {"key": "slow", "seconds": 0.3}))
        await wait_until(gate.expecting, what="the pool runs the query")
        assert (await asyncio.wait_for(asking, 30))["key"] == "slow"
        assert not gate.expecting()  # its ACK, answered before the result, freed the worker
