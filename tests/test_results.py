"""Results as data people use: the codec's types both ways, binary results (bytes, Arrow,
DataFrames, numpy arrays) through shared memory, views and their leases, and what a Cube client
reads of them."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa
import pytest

from queryqueue import Codecs, QueryError, SocketQueueDriver
from queryqueue.driver_socket.protocol import encode_frame, read_frame
from queryqueue.driver_socket.segments import SHM_DIR, SegmentMaps, name_prefix, view_value
from queryqueue.driver_socket.segments import parse_reference as ref_of
from queryqueue.engine.binary import binary_of, read_binary
from queryqueue.engine.outcome import parse_result
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.shm import SegmentPool
from tests.apps.results_app import Money, arrow_table, frame, many_rows, typed_rows
from tests.supervisor_util import REPO, SupervisorProcess, socket_dir, start_supervisor
from tests.waiting import wait_until

MiB = 1024 * 1024


def _round_trip(codecs: Codecs, value: Any) -> tuple[dict[str, Any], Any]:
    text = codecs.encode_result(value)
    return orjson.loads(text), parse_result(orjson.loads(text), codecs)


# -- the codec ------------------------------------------------------------------------------


def test_plain_json_is_written_as_it_is() -> None:
    assert Codecs().encode_result([1, "x", {"a": None, "b": 1.5}, (2, 3)]) == (
        '{"result":[1,"x",{"a":null,"b":1.5},[2,3]]}'
    )


def test_typed_values_come_back_and_a_cube_client_sees_plain_json() -> None:
    codecs = Codecs()
    codecs.register(Money)
    value = typed_rows()
    outcome, back = _round_trip(codecs, value)
    row = outcome["result"]["rows"][1]
    # What Cube reads: its drivers' JSON for these types, nothing wrapped.
    assert row["price"] == "12.50" and row["day"] == "2026-12-02"
    assert row["at"] == "2026-12-01T09:30:01.123456+05:30"
    assert row["uuid"] == str(uuid.UUID(int=2))
    assert outcome["result"]["matrix"] == [[float(4 * r + c) for c in range(4)] for r in range(3)]
    assert outcome["result"]["total"] == {"amount": "50.00", "currency": "EUR"}
    # What Python reads: its types.
    assert back["rows"] == value["rows"]
    assert back["rows"][1]["at"].utcoffset() == dt.timedelta(hours=5, minutes=30)
    assert back["matrix"].dtype == np.float32 and (back["matrix"] == value["matrix"]).all()
    assert back["total"] == Money(Decimal("50.00"), "EUR")


def test_rows_of_one_schema_share_one_tag_nulls_and_all() -> None:
    rows = [{"id": i, "price": Decimal(i) if i % 3 else None} for i in range(10_000)]
    outcome, back = _round_trip(Codecs(), rows)
    assert outcome["$types"] == {"*": {"k": {"price": "decimal"}}}
    assert back == rows
    # A list whose items differ in kind is tagged item by item.
    mixed = [Decimal(1), "1", 1, None, {dt.date(2026, 1, 1)}]
    outcome, back = _round_trip(Codecs(), mixed)
    assert back == mixed and set(outcome["$types"]["i"]) == {"0", "4"}


def test_the_rest_of_the_mapping_round_trips() -> None:
    value = {
        "big": 2**80,
        "neg": -(2**70),
        "raw": b"\x00\xff",
        "buf": bytearray(b"ab"),
        "set": {1, 2},
        "frozen": frozenset({"a"}),
        "time": dt.time(1, 2, 3),
        "scalar": np.int16(-7),
        "nat": dt.datetime(2026, 1, 1, 12),
    }
    outcome, back = _round_trip(Codecs(), value)
    assert back == value and type(back["scalar"]) is np.int16
    assert outcome["result"]["raw"] == "AP8=" and outcome["result"]["big"] == str(2**80)


def test_a_value_without_a_codec_fails_naming_its_type_and_place() -> None:
    class Opaque:
        pass

    with pytest.raises(QueryError, match=r"Opaque at result\['rows'\]\[1\]\['x'\]"):
        Codecs().encode_result({"rows": [{"x": 1}, {"x": Opaque()}]})
    with pytest.raises(QueryError, match="a dict key"):
        Codecs().encode_result({1: "a"})


def test_a_registered_codec_and_a_reader_without_it() -> None:
    class Point:
        def __init__(self, x: int, y: int) -> None:
            self.x, self.y = x, y

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    codecs = Codecs()
    codecs.register(Point, "point", encode=lambda p: [p.x, p.y], decode=lambda v: Point(*v))
    text = codecs.encode_result({"p": Point(1, 2)})
    assert orjson.loads(text)["result"] == {"p": [1, 2]}
    assert parse_result(orjson.loads(text), codecs) == {"p": Point(1, 2)}
    with pytest.raises(QueryError, match="tagged 'point'"):
        parse_result(orjson.loads(text), Codecs())
    with pytest.raises(ValueError, match="needs encode and decode"):
        codecs.register(Point)


# -- binary results -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"\x01\x02" * 1000,
        arrow_table(1000),
        frame(1000),
        np.arange(1000, dtype="int32").reshape(10, 100),
        np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4)),
        np.array(["2026-12-01", "2026-12-02"], dtype="datetime64[D]"),
        np.zeros((0, 3), dtype="int8"),
    ],
    ids=["bytes", "arrow", "pandas", "npy", "npy-fortran", "npy-datetime", "npy-empty"],
)
def test_a_binary_result_comes_back_equal_as_a_copy_a_view_and_inline(value: Any) -> None:
    result = binary_of(value)
    assert result is not None
    data = memoryview(result.to_bytes())
    assert data.nbytes == result.size
    inline = parse_result(orjson.loads(result.inline_text()), Codecs())
    for back in (read_binary(result.form, data), inline):
        _assert_same(back, value)
    view = read_binary(result.form, data, view=True)
    _assert_same(view, value)
    if isinstance(value, np.ndarray):
        assert back.flags.writeable and (value.size == 0 or not view.flags.writeable)
    elif isinstance(value, bytes):
        assert view.readonly and bytes(view) == value


def _assert_same(back: Any, value: Any) -> None:
    if isinstance(value, pa.Table):
        assert back.equals(value)
    elif isinstance(value, pd.DataFrame):
        pd.testing.assert_frame_equal(back, value)
    elif isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and back.shape == value.shape
        assert (back == value).all()
    else:
        assert back == value


def test_an_array_of_python_objects_is_refused_on_both_sides_by_name() -> None:
    assert binary_of(np.array([object()], dtype=object)) is None  # the JSON codec's, then
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    padded = header + b" " * (-(len(header) + 11) % 64) + b"\n"
    crafted = b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded + bytes(8)
    with pytest.raises(QueryError, match=r"dtype object is refused.*Python objects"):
        read_binary("npy", memoryview(crafted))


def test_a_lease_ends_with_the_result_ttl_and_its_segment_is_never_rewritten(
    workdir: Path,
) -> None:
    now = [1000.0]
    prefix = name_prefix(workdir / "s.sock")
    pool = SegmentPool(prefix, clock=lambda: now[0], result_ttl=60.0)
    maps = SegmentMaps()
    try:
        result = binary_of(b"kept" * MiB)
        assert result is not None
        ref = maps.write_binary(pool.alloc(result.size, "worker"), result)
        pool.acked(ref, success=True)
        assert pool.lease(ref, "reader")
        parsed = ref_of(ref)
        assert parsed is not None
        view, _ = view_value(parsed, maps.owner)
        now[0] += 61.0  # the reader never released it
        pool.sweep()
        assert pool.describe()["segments"] == 0 and not (SHM_DIR / parsed.name).exists()
        again = binary_of(b"next" * MiB)
        assert again is not None
        maps.write_binary(pool.alloc(again.size, "worker"), again)  # a fresh segment
        assert bytes(view[:8]) == b"keptkept"  # what the reader holds is still its result
    finally:
        maps.close()
        pool.close()
    assert list(SHM_DIR.glob(prefix + "*")) == []


# -- through a server: views, and Cube clients --------------------------------------------


async def _acked(server: QueueServer, value: Any, threshold: int | None = 1024) -> int:
    writer = SocketQueueDriver(server.socket_path, shm_threshold=threshold)
    try:
        added = await writer.add("p:big", "{}")
        assert (await writer.ack(added.id, Codecs().encode_outcome(value))).success
        return added.id
    finally:
        await writer.close()


async def _sql(server: QueueServer, text: str) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(server.socket_path))
    try:
        writer.write(encode_frame({"id": 1, "sql": text}))
        reply: dict[str, Any] = orjson.loads(await read_frame(reader, 1 << 30) or b"null")
        return reply
    finally:
        writer.close()


async def test_a_view_lease_outlives_a_copy_of_the_same_result(server: QueueServer) -> None:
    table = arrow_table(200_000)
    queue_id = await _acked(server, table)
    viewer, copier = SocketQueueDriver(server.socket_path), SocketQueueDriver(server.socket_path)
    try:
        seen = await viewer.result(queue_id)
        assert seen is not None and seen.shared is not None
        viewed = await seen.shared.read(view=True)
        copied = await copier.result(queue_id)
        assert copied is not None and copied.shared is not None
        copy = (await copied.shared.read(view=False))["result"]
        assert copy.equals(table) and viewed["result"].equals(table)
        name = seen.shared.ref.name
        server.segments.sweep()
        assert server.segments.describe()["leased"] == 1, "the view still holds it"
        assert viewed["result"].equals(table)
        await viewed["$lease"]()
        await wait_until(lambda: not (SHM_DIR / name).exists(), what="viewed segment unlinked")
        server.segments.sweep()
        assert viewed["result"].equals(table), "a view outlives its lease without changing"
    finally:
        await viewer.close()
        await copier.close()


async def test_a_view_nothing_refers_to_at_its_release_leaves_its_segment_for_reuse(
    server: QueueServer,
) -> None:
    queue_id = await _acked(server, b"v" * (2 * MiB))
    reader = SocketQueueDriver(server.socket_path)
    try:
        seen = await reader.result(queue_id)
        assert seen is not None and seen.shared is not None
        outcome = await seen.shared.read(view=True)
        release, name = outcome.pop("$lease"), seen.shared.ref.name
        assert outcome["result"].readonly and bytes(outcome["result"][:2]) == b"vv"
        del outcome
        await release()

        def reusable() -> bool:
            server.segments.sweep()
            return bool(server.segments.describe()["free"] == 1)

        await wait_until(reusable, what="the segment back in the pool")
        assert (SHM_DIR / name).exists()
    finally:
        await reader.close()


async def test_a_store_other_hosts_read_keeps_a_binary_result_itself(
    server: QueueServer,
) -> None:
    server.store.shared = True  # as PostgreSQL is: no host may be left holding a reference
    table = arrow_table(100_000)
    queue_id = await _acked(server, table)
    stored = server.store.result(queue_id)
    assert stored is not None and stored.payload is not None
    assert ref_of(stored.payload) is None, "the result itself, not a reference"
    assert parse_result(orjson.loads(stored.payload), Codecs()).equals(table)
    assert server.segments.describe()["stored"] == 0


async def test_a_cube_client_reads_an_arrow_result_as_json_rows(server: QueueServer) -> None:
    table = arrow_table(100_000)
    for threshold in (1024, None):  # in shared memory, and stored inline
        queue_id = await _acked(server, table, threshold)
        reply = await _sql(server, f"QUEUE RESULT {queue_id}")
        payload = reply["rows"][0]["payload"]
        assert not payload.startswith('{"$')
        assert orjson.loads(payload)["result"] == table.to_pylist()


async def test_a_cube_client_is_refused_a_result_over_the_limit_by_name(
    server: QueueServer,
) -> None:
    server.limits = dataclasses.replace(server.limits, max_sql_result=2 * MiB)
    for value in ("x" * (3 * MiB), arrow_table(200_000), np.zeros(300_000)):
        queue_id = await _acked(server, value)
        reply = await _sql(server, f"QUEUE RESULT {queue_id}")
        message = reply["error"]["message"]
        assert f"limit of {2 * MiB} bytes" in message and "--sql-result-limit" in message


# -- through a worker pool ------------------------------------------------------------------

APP = "tests.apps.results_app:app"


@pytest.fixture(scope="module")
def pool() -> Iterator[SupervisorProcess]:
    directory = socket_dir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POOL_TRACE", str(directory / "trace"))
        process = start_supervisor(
            directory / "queue.db", directory / "s.sock", "--app", APP, "--workers", "2"
        )
        prefix = name_prefix(process.socket_path)
        try:
            yield process
        finally:
            code = process.stop()
            shutil.rmtree(directory, ignore_errors=True)
            assert code == 0
    assert list(SHM_DIR.glob(prefix + "*")) == [], "a stopped supervisor leaves no segment"


@pytest.fixture
async def app(pool: SupervisorProcess) -> AsyncIterator[Any]:
    from tests.apps.results_app import app

    app.socket_path = pool.socket_path
    yield app
    await app.aclose()


async def test_typed_values_and_binary_results_round_trip_through_the_pool(app: Any) -> None:
    value = await app.run("typed", {}, key="typed")
    expected = typed_rows()
    assert value["rows"] == expected["rows"] and value["total"] == expected["total"]
    assert value["matrix"].dtype == np.float32 and (value["matrix"] == expected["matrix"]).all()
    with pytest.raises(QueryError, match=r"results_app\.Opaque at result\['rows'\]\[0\]"):
        await app.run("opaque", {}, key="opaque")
    for rows in (10, 100_000):  # inline, and through shared memory
        table = await app.run("arrow", {"key": rows, "rows": rows}, key=f"arrow{rows}")
        assert table.equals(arrow_table(rows))
    rows = await app.run("many", {"n": 20_000}, key="many")  # JSON parsed out of its segment
    assert rows == many_rows(20_000) and isinstance(rows[5]["price"], Decimal)
    raw = await app.run("bytes", {"size": 4 * MiB}, key="bytes")
    assert raw == bytes(range(256)) * (4 * MiB // 256)
    array = await app.run("array", {"n": 1_000_000}, key="array")
    assert (array == np.arange(1_000_000).reshape(-1, 4)).all() and array.flags.writeable
    table = await app.run("frame", {"rows": 50_000}, key="frame")
    pd.testing.assert_frame_equal(table, frame(50_000))
    with pytest.raises(QueryError, match=r"results_app\.Opaque at result\['cells'\]\[0\]"):
        await app.run("object_array", {}, key="object_array")


async def _stats(pool: SupervisorProcess) -> dict[str, Any]:
    driver = SocketQueueDriver(pool.socket_path)
    try:
        return dict(await driver.stats())
    finally:
        await driver.close()


async def test_three_deduplicated_waiters_read_one_arrow_result(
    app: Any, pool: SupervisorProcess, workdir: Path
) -> None:
    gate = workdir / "gate"
    before = (await _stats(pool))["shared_memory"]
    drivers = [SocketQueueDriver(pool.socket_path) for _ in range(3)]
    queues = [app.pool_queue(driver) for driver in drivers]
    query = {"key": "dedup", "rows": 100_000, "gate": str(gate)}
    try:
        asks = [asyncio.ensure_future(q.run("arrow", "dedup", query)) for q in queues]

        async def all_waiting() -> bool:
            return bool((await _stats(pool))["long_polls"] >= 3)

        await wait_until(all_waiting, within=20, what="three waiters parked")
        gate.touch()
        tables = await asyncio.gather(*asks)
        assert all(t.equals(arrow_table(100_000)) for t in tables)
        trace = (await asyncio.to_thread(Path(os.environ["POOL_TRACE"]).read_text)).split("\n")
        assert sum(1 for line in trace if line.startswith("start arrow-dedup ")) == 1
        after = (await _stats(pool))["shared_memory"]
        written = after["created"] + after["reused"] - before["created"] - before["reused"]
        assert written == 1, "one segment, read by all three"
    finally:
        for queue, driver in zip(queues, drivers, strict=True):
            await queue.shutdown(grace=0)
            await driver.close()


VIEWER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from tests.apps.results_app import app, arrow_table

    query, go = {"key": "viewed", "rows": 100_000, "gate": sys.argv[1]}, Path(sys.argv[2])

    async def main():
        async with app.view("arrow", query, key="viewed") as table:
            print("viewing", flush=True)
            while not go.exists():
                await asyncio.sleep(0.01)
            print("still", table.equals(arrow_table(100_000)), flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_view_is_released_when_its_reader_is_killed(
    app: Any, pool: SupervisorProcess, workdir: Path
) -> None:
    gate, go = workdir / "gate", workdir / "go"
    viewer = subprocess.Popen(  # noqa: ASYNC220 - read through threads below
        [sys.executable, "-c", VIEWER, str(gate), str(go)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "QUERYQUEUE_SOCKET": str(pool.socket_path)},
        cwd=REPO,
    )
    driver = SocketQueueDriver(pool.socket_path)
    try:

        async def running() -> list[Any]:
            return await driver.active("results")

        await wait_until(running, within=30, what="the viewed query running")
        queue_id = (await running())[0].queue_id
        gate.touch()
        assert viewer.stdout is not None
        assert await asyncio.to_thread(viewer.stdout.readline) == "viewing\n"
        # Another reader copies the same result (by id: it reads many times) and is done.
        copied = await driver.result(queue_id)
        assert copied is not None and copied.shared is not None
        copy = await copied.shared.read(view=False)
        assert copy["result"].equals(arrow_table(100_000))
        name = copied.shared.ref.name
        go.touch()
        assert await asyncio.to_thread(viewer.stdout.readline) == "still True\n"
        assert (SHM_DIR / name).exists() and (await _stats(pool))["shared_memory"]["leased"] == 1
        viewer.send_signal(signal.SIGKILL)
        viewer.wait(timeout=20)
        await wait_until(
            lambda: not (SHM_DIR / name).exists(), within=20, what="the segment unlinked"
        )
    finally:
        if viewer.poll() is None:
            viewer.kill()
            viewer.wait(timeout=20)
        if viewer.stdout is not None:
            viewer.stdout.close()
        await driver.close()


def test_the_core_imports_neither_arrow_nor_numpy() -> None:
    check = (
        "import sys, queryqueue; from queryqueue import Codecs; "
        "Codecs().encode_outcome({'a': 1}); Codecs().encode_outcome(b'x'); "
        "print(sorted(m for m in ('pyarrow', 'numpy', 'pandas') if m in sys.modules))"
    )
    ran = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"
