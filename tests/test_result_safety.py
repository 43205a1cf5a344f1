"""Reading a result never runs code and never reads a file, whoever wrote the result.

A corpus of crafted results (pickle gadgets that run a program, exec source, load a
pickle file or read a file; the same bytes framed as every binary form; Arrow with a
pickled extension type; `$types` trees that build other types or allocate without bound)
goes through every read path: a copy out of shared memory, a view in place, an inline
base64 outcome, the socket's RESULT as a caller's `run` reads it, and a Cube client's
SQL-text RESULT. Each is refused with an error naming what was refused, and the marker
file every payload would create never exists.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import operator
import os
import pickle
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.testing._private.utils as numpy_utils
import orjson
import pandas as pd
import pyarrow as pa
import pyarrow.csv
import pytest

from queryqueue import Codecs, MemoryQueueStore, QueryError, QueueApp, SocketQueueDriver
from queryqueue.driver_socket.segments import SegmentMaps, parse_reference, view_value
from queryqueue.engine.binary import from_bytes, read_binary
from queryqueue.engine.hashing import hash_query_key
from queryqueue.engine.outcome import parse_result
from queryqueue.supervisor.cube_results import as_json, inline_as_json
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.shm import SegmentPool
from tests.waiting import wait_until

MiB = 1024 * 1024


class _Reduce:
    """Pickles as a call of `function` with `args`: what every pickle gadget is."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.function, self.args


