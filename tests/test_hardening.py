"""The supervisor as an attacker on the same host meets it: the TCP listener wants a
secret, the socket's directory must be ours alone, and one supervisor owns a socket and a
database."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from queryqueue import AuthenticationError, MemoryQueueStore, SocketQueueDriver, SqliteQueueStore
from queryqueue.driver_socket.protocol import read_frame
from queryqueue.engine.clock import ManualClock
from queryqueue.engine.listing import PURGE_BATCH
from queryqueue.supervisor.server import Limits, QueueServer
from queryqueue.supervisor.settings import Settings
from tests.supervisor_util import REPO, SupervisorProcess, start_supervisor
from tests.waiting import wait_until, wait_until_sync


def _supervise(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A supervisor expected to refuse to start: its exit code and what it said."""
    return subprocess.run(
        [sys.executable, "-m", "queryqueue", "supervisor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def _frames(sock: socket.socket, message: dict[str, object]) -> list[dict[str, object]]:
    """Send one frame, then read replies until the server hangs up (or 5 s pass)."""
    body = orjson.dumps(message)
    sock.sendall(struct.pack(">I", len(body)) + body)
    sock.settimeout(5)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    replies = []
    while len(data) >= 4:
        (size,) = struct.unpack(">I", data[:4])
        replies.append(orjson.loads(data[4 : 4 + size]))
        data = data[4 + size :]
    return replies


# -- TCP: no secret, no service ---------------------------------------------------------------


def test_a_tcp_listener_cannot_be_made_without_a_token() -> None:
    with pytest.raises(ValueError, match="auth token"):
        QueueServer(MemoryQueueStore(), "/tmp/unused.sock", tcp_host="127.0.0.1", tcp_port=0)


def test_tcp_clients_must_present_the_token_before_any_command(workdir: Path) -> None:
    supervisor = start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--tcp-port", "0", "--log-level", "info"
    )
    try:
        # Printed once both sockets listen, which may come after the Unix socket answers.
        wait_until_sync(lambda: _tcp_line(supervisor), within=30, what="the TCP listening line")
        found = _tcp_line(supervisor)
        assert found, supervisor.log.read_text()
        port = int(found.group(1))
        token_file = workdir / "s.sock.token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()

        async def as_a_user() -> list[str]:
            driver = SocketQueueDriver(f"tcp://127.0.0.1:{port}", auth_token=token)
            try:
                await driver.add("secret:abc", '{"payload": "private"}')
                return [row.id for row in await driver.list_items("secret")]
            finally:
                await driver.close()

        assert asyncio.run(as_a_user()) == ["abc"]

        # Another local user, without the token: refused and cut off, nothing read.
        for first in (
            {"id": 1, "cmd": "list_items", "args": ["secret"], "kwargs": {"with_payload": True}},
            {"id": 1, "cmd": "auth", "args": ["not-the-token"]},
        ):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                replies = _frames(sock, first)
            assert len(replies) == 1, replies
            assert replies[0]["error"]["type"] == "AuthenticationError"  # type: ignore[index]
            assert b"private" not in orjson.dumps(replies)

        async def without_token() -> None:
            driver = SocketQueueDriver(f"tcp://127.0.0.1:{port}", reconnect_timeout=1)
            try:
                await driver.ping()
            finally:
                await driver.close()

        with pytest.raises(AuthenticationError, match="auth_token"):
            asyncio.run(without_token())
    finally:
        assert supervisor.stop() == 0


def _tcp_line(supervisor: SupervisorProcess) -> re.Match[str] | None:
    return re.search(r"listening on tcp \('127\.0\.0\.1', (\d+)\)", supervisor.log.read_text())


# -- the socket's directory -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "open to others", "owned by another user"])
def test_an_unsafe_socket_directory_is_refused(workdir: Path, kind: str) -> None:
    target = workdir / "real"
    target.mkdir(mode=0o700)
    directory = workdir / "sockets"
    if kind == "symlink":
        directory.symlink_to(target)
    else:
        directory.mkdir(mode=0o700)
        if kind == "open to others":
            directory.chmod(0o777)
        else:
            if os.geteuid() != 0:
                pytest.skip("needs root to give a directory to another user")
            os.chown(directory, 65534, 65534)
    refused = _supervise("--db", str(workdir / "q.db"), "--socket", str(directory / "s.sock"))
    assert refused.returncode == 1
    assert f"unsafe socket directory {directory}" in refused.stderr
    assert not (target / "s.sock").exists() and not (directory / "s.sock").exists()


def test_a_missing_socket_directory_is_made_private(workdir: Path) -> None:
    supervisor = start_supervisor(workdir / "queue.db", workdir / "new" / "deeper" / "s.sock")
    try:
        assert stat.S_IMODE((workdir / "new" / "deeper").stat().st_mode) == 0o700
    finally:
        assert supervisor.stop() == 0


# -- one supervisor per socket and per database -----------------------------------------------


def test_a_second_supervisor_exits_naming_the_first_and_leaves_it_serving(workdir: Path) -> None:
    first = start_supervisor(workdir / "queue.db", workdir / "s.sock")
    try:
        same_socket = _supervise(
            "--db", str(workdir / "other.db"), "--socket", str(workdir / "s.sock")
        )
        assert same_socket.returncode == 1
        assert f"another supervisor (pid {first.pid}) is running on socket" in same_socket.stderr
        same_db = _supervise("--db", str(workdir / "queue.db"), "--socket", str(workdir / "t.sock"))
        assert same_db.returncode == 1
        assert f"another supervisor (pid {first.pid}) is running on database" in same_db.stderr

        async def ping() -> object:
            driver = SocketQueueDriver(workdir / "s.sock")
            try:
                return await driver.ping()
            finally:
                await driver.close()

        assert asyncio.run(ping()) == "pong"  # its socket is still there, and it answers
    finally:
        assert first.stop() == 0
    assert not (workdir / "s.sock").exists()


def test_a_socket_path_that_is_a_regular_file_is_left_alone(workdir: Path) -> None:
    precious = workdir / "notes.txt"
    precious.write_text("keep me")
    refused = _supervise("--db", str(workdir / "q.db"), "--socket", str(precious))
    assert refused.returncode == 1
    assert "exists and is not a socket" in refused.stderr
    assert precious.read_text() == "keep me"


def test_a_stale_socket_of_a_dead_supervisor_is_replaced(workdir: Path) -> None:
    stale = workdir / "s.sock"
    with socket.socket(socket.AF_UNIX) as leftover:
        leftover.bind(str(stale))  # bound, never listening: what a kill -9 leaves
    first = start_supervisor(workdir / "queue.db", stale)
    try:
        first.kill9()
        assert stale.exists()
        second = start_supervisor(workdir / "queue.db", stale)
        wait_until_sync(lambda: stale.exists(), within=10)
        assert second.stop() == 0
    finally:
        if first.process.poll() is None:
            first.kill9()


# -- what one connection may cost -------------------------------------------------------------


def _request(i: int, cmd: str, *args: object) -> bytes:
    body = orjson.dumps({"id": i, "cmd": cmd, "args": list(args)})
    return struct.pack(">I", len(body)) + body


def _read_replies(sock: socket.socket, count: int) -> list[dict[str, object]]:
    data, replies = b"", list[dict[str, object]]()
    while len(replies) < count:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
        while len(data) >= 4 and len(data) >= 4 + struct.unpack(">I", data[:4])[0]:
            (size,) = struct.unpack(">I", data[:4])
            replies.append(orjson.loads(data[4 : 4 + size]))
            data = data[4 + size :]
    return replies


async def test_a_client_that_does_not_read_is_not_read_either_and_loses_nothing(
    workdir: Path,
) -> None:
    limits = Limits(high_water=64 * 1024, hard_limit=64 * 1024 * 1024, max_in_flight=32)
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock", limits=limits)
    await server.start()
    try:
        server.store.add("p:k", orjson.dumps({"blob": "b" * 20_000}).decode())
        slow = socket.socket(socket.AF_UNIX)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(str(server.socket_path))
        count = 2000
        requests = b"".join(_request(i, "get", "p:k") for i in range(count))
        sending = asyncio.ensure_future(asyncio.to_thread(slow.sendall, requests))
        await wait_until(lambda: server.stats.throttled >= 1, what="throttled")
        (connection,) = list(server.connections)
        assert connection.buffered() <= limits.high_water + 40 * 25_000
        # Everyone else is served meanwhile.
        other = SocketQueueDriver(server.socket_path)
        assert await other.ping() == "pong"
        await other.close()
        # Once it reads, every answer arrives.
        replies = await asyncio.to_thread(_read_replies, slow, count)
        await sending
        # What it counts as unsent falls back to nothing once everything was written.
        await wait_until(lambda: connection.buffered() == 0, what="nothing left unsent")
        slow.close()
        assert len(replies) == count and all("ok" in r for r in replies)
    finally:
        await server.stop()


async def test_a_client_that_never_reads_past_the_hard_limit_is_cut_off(workdir: Path) -> None:
    limits = Limits(high_water=64 * 1024, hard_limit=1024 * 1024, max_in_flight=4096)
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock", limits=limits)
    await server.start()
    try:
        server.store.add("p:k", orjson.dumps({"blob": "b" * 100_000}).decode())
        hog = socket.socket(socket.AF_UNIX)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect(str(server.socket_path))
        await asyncio.to_thread(
            hog.sendall, b"".join(_request(i, "get", "p:k") for i in range(100))
        )
        await wait_until(lambda: not server.connections, what="the hog cut off")
        other = SocketQueueDriver(server.socket_path)
        assert await other.ping() == "pong"
        await other.close()
        hog.close()
    finally:
        await server.stop()


async def test_parked_long_polls_are_capped_per_connection(workdir: Path) -> None:
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock", limits=Limits(max_parked=3))
    await server.start()
    try:
        ids = [server.store.add(f"p:k{i}", "{}").id for i in range(4)]
        reader, writer = await asyncio.open_unix_connection(str(server.socket_path))
        writer.write(
            b"".join(_request(i, "result_blocking", qid, 60_000) for i, qid in enumerate(ids))
        )
        body = await read_frame(reader, 1 << 20)
        assert body is not None
        reply = orjson.loads(body)
        assert reply["id"] == 3
        assert "long polls waiting, the limit is 3" in reply["error"]["message"]
        writer.close()
    finally:
        await server.stop()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_an_idle_queue_purges_its_expired_results_on_a_timer(
    workdir: Path, tmp_path: Path, kind: str
) -> None:
    store = (
        MemoryQueueStore(result_ttl_ms=50)
        if kind == "memory"
        else SqliteQueueStore(tmp_path / "q.db", result_ttl_ms=50)
    )
    server = QueueServer(store, workdir / "s.sock", settings=Settings(purge_interval=0.05))
    await server.start()
    try:
        added = store.add("p:k", "{}")
        store.ack(added.id, '{"result": 1}')
        assert store.describe()["results_held"] == 1
        # No ACK comes to purge it: the server's timer does.
        await wait_until(lambda: store.describe()["results_held"] == 0, what="purged")
    finally:
        await server.stop()
        store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_one_idle_sweep_purges_every_expired_result_batch_after_batch(
    workdir: Path, tmp_path: Path, kind: str
) -> None:
    clock = ManualClock()
    store = (
        MemoryQueueStore(clock=clock, result_ttl_ms=50)
        if kind == "memory"
        else SqliteQueueStore(tmp_path / "q.db", clock=clock, result_ttl_ms=50)
    )
    expired = 10 * PURGE_BATCH + 7
    for i in range(expired):
        store.ack(store.add(f"p:k{i}", "{}").id, '{"result": 1}')
    assert store.describe()["results_held"] == expired
    clock.advance(51)  # all expire at once, as a busy hour's results do an hour later
    server = QueueServer(store, workdir / "s.sock", settings=Settings(purge_interval=0.2))
    await server.start()
    try:

        def purged() -> dict[str, int]:
            counted: dict[str, int] = server.stats.snapshot()["purged"]
            return counted

        await wait_until(lambda: purged()["results"] >= expired, what="purged")
        # All of them in the first sweep that found any, not a batch a sweep.
        assert purged() == {"results": expired, "sweeps": 1}
    finally:
        await server.stop()
        store.close()
