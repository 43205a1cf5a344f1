"""A process waiting on more queries than its supervisor parks long polls for: the client
holds the rest, and every call gets its result; none fails on the supervisor's limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from queryqueue import SocketQueueDriver
from tests.supervisor_util import start_supervisor

LANES = "tests.apps.lanes_app:app"  # budget 4, 3 queries a worker


@pytest.mark.parametrize(
    ("calls", "limit", "seconds"), [(120, 8, 0.01), (5_000, 64, 0.0)], ids=["120", "5000"]
)
async def test_calls_past_the_long_poll_limit_wait_in_the_client_and_all_complete(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, calls: int, limit: int, seconds: float
) -> None:
    from tests.apps.lanes_app import app

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    process = start_supervisor(
        workdir / "queue.db", workdir / "s.sock", "--app", LANES, "--max-long-polls", str(limit)
    )
    driver = SocketQueueDriver(process.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=30.0)
    try:
        keys = [f"k{i}" for i in range(calls)]
        results = await asyncio.gather(
            *(queue.run("held", key, {"key": key, "seconds": seconds}) for key in keys)
        )
        assert [result["key"] for result in results] == keys
        assert driver.polls.limit == limit and driver.polls.out == 0
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert process.stop() == 0


async def test_a_caller_cancelled_while_it_waits_for_a_permit_passes_nothing_on_twice() -> None:
    """Permits go first come first served; one cancelled in its wait leaves the queue, one
    cancelled as it was granted hands its permit to the next."""
    from queryqueue.driver_socket.permits import PollPermits

    permits = PollPermits(limit=1)
    assert permits.try_take()
    first = asyncio.ensure_future(permits.take())
    second = asyncio.ensure_future(permits.take())
    third = asyncio.ensure_future(permits.take())
    await asyncio.sleep(0)
    first.cancel()  # still waiting: it leaves the line
    await asyncio.gather(first, return_exceptions=True)
    permits.give()  # the held one comes back: the second gets it
    second.cancel()  # granted as it is cancelled: the third gets it instead
    await asyncio.gather(second, return_exceptions=True)
    await asyncio.wait_for(third, 5)
    assert permits.out == 1 and not permits.try_take()
    permits.give()
    assert permits.out == 0 and permits.try_take()