def _touch(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


def _gadgets(marker: Path, secret: Path) -> dict[str, bytes]:
    """Pickles that would run a program, exec code, unpickle a file or read one."""
    evil_file = secret.with_name("evil.pickle")
    evil_file.write_bytes(pickle.dumps(_Reduce(exec, _touch(marker))))
    evil_npy = secret.with_name("evil.npy")
    np.save(evil_npy, np.array([_Reduce(exec, _touch(marker))], dtype=object), allow_pickle=True)
    calls: dict[str, _Reduce] = {
        "uuid._get_command_stdout": _Reduce(uuid._get_command_stdout, "touch", str(marker)),  # type: ignore[attr-defined]
        "numpy runstring": _Reduce(numpy_utils.runstring, _touch(marker), {}),
        "pandas.read_pickle": _Reduce(pd.read_pickle, str(evil_file)),
        "pyarrow.csv.read_csv": _Reduce(pyarrow.csv.read_csv, str(secret)),
        "builtins.eval": _Reduce(eval, _touch(marker)),
        "builtins.exec": _Reduce(exec, _touch(marker)),
        "os.system": _Reduce(os.system, f"touch {marker}"),
        "subprocess.check_output": _Reduce(subprocess.check_output, ["touch", str(marker)]),
        "operator.methodcaller": _Reduce(
            operator.methodcaller("system", f"touch {marker}"), _Reduce(__import__, "os")
        ),
        "functools.partial": _Reduce(functools.partial(os.system, f"touch {marker}")),
        "numpy.load": _Reduce(np.load, str(evil_npy), None, True),
        "pandas.eval": _Reduce(pd.eval, f"__import__('os').system('touch {marker}')"),
        "DataFrame.query": _Reduce(
            operator.methodcaller("query", f"@__import__('os').system('touch {marker}')"),
            _Reduce(pd.DataFrame, {"a": [1]}),
        ),
    }
    return {name: pickle.dumps(call, protocol=5) for name, call in calls.items()}


def _framings(pickled: bytes) -> dict[str, tuple[str, bytes]]:
    """One gadget as each binary form's bytes: the pickle form results once had (its
    length framing), an .npy of objects (which numpy stores as a pickle), and as the
    stream of the Arrow forms."""
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    padded = header + b" " * (-(len(header) + 11) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded + pickled
    framed = (0).to_bytes(4, "little") + len(pickled).to_bytes(8, "little") + pickled
    return {
        "pickle": ("pickle", framed),
        "npy": ("npy", npy),
        "arrow": ("arrow", pickled),
        "pandas": ("pandas", pickled),
    }


@pytest.fixture
def marker(workdir: Path) -> Iterator[Path]:
    path = workdir / "ran"
    yield path
    assert not path.exists(), "a crafted result ran code in its reader"


@pytest.fixture
def corpus(workdir: Path, marker: Path) -> list[tuple[str, str, bytes]]:
    """(name, form, bytes) of every crafted binary result."""
    secret = workdir / "secret.csv"
    secret.write_text("password\nhunter2\n")
    return [
        (f"{gadget} as {framing}", form, data)
        for gadget, pickled in _gadgets(marker, secret).items()
        for framing, (form, data) in _framings(pickled).items()
    ]


_REFUSED = r"form 'pickle' is refused|dtype object is refused|Arrow result is malformed"


def test_the_corpus_pickles_would_run_code_were_they_unpickled(workdir: Path) -> None:
    """The corpus is live: unpickled as pickle would, its gadgets do what they say."""
    marker, secret = workdir / "live", workdir / "secret.csv"
    secret.write_text("password\nhunter2\n")
    gadgets = _gadgets(marker, secret)
    pickle.loads(gadgets["builtins.exec"])
    assert marker.exists()
    assert "hunter2" in str(pickle.loads(gadgets["pyarrow.csv.read_csv"]))


def test_no_binary_read_path_runs_a_crafted_result(
    corpus: list[tuple[str, str, bytes]], workdir: Path
) -> None:
    pool = SegmentPool(f"qqsafety{os.getpid()}_")
    maps = SegmentMaps()
    try:
        for name, form, data in corpus:
            inline = orjson.dumps({"$binary": form, "data": base64.b64encode(data).decode()})
            ref = maps.write_binary(pool.alloc(len(data), "attacker"), from_bytes(form, data))
            pool.acked(ref, success=True)
            parsed = parse_reference(ref)
            assert parsed is not None and parsed.form == form
            reads: dict[str, Callable[[], Any]] = {
                "copy": functools.partial(read_binary, form, memoryview(data)),
                "inline": functools.partial(parse_result, orjson.loads(inline), Codecs()),
                "sql-text": functools.partial(inline_as_json, inline.decode(), 64 * MiB),
                "sql-text shared": functools.partial(as_json, form, data, 64 * MiB),
                "shared memory": functools.partial(maps.read_value, parsed),
                "view": functools.partial(view_value, parsed, maps.owner),
            }
            for path, read in reads.items():
                with pytest.raises(QueryError, match=_REFUSED):
                    read()
                    pytest.fail(f"{name} through {path} was read")
    finally:
        maps.close()
        pool.close()


def test_an_arrow_extension_type_of_a_pickle_stays_plain_data(marker: Path) -> None:
    field = pa.field(
        "a",
        pa.int64(),
        metadata={
            b"ARROW:extension:name": b"arrow.py_extension_type",
            b"ARROW:extension:metadata": pickle.dumps(_Reduce(exec, _touch(marker))),
        },
    )
    table = pa.Table.from_arrays([pa.array([1, 2])], schema=pa.schema([field]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    back = read_binary("arrow", memoryview(sink.getvalue().to_pybytes()))
    assert back.column("a").type == pa.int64() and back.column("a").to_pylist() == [1, 2]


@pytest.mark.parametrize("offsets", [[0, 7, 5], [0, 5, 1 << 30]], ids=["backwards", "past"])
def test_arrow_whose_offsets_leave_its_buffers_is_refused(offsets: list[int]) -> None:
    table = pa.table({"s": ["hello", "world"]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    valid = np.array([0, 5, 10], dtype=np.int32).tobytes()
    stream = sink.getvalue().to_pybytes()
    assert stream.count(valid) == 1
    crafted = stream.replace(valid, np.array(offsets, dtype=np.int32).tobytes())
    for form in ("arrow", "pandas"):
        with pytest.raises(QueryError, match="Arrow result is malformed"):
            read_binary(form, memoryview(crafted))


@pytest.mark.parametrize(
    ("node", "value", "refused"),
    [
        ("posix.system", "touch x", r"tagged 'posix\.system'.*no codec"),
        ("np:(1000000000000,)f8", 1.0, r"dtype '\(1000000000000,\)f8', which no tag may"),
        ("ndarray:<f8:1000000000000", [1.0], r"do not fit its values"),
        ("ndarray:<U100000:2", ["a", "b"], r"100000-character text of values of at most 1"),
        ("ndarray:[('a','O')]:1", [[1]], r"which no tag may"),
        ("ndarray:|V1000000000:1", ["x"], r"which no tag may"),
        ("int", "9" * 10_000, r"tagged 'int' did not decode"),
        ("tests.test_result_safety.Point", {"x": 1, "__init__": 2}, "did not decode"),
        ({"k": {"a": "decimal"}, "i": {"7": "date"}}, [1], r"do not fit its values"),
        ({"*": 5}, [1, 2], r"hold 5 where a tag belongs"),
    ],
)
def test_a_types_tree_builds_only_registered_types_within_bounds(
    node: Any, value: Any, refused: str
) -> None:
    codecs = Codecs()
    codecs.register(
        Point,
        "tests.test_result_safety.Point",
        encode=lambda point: {"x": point.x},
        decode=lambda fields: Point(**fields),
    )
    outcome = orjson.dumps({"result": value, "$types": node})
    with pytest.raises(QueryError, match=refused):
        parse_result(orjson.loads(outcome), codecs)


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


# -- through a supervisor: what a victim's `run` gets -------------------------------------


@pytest.fixture
async def tcp_server(workdir: Path) -> AsyncIterator[QueueServer]:
    server = QueueServer(
        MemoryQueueStore(),
        workdir / "s.sock",
        tcp_host="127.0.0.1",
        tcp_port=0,
        tcp_token="secret-token",
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _driver(server: QueueServer, over: str) -> SocketQueueDriver:
    if over == "tcp":
        assert server.tcp_address is not None
        return SocketQueueDriver(
            f"tcp://127.0.0.1:{server.tcp_address[1]}",
            auth_token="secret-token",
            decode_in_place=True,
        )
    return SocketQueueDriver(server.socket_path, decode_in_place=True)


def _never_run(query: Any, set_cancel_handler: Any) -> Any:
    raise AssertionError("the victim's query ran")


async def _victim_run(app: QueueApp, server: QueueServer, over: str, key: str) -> Any:
    queue = app.pool_queue(_driver(server, over))
    try:
        return await queue.run("sql", key, {"sql": "SELECT 1"}, timeout=30)
    finally:
        await queue.close()
        await queue.driver.close()


async def _until_queued(attacker: SocketQueueDriver, key_hash: str) -> None:
    async def queued() -> bool:
        return any(item.id == key_hash for item in await attacker.pending("victim"))

    await wait_until(queued, what="the victim's query queued")


@pytest.mark.parametrize("over", ["unix", "tcp"])
@pytest.mark.parametrize("how", ["ack", "planted", "cancel", "shared memory"])
async def test_a_victim_caller_refuses_a_crafted_result_by_name(
    tcp_server: QueueServer, workdir: Path, marker: Path, over: str, how: str
) -> None:
    secret = workdir / "secret.csv"
    secret.write_text("password\n")
    app = QueueApp("victim")
    app.handler("sql")(_never_run)  # the victim's handler: no pool here runs it
    key = f"report-{how}-{over}"
    path = f"victim:{hash_query_key(key)}"
    attacker = _driver(tcp_server, over)
    try:
        form, data = _framings(_gadgets(marker, secret)["builtins.exec"])["pickle"]
        outcome = orjson.dumps({"$binary": form, "data": base64.b64encode(data).decode()}).decode()
        if how == "shared memory":
            slot = await attacker.call("shm_alloc", len(data))
            outcome = attacker._segments.write_binary(slot, from_bytes(form, data))
        if how == "planted":
            await attacker.add(path, orjson.dumps({"sql": "SELECT 1"}).decode())
            assert (await attacker.ack(path, outcome)).success
            victim = asyncio.ensure_future(_victim_run(app, tcp_server, over, key))
        else:
            victim = asyncio.ensure_future(_victim_run(app, tcp_server, over, key))
            await _until_queued(attacker, hash_query_key(key))
            if how == "cancel":
                await attacker.cancel(path, result=outcome)
            else:
                assert (await attacker.ack(path, outcome)).success
        with pytest.raises(QueryError, match=r"form 'pickle' is refused"):
            await victim
    finally:
        await attacker.close()
        await app.aclose()
