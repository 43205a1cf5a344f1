"""Large results through shared memory: segment lifecycle, leases, crashes of either side."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from queryqueue import (
    InvalidCommandError,
    MemoryQueueStore,
    QueryError,
    QueryQueue,
    SocketQueueDriver,
    StoreError,
)
from queryqueue.driver_socket.protocol import encode_frame, read_frame
from queryqueue.driver_socket.segments import (
    HEADER,
    SHM_DIR,
    SegmentMaps,
    SharedMemoryFullError,
    SharedResultError,
    name_prefix,
    parse_reference,
)
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.shm import SegmentPool
from tests.waiting import wait_until

MiB = 1024 * 1024


def _segments(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def prefix(workdir: Path) -> Iterator[str]:
    value = name_prefix(workdir / "s.sock")
    yield value
    for name in _segments(value):  # a failed test must not leave segments on the machine
        (SHM_DIR / name).unlink()


def _write(pool: SegmentPool, maps: SegmentMaps, data: bytes, writer: object) -> str:
    return maps.write(pool.alloc(len(data), writer), data)


def test_a_result_is_freed_after_its_last_reader_releases_it(prefix: str) -> None:
    clock = Clock()
    pool = SegmentPool(
        prefix, clock=clock, reread_grace=2.0
    )  # longer than the default, to step through it
    maps = SegmentMaps()
    data = orjson.dumps({"result": "x" * (3 * MiB)})
    ref = _write(pool, maps, data, "worker")
    pool.acked(ref, success=True)
    assert pool.describe()["stored"] == 1
    # Two deduplicated waiters get the same reference.
    assert pool.lease(ref, "reader-1") and pool.lease(ref, "reader-2")
    parsed = parse_reference(ref)
    assert parsed is not None
    assert maps.read(parsed) == data.decode()
    pool.release(parsed[0], parsed[1], "reader-1")
    clock.now += 10
    pool.sweep()
    assert pool.describe()["stored"] == 1, "reader-2 still holds a lease"
    pool.drop_owner("reader-2")  # its connection closed without a release
    pool.sweep()
    assert pool.describe()["stored"] == 1, "within the re-read grace"
    clock.now += 2
    pool.sweep()
    assert pool.describe() | {"free": 1, "stored": 0} == pool.describe()
    # The old reference is now stale: refused on delivery and on read.
    assert not pool.lease(ref, "late")
    with pytest.raises(SharedResultError, match="reused"):
        maps.read(parsed)
    # The free segment is reused (pre-touched, same name), with a new generation.
    again = _write(pool, maps, b'"small"', "worker")
    again_parsed = parse_reference(again)
    assert again_parsed is not None
    assert again_parsed[0] == parsed[0] and again_parsed[1] > parsed[1]
    assert pool.describe()["reused"] == 1
    maps.close()
    pool.close()
    assert _segments(prefix) == []


def test_a_writer_that_hangs_up_before_its_ack_leaks_nothing(prefix: str) -> None:
    pool = SegmentPool(prefix, clock=Clock())
    maps = SegmentMaps()
    ref = _write(pool, maps, b"[1,2,3]", "worker")
    pool.drop_owner("worker")
    assert pool.describe()["writing"] == 0 and pool.describe()["free"] == 1
    with pytest.raises(StoreError, match="gone"):
        pool.check_ack(ref)
    pool.acked(ref, success=True)  # an ACK for a freed segment changes nothing
    assert pool.describe()["stored"] == 0
    # An ACK that found no item frees its segment at once.
    other = _write(pool, maps, b"[4]", "worker")
    pool.acked(other, success=False)
    assert pool.describe()["free"] == 1
    maps.close()
    pool.close()
    assert _segments(prefix) == []


def test_an_unread_result_lives_as_long_as_the_stores_results(prefix: str) -> None:
    clock = Clock()
    pool = SegmentPool(prefix, clock=clock, result_ttl=300.0)
    maps = SegmentMaps()
    pool.acked(_write(pool, maps, b'"unread"', "worker"), success=True)
    clock.now += 299
    pool.sweep()
    assert pool.describe()["stored"] == 1
    clock.now += 1
    pool.sweep()
    assert pool.describe()["stored"] == 0
    maps.close()
    pool.close()


def test_the_free_pool_is_trimmed_and_bad_sizes_are_refused(prefix: str) -> None:
    pool = SegmentPool(prefix, clock=Clock(), max_free_bytes=2 * MiB, max_segment=64 * MiB)
    for size in (0, -1, "big", True):
        with pytest.raises(InvalidCommandError, match="size"):
            pool.alloc(size, "w")
    with pytest.raises(InvalidCommandError, match="over the limit"):
        pool.alloc(64 * MiB, "w")
    for size in (MiB // 2, 3 * MiB, 5 * MiB):
        pool.alloc(size, "w")
    assert len(_segments(prefix)) == 3
    pool.drop_owner("w")
    pool.sweep()
    # 1 + 4 + 8 MiB free, 2 MiB allowed: the big ones go.
    assert pool.describe()["segments"] == 1 and len(_segments(prefix)) == 1
    pool.close()
    assert _segments(prefix) == []


def test_a_restarted_supervisor_adopts_only_unread_acknowledged_results(prefix: str) -> None:
    maps = SegmentMaps()
    first = SegmentPool(prefix, clock=Clock())
    ref = _write(first, maps, b'{"result":"survives"}', "worker")
    first.acked(ref, success=True)
    read = _write(first, maps, b'{"result":"was read"}', "worker")
    first.acked(read, success=True)
    assert first.lease(read, "a reader")  # delivered: its reader has it
    first.alloc(10, "someone")
    first.drop_owner("someone")  # a free segment: not worth keeping
    first.close(keep_stored=True)  # what a crash leaves behind, minus the free ones
    maps.close()
    assert len(_segments(prefix)) == 2
    second = SegmentPool(prefix, clock=Clock())
    assert second.adopt() == 1
    assert len(_segments(prefix)) == 1  # the read one is gone
    assert second.lease(ref, "reader")
    parsed = parse_reference(ref)
    assert parsed is not None
    assert SegmentMaps().read(parsed) == '{"result":"survives"}'
    second.close(keep_stored=False)
    assert _segments(prefix) == []


# -- through a real server -----------------------------------------------------------------


def _swept_free(server: QueueServer) -> int:
    server.segments.sweep()
    return int(server.segments.describe()["free"])


async def test_deduplicated_waiters_all_read_one_large_result(server: QueueServer) -> None:
    writer = SocketQueueDriver(server.socket_path, shm_threshold=MiB)
    readers = [SocketQueueDriver(server.socket_path) for _ in range(3)]
    value = orjson.dumps({"result": [str(i) * 40 for i in range(40_000)]}).decode()
    assert len(value) > MiB
    added = await writer.add("p:big", "{}")
    polls = [
        asyncio.ensure_future(r.result_blocking(added.id, 10_000) if i else r.result("p:big"))
        for i, r in enumerate(readers)
    ]
    await asyncio.sleep(0)
    assert (await writer.ack(added.id, value)).success
    # The store holds only a reference.
    stored = server.store.result(added.id)
    assert stored is not None and parse_reference(stored.payload) is not None
    answers = await asyncio.gather(*polls)
    assert all(a is not None and a.payload == value for a in answers[1:])
    assert server.segments.describe()["stored"] == 1
    await wait_until(lambda: _swept_free(server) == 1)
    for driver in [writer, *readers]:
        await driver.close()


async def test_a_reader_that_hangs_up_holding_a_lease_releases_it(server: QueueServer) -> None:
    writer = SocketQueueDriver(server.socket_path, shm_threshold=1024)
    added = await writer.add("p:big", "{}")
    value = orjson.dumps({"result": "y" * 5000}).decode()
    assert (await writer.ack(added.id, value)).success
    reader, stream = await asyncio.open_unix_connection(str(server.socket_path))
    stream.write(encode_frame({"id": 1, "cmd": "result", "args": ["p:big"], "kwargs": {}}))
    reply = orjson.loads(await read_frame(reader, 1 << 20) or b"null")
    assert parse_reference(reply["ok"]["payload"]) is not None
    server.segments.sweep()
    assert server.segments.describe()["stored"] == 1, "leased to the raw reader"
    stream.close()  # dies without a release
    await wait_until(lambda: _swept_free(server) == 1)
    await writer.close()


async def test_a_graceful_stop_releases_every_segment_even_unread_ones(workdir: Path) -> None:
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock")
    await server.start()
    writer = SocketQueueDriver(server.socket_path, shm_threshold=MiB)
    added = await writer.add("p:unread", "{}")
    assert (await writer.ack(added.id, orjson.dumps({"result": "u" * (2 * MiB)}).decode())).success
    await writer.close()
    assert server.segments.describe()["stored"] == 1
    await server.stop()
    assert _segments(server.segments.prefix) == []


async def test_small_results_and_a_disabled_threshold_stay_inline(server: QueueServer) -> None:
    driver = SocketQueueDriver(server.socket_path, shm_threshold=None)
    added = await driver.add("p:k", "{}")
    big = orjson.dumps({"result": "z" * (2 * MiB)}).decode()
    assert (await driver.ack(added.id, big)).success
    found = await driver.result(added.id)
    assert found is not None and found.payload == big
    assert server.segments.describe()["segments"] == 0
    await driver.close()


def test_segment_header_is_the_documented_size() -> None:
    # Readers and writers in other processes rely on the layout.
    assert HEADER.size == 16
    assert os.sep == "/"


async def test_an_acknowledged_large_result_survives_a_supervisor_kill_9(
    workdir: Path, prefix: str
) -> None:
    from tests.supervisor_util import start_supervisor

    supervisor = start_supervisor(workdir / "queue.db", workdir / "s.sock")
    driver = SocketQueueDriver(supervisor.socket_path, shm_threshold=1024)
    value = orjson.dumps({"result": "w" * (2 * MiB)}).decode()
    try:
        added = await driver.add("p:kept", "{}")
        assert (await driver.ack(added.id, value)).success
        supervisor.kill9()
        assert len(_segments(prefix)) == 1  # the segment outlived its owner
        supervisor = start_supervisor(workdir / "queue.db", workdir / "s.sock")
        found = await driver.result("p:kept")  # reconnects to the new supervisor
        assert found is not None and found.payload == value
        await wait_until(lambda: _stored_segments(driver, 0), within=15)
    finally:
        await driver.close()
        assert supervisor.stop() == 0
    assert _segments(prefix) == []


async def _stored_segments(driver: SocketQueueDriver, count: int) -> bool:
    return bool((await driver.stats())["shared_memory"]["stored"] == count)


# -- no room: an error naming it, the socket way, never a SIGBUS ------------------------------


def test_no_room_in_dev_shm_is_an_error_naming_it_and_leaves_no_segment(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = SegmentPool(prefix)
    with pytest.raises(SharedMemoryFullError, match="no room in /dev/shm for a 4194304-byte"):
        pool.alloc(3 * MiB, object())
    assert _segments(prefix) == []
    assert pool.describe()["segments"] == 0


def test_shared_memory_is_capped_per_connection_and_in_all(prefix: str) -> None:
    pool = SegmentPool(prefix, max_total_bytes=4 * MiB, max_connection_bytes=2 * MiB)
    maps = SegmentMaps()
    one, two = object(), object()
    try:
        _write(pool, maps, b"x" * (MiB + 1), one)  # a 2 MiB segment, writing
        with pytest.raises(SharedMemoryFullError, match="this connection holds"):
            pool.alloc(10, one)
        _write(pool, maps, b"y" * (MiB + 1), two)
        with pytest.raises(SharedMemoryFullError, match="would pass the cap of 4194304"):
            pool.alloc(10, object())
    finally:
        maps.close()
        pool.close(keep_stored=False)
    assert _segments(prefix) == []


async def test_a_result_with_no_room_in_shared_memory_goes_through_the_socket(
    server: QueueServer,
) -> None:
    server.segments.max_total_bytes = MiB  # room for nothing of 3 MiB
    driver = SocketQueueDriver(server.socket_path, shm_threshold=MiB)
    value = orjson.dumps({"result": "w" * (3 * MiB)}).decode()
    added = await driver.add("p:k", "{}")
    assert (await driver.ack(added.id, value)).success
    stored = server.store.result(added.id)
    assert stored is not None and stored.payload == value  # inline, not a reference
    found = await driver.result(added.id)
    assert found is not None and found.payload == value
    assert server.segments.describe()["segments"] == 0
    await driver.close()


async def test_a_result_no_transport_can_carry_fails_the_query_for_its_waiters(
    server: QueueServer,
) -> None:
    def huge(query: object, set_cancel_handler: object) -> str:
        return "v" * (2 * MiB)

    driver = SocketQueueDriver(server.socket_path, shm_threshold=None, max_frame=MiB)
    queue = QueryQueue("p", query_handlers={"big": huge}, driver=driver)
    with pytest.raises(QueryError, match="frame limit") as raised:
        await queue.run("big", "k", {})
    assert raised.value.error_type == "ResultTooLargeError"
    await queue.close()
    await driver.close()


async def test_a_server_error_the_client_has_no_class_for_keeps_its_family(
    server: QueueServer,
) -> None:
    server.segments.max_total_bytes = MiB
    driver = SocketQueueDriver(server.socket_path)
    try:
        # SharedMemoryFullError lives in the supervisor: the client raises its public
        # family (a StoreError), never a CommandRejectedError.
        with pytest.raises(StoreError, match="SharedMemoryFullError: shm_alloc") as raised:
            await driver.call("shm_alloc", 10 * MiB)
        assert type(raised.value) is StoreError
    finally:
        await driver.close()
