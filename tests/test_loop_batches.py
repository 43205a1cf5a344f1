"""A batch on the event loop (SQLite's) holds the loop while it runs, as does parsing what
a client sent: a burst of ADDs runs in batches of at most `Settings.loop_batch`, and a
client with that many waiting is read again as batches take them. A worker's ACK that
arrives meanwhile waits for one small batch, not for the whole burst."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from queryqueue import SqliteQueueStore
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.settings import Settings
from tests.hot_path_util import on_loop
from tests.waiting import wait_until

BATCH = 8


@pytest.fixture
async def held(
    workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[QueueServer, SqliteQueueStore, Callable[[], None]]]:
    """A server whose turns wait until `release` is called."""
    store = SqliteQueueStore(tmp_path / "q.db")
    server = QueueServer(store, workdir / "s.sock", settings=Settings(loop_batch=BATCH))
    await server.start()
    runner = on_loop(server)
    execute_turn, holding = runner.execute_turn, [True]

    def held_turn() -> None:
        if holding[0]:
            runner.turn = None
        else:
            execute_turn()

    def release() -> None:
        holding[0] = False
        runner.schedule()

    monkeypatch.setattr(runner, "execute_turn", held_turn)
    try:
        yield server, store, release
    finally:
        await server.stop()
        store.close()


async def test_a_burst_of_adds_runs_in_batches_of_the_loops_size(
    held: tuple[QueueServer, SqliteQueueStore, Callable[[], None]],
) -> None:
    server, store, release = held
    callers = [SocketQueueDriver(server.socket_path) for _ in range(5)]
    try:
        batches = server.stats.batches
        adding = asyncio.gather(
            *(
                caller.add(f"p:{c}-{i}", "{}")
                for c, caller in enumerate(callers)
                for i in range(BATCH)
            )
        )
        await wait_until(lambda: len(server.inbox.queued) == 40, what="the burst in the inbox")
        release()
        assert all(added.added for added in await adding)
        assert server.stats.batches - batches == 5  # 40 ADDs, 8 a batch
        assert len(store.pending("p")) == 40
    finally:
        for caller in callers:
            await caller.close()


async def test_a_client_with_a_batchs_worth_waiting_is_read_as_batches_take_it(
    held: tuple[QueueServer, SqliteQueueStore, Callable[[], None]],
) -> None:
    server, store, release = held
    caller = SocketQueueDriver(server.socket_path)
    try:
        adding = asyncio.gather(*(caller.add(f"p:{i}", "{}") for i in range(40)))
        await wait_until(lambda: server.stats.throttled >= 1, what="the flood held back")
        assert len(server.inbox.queued) == BATCH  # the rest is unread, in the socket
        release()
        assert all(added.added for added in await adding)
        assert [item.id for item in store.pending("p")] == [str(i) for i in range(40)]
    finally:
        await caller.close()


def test_a_batch_size_below_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="loop_batch must be 1 or more, not 0"):
        Settings(loop_batch=0)
