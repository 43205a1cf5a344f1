"""The supervisor stopped under its callers: SIGTERM answers parked long polls and
checkpoints; kill -9, twice under three busy clients, loses nothing and runs nothing twice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from queryqueue import SocketQueueDriver, SqliteQueueStore
from tests.supervisor_util import REPO, start_supervisor
from tests.waiting import wait_until_sync

CRASH_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    from queryqueue.engine.errors import QueueError
    from queryqueue.engine.queue import QueryQueue
    from queryqueue.driver_socket.client import SocketQueueDriver

    socket_path, name, count, log = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    async def handler(query, set_cancel_handler):
        # Any client may run any client's item: the query names its key.
        with open(log, "a") as out:
            out.write(f"exec {query['key']}\\n")
        await asyncio.sleep(0.005)
        return query["i"] * 2

    async def main():
        driver = SocketQueueDriver(socket_path, reconnect_timeout=60)
        def events(message, fields):
            if message not in ("Added to queue", "Waiting for query", "Performing query",
                               "Performing query completed", "Finished waiting for query"):
                with open(log + ".events", "a") as out:
                    out.write(f"{message} {fields.get('queryKey')} {fields.get('error', '')}\\n")

        queue = QueryQueue("crash", query_handlers={"h": handler}, driver=driver, concurrency=3, logger=events,
                           continue_wait_timeout=0.5, heartbeat_interval=1.0, orphaned_timeout=60)
        for i in range(count):
            while True:
                try:
                    key = f"{name}-{i}"
                    result = await queue.execute_in_queue("h", key, {"key": key, "i": i}, 10 if i % 3 == 0 else 0)
                    break
                except QueueError:  # continue wait, supervisor away: ask again
                    await asyncio.sleep(0.02)
            assert result == i * 2, (i, result)
            print(f"done {name}-{i}", flush=True)
        await queue.shutdown()
        await driver.close()

    asyncio.run(main())
    """
)


def _wait_for_lines(logs: list[Path], threshold: int) -> None:
    wait_until_sync(
        lambda: sum(_lines(log) for log in logs) >= threshold, within=60, what="clients at work"
    )


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_sigterm_answers_parked_long_polls_and_checkpoints(workdir: Path) -> None:
    supervisor = start_supervisor(workdir / "queue.db", workdir / "s.sock")
    driver = SocketQueueDriver(supervisor.socket_path, reconnect_timeout=0.5)
    try:
        queued = await driver.add("sd:k", "{}")
        parked = asyncio.create_task(driver.result_blocking(queued.id, 60_000))
        await asyncio.sleep(0)
        deadline = time.monotonic() + 10
        while (await driver.stats())["waiters"] != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        started = time.monotonic()
        supervisor.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(parked, 10) is None  # the timeout answer, not an error
        assert time.monotonic() - started < 10
        assert await asyncio.to_thread(supervisor.process.wait, 20) == 0
    finally:
        await driver.close()
        supervisor.stop()
    wal = workdir / "queue.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    store = SqliteQueueStore(workdir / "queue.db")
    try:
        assert [row.id for row in store.pending("sd")] == ["k"]
    finally:
        store.close()


def test_kill_9_supervisor_loses_nothing_and_clients_resume(workdir: Path) -> None:
    db, sock = workdir / "queue.db", workdir / "s.sock"
    supervisor = start_supervisor(db, sock)
    count = 120
    logs = [workdir / f"client{i}.log" for i in range(3)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CRASH_CLIENT, str(sock), f"c{i}", str(count), str(logs[i])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(3)
    ]
    try:
        for threshold in (60, 180):  # twice, while every client is mid-stream
            _wait_for_lines(logs, threshold)
            supervisor.kill9()
            assert sum(_lines(log) for log in logs) < 3 * count
            supervisor = start_supervisor(db, sock)  # same database, same socket
        outputs = [client.communicate(timeout=120) for client in clients]
        for client, (out, err) in zip(clients, outputs, strict=True):
            assert client.returncode == 0, err[-3000:]
            assert out.count("done ") == count
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(timeout=20)
        supervisor.stop()
    executions: dict[str, int] = {}
    for log in logs:
        for line in log.read_text().splitlines():
            executions[line.split()[1]] = executions.get(line.split()[1], 0) + 1
    assert sorted(executions) == sorted(f"c{c}-{i}" for c in range(3) for i in range(count))
    twice = {key: n for key, n in executions.items() if n != 1}
    events = "".join(p.read_text() for p in workdir.glob("*.events"))
    assert not twice, (
        f"executed more than once: {twice}; events: {events[-4000:]}"
    )  # nothing re-run
    store = SqliteQueueStore(db)
    try:
        assert store.list_items("crash") == []  # nothing left pending or wedged active
    finally:
        store.close()
