"""The supervisor process: its protocol, bad input, fuzzing, group commit, the command line,
and a forked client."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from queryqueue import ExternalIdConflictError, SocketQueueDriver
from tests.supervisor_util import REPO, SupervisorProcess, start_supervisor


@pytest.fixture
def supervisor(workdir: Path) -> Iterator[SupervisorProcess]:
    process = start_supervisor(workdir / "queue.db", workdir / "s.sock")
    try:
        yield process
    finally:
        process.stop()


class RawClient:
    """Bytes on the socket, to send what a well-behaved client never would."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(str(path))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: dict[str, Any]) -> None:
        body = orjson.dumps(message)
        self.send_raw(struct.pack(">I", len(body)) + body)

    def receive(self) -> dict[str, Any]:
        header = self._exactly(4)
        (size,) = struct.unpack(">I", header)
        reply: dict[str, Any] = orjson.loads(self._exactly(size))
        return reply

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.receive()

    def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed by the supervisor")
            data += chunk
        return data

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"id": 1, "cmd": "fly"}, "unknown command 'fly'"),
    ({"id": 2, "cmd": "add", "args": ["p:k"]}, "add: wrong arguments"),
    (
        {"id": 3, "cmd": "add", "args": ["p:k", "{}"], "kwargs": {"colour": "red"}},
        "add: wrong arguments",
    ),
    (
        {"id": 4, "cmd": "add", "args": ["p:k", "{}"], "kwargs": {"priority": "high"}},
        "priority must be an integer",
    ),
    ({"id": 5, "cmd": "add", "args": [17, "{}"]}, "path must be a string"),
    ({"id": 6, "cmd": "add", "args": "p:k"}, "'args' must be a list"),
    ({"id": 7, "cmd": "ack", "args": [1, "{not json"]}, "result is not valid JSON"),
    ({"id": 8, "sql": "DELETE FROM items"}, "only QUEUE commands"),
    ({"id": 9, "sql": "QUEUE ADD 'p:k'"}, "missing payload"),
    ({"id": 10}, "needs a 'cmd'"),
    ({"id": 11, "cmd": "result_blocking", "args": [1, -5]}, "timeout must be between 0 and"),
    ({"id": 12, "cmd": "hello", "kwargs": {"process_id": 5}}, "process_id must be a string"),
]


FUZZ_COMMANDS: list[Any] = [
    *("add", "retrieve", "ack", "result", "get", "cancel", "list_items", "pending"),
    *("to_cancel", "merge_extra", "heartbeat", "hello", "stats", "nope", None, 3),
]


FUZZ_VALUES: list[Any] = [
    *(None, True, -1, 0, 2**70, 1.5, "", "fz", "other:x", "{", "{}", [], {}, "x" * 600),
]


def _fuzzed_frame(rng: random.Random, sent: int) -> bytes:
    """Random bytes, a random SQL-text command, or a JSON command of random arguments
    (never of the "fz" prefix: the kept item must survive whatever was sent)."""
    roll = rng.random()
    if roll < 0.2:
        return rng.randbytes(rng.randrange(0, 64))
    if roll < 0.3:
        verb = rng.choice(["ADD", "GET", "ACK", "LIST", "X"])
        words = [
            rng.choice(["'other:a'", "99999", "NULL", "'{}'", "PRIORITY"])
            for _ in range(rng.randrange(4))
        ]
        return orjson.dumps({"id": sent, "sql": f"QUEUE {verb} " + " ".join(words)})
    args = [rng.choice(FUZZ_VALUES) for _ in range(rng.randrange(4))]
    if args and isinstance(args[0], str) and args[0].startswith("fz"):
        args[0] = "other:" + args[0]
    kwargs = (
        {rng.choice(["priority", "process_id", "limit", "x"]): rng.choice(FUZZ_VALUES)}
        if rng.random() < 0.3
        else {}
    )
    message = {"id": sent, "cmd": rng.choice(FUZZ_COMMANDS), "args": args, "kwargs": kwargs}
    return json.dumps(message).encode()  # stdlib json: integers of any size


