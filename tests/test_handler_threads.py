"""The threads sync query handlers run in (engine/threads.py)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading

import pytest

from queryqueue.engine.threads import HandlerThreads
from tests.recording import record_calls
from tests.waiting import wait_until

REQUEST = contextvars.ContextVar("REQUEST", default="none")


async def test_a_call_returns_raises_and_sees_the_callers_context() -> None:
    threads = HandlerThreads()
    REQUEST.set("r-1")
    assert await threads.run(lambda: (REQUEST.get(), threading.current_thread().name)) == (
        "r-1",
        "queryqueue-handler",
    )

    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await threads.run(fails)


async def test_an_idle_thread_takes_the_next_call() -> None:
    threads = HandlerThreads()
    first = await threads.run(threading.get_ident)
    # The thread counts itself idle just after it delivered: wait for that, not a sleep.
    await wait_until(lambda: threads.idle == 1, what="the thread idle")
    assert await threads.run(threading.get_ident) == first


async def test_every_call_at_once_has_a_thread_beyond_the_default_executors_cap() -> None:
    """asyncio.to_thread would run min(32, cpus + 4) of these at a time and never fill
    the barrier: a queue's concurrency is its own to set."""
    at_once = min(32, (os.cpu_count() or 1) + 4) + 2
    barrier = threading.Barrier(at_once, timeout=20)
    threads = HandlerThreads()
    indexes = await asyncio.gather(*(threads.run(barrier.wait) for _ in range(at_once)))
    assert sorted(indexes) == list(range(at_once))


async def test_a_cancelled_call_runs_on_without_holding_up_the_next() -> None:
    threads = HandlerThreads()
    release = threading.Event()
    stuck = threads.run(lambda: release.wait(20))
    stuck.cancel()  # as a timed-out handler's future is: the thread cannot be stopped
    try:
        assert await asyncio.wait_for(threads.run(lambda: "next"), 10) == "next"
        assert stuck.cancelled()
    finally:
        release.set()


async def test_closed_its_threads_end_and_a_later_call_still_runs() -> None:
    name = f"handler-test-{os.getpid()}-{id(object())}"
    threads = HandlerThreads(name=name)

    def alive() -> int:
        return sum(1 for t in threading.enumerate() if t.name == name)

    assert await threads.run(lambda: 1) == 1
    await wait_until(lambda: threads.idle == 1, what="the thread idle")
    assert alive() == 1
    threads.close()
    await wait_until(lambda: alive() == 0, what="the idle thread ended")
    assert await threads.run(lambda: 2) == 2  # on a thread of its own, which then ends
    await wait_until(lambda: alive() == 0, what="the late call's thread ended")


async def test_a_quick_call_waited_for_on_the_spot_is_done_as_run_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool worker's sync handler: its outcome comes back without the loop's wake-up."""
    threads = HandlerThreads()
    loop = asyncio.get_running_loop()
    woken = record_calls(monkeypatch, loop, "call_soon_threadsafe")
    quick = threads.run(lambda: (REQUEST.get(), threading.get_ident()), within=10.0)
    assert quick.done()
    context, thread = quick.result()
    assert context == "none" and thread != threading.get_ident()  # in a thread all the same

    def fails() -> None:
        raise KeyError("boom")

    failed = threads.run(fails, within=10.0)
    assert failed.done() and isinstance(failed.exception(), KeyError)
    assert woken == []


async def test_a_call_slower_than_the_wait_comes_through_the_loop() -> None:
    threads = HandlerThreads()
    release = threading.Event()
    slow = threads.run(lambda: release.wait(20) and "slow", within=0.001)
    assert not slow.done()  # the wait ended first: the loop delivers it
    release.set()
    assert await asyncio.wait_for(slow, 10) == "slow"
