"""The supervisor is the authority on the queues its pool runs: their concurrency is its
app's, whatever a client's own QueueApp says; and a signal meant for reloading does not
stop it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import QueueApp, SocketQueueDriver
from tests.supervisor_util import SupervisorProcess, start_supervisor
from tests.trace import max_overlap, read_trace
from tests.waiting import wait_until

APP = "tests.apps.pool_app:app"  # concurrency 2


@pytest.fixture
def pool(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", APP, "--workers", "4"
    )
    try:
        yield process
    finally:
        assert process.stop() == 0


def _greedy_app(pool: SupervisorProcess) -> QueueApp:
    """A caller's app for the pool's queue whose code says concurrency 8 (a deploy that
    disagrees with the supervisor's)."""
    app = QueueApp("pool", concurrency=8, continue_wait_timeout=1.0)
    app.handler("sql")(_runs_in_the_pool)
    app.socket_path = pool.socket_path
    return app


def _runs_in_the_pool(query: Any, set_cancel_handler: Any) -> Any:
    raise AssertionError("a caller ran a query its supervisor's pool runs")


async def test_a_callers_concurrency_never_exceeds_the_supervisors_budget(
    pool: SupervisorProcess, workdir: Path
) -> None:
    app = _greedy_app(pool)
    try:
        results = await asyncio.gather(
            *(
                app.run("sql", f"k{i}", {"key": f"k{i}", "seconds": 0.2}, priority=priority)
                for i in range(12)
                for priority in ((10,) if i % 2 else (0,))
            )
        )
    finally:
        await app.aclose()
    assert sorted(r["key"] for r in results) == sorted(f"k{i}" for i in range(12))
    trace = read_trace(workdir)
    assert len([t for t in trace if t[0] == "start"]) == 12
    assert max_overlap(trace) == 2  # the pool has 4 workers; the supervisor's budget is 2


async def test_sighup_leaves_the_supervisor_serving(pool: SupervisorProcess) -> None:
    os.kill(pool.pid, signal.SIGHUP)
    await wait_until(
        lambda: "SIGHUP" in pool.log.read_text(), what="the supervisor's word on SIGHUP"
    )
    driver = SocketQueueDriver(pool.socket_path)
    try:
        assert await driver.ping() == "pong"
        assert (await driver.add("other:k", "{}")).added
    finally:
        await driver.close()
    assert pool.process.poll() is None