FORK_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    from queryqueue.driver_socket.client import SocketQueueDriver

    driver = SocketQueueDriver(sys.argv[1])

    async def use(tag):
        added = await driver.add(f"fork:{tag}", "{}")
        stats = await driver.stats()
        return added.added, stats["connections"]

    print("parent", *asyncio.run(use("before")), flush=True)
    pid = os.fork()
    if pid == 0:
        # the child inherits the driver object and must open its own connection
        added, connections = asyncio.run(use("child"))
        os._exit(0 if added and driver.connection.link is not None else 3)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    print("parent", *asyncio.run(use("after")), flush=True)
    """
)


async def _pending_keys(socket_path: Path, prefix: str) -> list[str]:
    driver = SocketQueueDriver(socket_path)
    try:
        return [row.id for row in await driver.pending(prefix)]
    finally:
        await driver.close()


def test_socket_is_private_and_commands_round_trip(supervisor: SupervisorProcess) -> None:
    assert oct(supervisor.socket_path.stat().st_mode & 0o777) == "0o600"
    client = RawClient(supervisor.socket_path)
    try:
        added = client.ask(
            {"id": 1, "cmd": "add", "args": ["p:k", "{}"], "kwargs": {"priority": 3}}
        )
        assert added == {"id": 1, "ok": {"id": 1, "added": True, "pending": 1}}
        rows = client.ask({"id": "two", "sql": "QUEUE LIST 'p'"})
        assert rows == {
            "id": "two",
            "rows": [{"id": "k", "queue_id": "1", "status": "pending", "extra": None}],
        }
    finally:
        client.close()


@pytest.mark.parametrize(
    ("request_", "named"), BAD_REQUESTS, ids=[str(r[0]["id"]) for r in BAD_REQUESTS]
)
def test_bad_requests_get_an_error_naming_the_problem(
    supervisor: SupervisorProcess, request_: dict[str, Any], named: str
) -> None:
    client = RawClient(supervisor.socket_path)
    try:
        client.ask({"id": 0, "cmd": "add", "args": ["p:kept", '{"q":1}']})
        before = client.ask({"id": 0, "sql": "QUEUE LIST WITH_PAYLOAD 'p'"})
        reply = client.ask(request_)
        assert reply["id"] == request_["id"]
        assert named in reply["error"]["message"]
        # the connection is still up and nothing changed
        assert client.ask({"id": 0, "sql": "QUEUE LIST WITH_PAYLOAD 'p'"}) == before
    finally:
        client.close()


def test_frames_that_are_not_json_keep_the_connection(supervisor: SupervisorProcess) -> None:
    client = RawClient(supervisor.socket_path)
    try:
        for body in (b"\xff\xfe garbage", b"[1, 2, 3]", b""):
            client.send_raw(struct.pack(">I", len(body)) + body)
            reply = client.receive()
            assert reply["id"] is None and reply["error"]["type"] == "InvalidCommandError"
        assert client.ask({"id": 1, "cmd": "ping"}) == {"id": 1, "ok": "pong"}
    finally:
        client.close()


def test_unframeable_input_closes_only_that_connection(supervisor: SupervisorProcess) -> None:
    witness = RawClient(supervisor.socket_path)
    try:
        oversized = RawClient(supervisor.socket_path)
        oversized.send_raw(struct.pack(">I", 2**31) + b"{}")
        reply = oversized.receive()
        assert "over the limit" in reply["error"]["message"]
        assert oversized.closed_by_peer()
        oversized.close()

        truncated = RawClient(supervisor.socket_path)
        truncated.send_raw(struct.pack(">I", 100) + b'{"id": 1, "cmd"')
        truncated.close()  # mid-frame hang-up

        http = RawClient(supervisor.socket_path)
        http.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a length of 1.2 GB: over the limit
        assert "over the limit" in http.receive()["error"]["message"]
        http.close()

        assert witness.ask({"id": 1, "cmd": "ping"}) == {"id": 1, "ok": "pong"}
        assert supervisor.process.poll() is None
    finally:
        witness.close()


def test_fuzzed_frames_never_take_the_server_down(supervisor: SupervisorProcess) -> None:
    rng = random.Random(20261129)
    keeper = RawClient(supervisor.socket_path)
    keeper.ask({"id": 0, "cmd": "add", "args": ["fz:keep", '{"keep":true}']})
    before = keeper.ask({"id": 0, "sql": "QUEUE LIST WITH_PAYLOAD 'fz'"})
    deadline = time.monotonic() + 3.0
    sent = 0
    client = RawClient(supervisor.socket_path)
    try:
        while time.monotonic() < deadline:
            body = _fuzzed_frame(rng, sent)
            client.send_raw(struct.pack(">I", len(body)) + body)
            reply = client.receive()
            assert "ok" in reply or "error" in reply or "rows" in reply
            sent += 1
    finally:
        client.close()
    assert sent > 100
    assert supervisor.process.poll() is None
    assert keeper.ask({"id": 0, "sql": "QUEUE LIST WITH_PAYLOAD 'fz'"}) == before
    keeper.close()


async def test_pipelined_commands_from_many_clients_answer_as_if_alone(
    supervisor: SupervisorProcess,
) -> None:
    drivers = [SocketQueueDriver(supervisor.socket_path) for _ in range(4)]
    try:
        adds = [
            drivers[i % 4].add(
                f"gc:k{i % 50}", orjson.dumps({"i": i}).decode(), external_id=f"e{i % 50}"
            )
            for i in range(400)
        ]
        outcomes = await asyncio.gather(*adds, return_exceptions=True)
        added = [o for o in outcomes if not isinstance(o, BaseException)]
        # each path is added exactly once; every re-add answers the same id
        assert sum(o.added for o in added) == 50
        ids_by_key: dict[int, set[int]] = {}
        for i, o in enumerate(outcomes):
            assert not isinstance(o, BaseException)
            ids_by_key.setdefault(i % 50, set()).add(o.id)
        assert all(len(ids) == 1 for ids in ids_by_key.values())
        # a failing command inside a batch is undone alone
        mixed = await asyncio.gather(
            drivers[0].add("gc:new", "{}", external_id="e1"),  # conflict: e1 is taken
            drivers[1].add("gc:fine", "{}"),
            return_exceptions=True,
        )
        assert isinstance(mixed[0], ExternalIdConflictError)
        assert not isinstance(mixed[1], BaseException) and mixed[1].added
        assert len(await drivers[2].pending("gc")) == 51
        stats = await drivers[3].stats()
        assert stats["commands"]["add"]["count"] >= 402
        assert stats["mean_batch"] > 1  # commands did share transactions
    finally:
        for driver in drivers:
            await driver.close()


def test_cli_status_and_sql(supervisor: SupervisorProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUERYQUEUE_SOCKET": str(supervisor.socket_path)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "queryqueue", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    added = cli("sql", "QUEUE ADD PRIORITY 1 'cli:k' '{\"a\":1}'")
    assert added.returncode == 0 and "true" in added.stdout
    listed = cli("sql", "QUEUE LIST 'cli'")
    assert listed.returncode == 0 and "pending" in listed.stdout and "(1 row)" in listed.stdout
    status = cli("status")
    assert status.returncode == 0
    assert "cli" in status.stdout and "add" in status.stdout
    refused = cli("sql", "DROP TABLE items")
    assert refused.returncode == 1 and "only QUEUE commands" in refused.stderr
    gone = cli("status", "--socket", str(supervisor.socket_path.with_name("none.sock")))
    assert gone.returncode == 1 and "no supervisor" in gone.stderr


def test_tcp_listener_is_loopback_only() -> None:
    from queryqueue.engine.memory_store import MemoryQueueStore
    from queryqueue.supervisor.server import QueueServer

    with pytest.raises(ValueError, match="loopback"):
        QueueServer(MemoryQueueStore(), "/tmp/unused.sock", tcp_host="0.0.0.0")


def test_a_forked_child_opens_its_own_connection(supervisor: SupervisorProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(supervisor.socket_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("parent True") and lines[1] == "child 0"
    assert lines[2].startswith("parent True")
    keys = asyncio.run(_pending_keys(supervisor.socket_path, "fork"))
    assert keys == ["before", "child", "after"]
