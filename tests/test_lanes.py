"""The lanes a blocking store's commands run on (engine/lanes.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from queryqueue.engine.lanes import Lanes
from tests.waiting import wait_until


async def test_a_prefix_keeps_its_lane_and_order_and_others_take_a_free_one() -> None:
    lanes = Lanes(2, "test-lane")
    release = threading.Event()
    ran: list[str] = []

    def blocked() -> str:
        release.wait(10)
        ran.append("p1")
        return threading.current_thread().name

    def after() -> str:
        ran.append("p2")
        return threading.current_thread().name

    try:
        first = asyncio.ensure_future(lanes.run("p", blocked))
        second = asyncio.ensure_future(lanes.run("p", after))
        await wait_until(lambda: lanes.load == [2, 0], what="p's two calls on one lane")
        # Another prefix is not held up by p's waiting call.
        other = await lanes.run("q", threading.current_thread)
        assert other.name == "test-lane-1"
        release.set()
        assert await first == await second == "test-lane-0"
        assert ran == ["p1", "p2"]
        await wait_until(lambda: lanes.load == [0, 0], what="the lanes free")
    finally:
        release.set()
        lanes.shutdown()


async def test_an_error_reaches_the_caller_and_the_lane_goes_on() -> None:
    lanes = Lanes(1, "test-lane")

    def fails() -> None:
        raise KeyError("boom")

    try:
        with pytest.raises(KeyError, match="boom"):
            await lanes.run(None, fails)
        assert await lanes.run(None, lambda: 7) == 7
    finally:
        lanes.shutdown()


async def test_a_cancelled_caller_keeps_its_lane_busy_until_its_call_ends() -> None:
    """A call whose caller stopped waiting is counted until it has ended on its thread;
    one that had not started does not run."""
    lanes = Lanes(1, "test-lane")
    release = threading.Event()
    ran: list[str] = []

    def running() -> None:
        ran.append("running")
        release.wait(10)

    try:
        started = asyncio.ensure_future(lanes.run("p", running))
        queued = asyncio.ensure_future(lanes.run("p", lambda: ran.append("queued")))
        await wait_until(lambda: ran == ["running"], what="the first call running")
        started.cancel()
        queued.cancel()
        await asyncio.gather(started, queued, return_exceptions=True)
        assert lanes.load == [2]  # the running call holds its lane still
        release.set()
        await wait_until(lambda: lanes.load == [0], what="both counted done")
        assert ran == ["running"]
    finally:
        release.set()
        lanes.shutdown()


async def test_shutdown_runs_what_was_handed_over_then_ends_the_threads() -> None:
    lanes = Lanes(2, "test-lane")
    ran: list[int] = []
    calls = [asyncio.ensure_future(lanes.run(None, ran.append, n)) for n in range(3)]
    await asyncio.sleep(0)  # handed over
    await asyncio.to_thread(lanes.shutdown)
    assert sorted(ran) == [0, 1, 2]
    await asyncio.gather(*calls)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-lane")]
