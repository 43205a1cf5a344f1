from __future__ import annotations

import asyncio

import pytest

from queryqueue.engine.aio import wait_within


async def test_wait_within_times_out_and_leaves_the_future_running() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_within(future, 0.01)
    assert not future.done()
    future.set_result(7)
    assert await wait_within(future, 1) == 7


async def test_a_cancelled_waiter_stays_cancelled_when_the_future_completes_with_it() -> None:
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_within(future, 10))
    await asyncio.sleep(0)
    future.set_result(1)  # both become ready in the same loop iteration
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
