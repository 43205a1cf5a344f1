"""A sync handler run on the loop's thread under a watch (engine/loop_run.py): what the
executor does, with a watch of the test's own standing in for a pool worker's."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import orjson
import pytest

from queryqueue import MemoryQueueStore, QueryQueue
from queryqueue.engine import events as ev
from queryqueue.engine.loop_run import LoopRun
from queryqueue.engine.retrieved import RetrievedQuery


class _Watch:
    """Records what it is told. `stopping` (True: timed out, False: cancelled): it stops
    the run from a thread of its own once the handler has set its cancel handler, and
    waits for that stop before the run ends."""

    def __init__(self, stopping: bool | None = None, carries: bool = True) -> None:
        self.stopping, self.carries = stopping, carries
        self.begun: list[LoopRun] = []
        self.ended = 0
        self.carried: list[Any] = []
        self.outcomes: list[Any] = []
        self._stopper: threading.Thread | None = None

    def begin(self, run: LoopRun) -> None:
        self.begun.append(run)

    def end(self) -> None:
        if self._stopper is not None:
            self._stopper.join()
        self.ended += 1

    def carry_cancel_handler(self, run: LoopRun, value: Any) -> bool:
        self.carried.append((run.queue_id, value))
        if self.stopping is not None:
            stopping = self.stopping
            self._stopper = threading.Thread(
                target=lambda: self.outcomes.append(run.stop(stopping))
            )
            self._stopper.start()
        return self.carries


def _queue(store: MemoryQueueStore, handler: Any, cancel: Any = None, **options: Any) -> QueryQueue:
    return QueryQueue(
        "onloop",
        query_handlers={"sql": handler},
        cancel_handlers={"sql": cancel} if cancel is not None else {},
        driver=store,
        reconcile=False,
        **options,
    )


async def _execute(queue: QueryQueue, store: MemoryQueueStore) -> tuple[int, Any]:
    definition = {"queryHandler": "sql", "query": "k"}
    added = store.add("onloop:k", orjson.dumps(definition).decode())
    assert store.retrieve(added.id, concurrency=1) is not None
    done = await queue.execute_query(RetrievedQuery("k", added.id, added.id, 0, definition, 1))
    assert done
    stored = store.result(added.id)
    assert stored is not None and stored.payload is not None
    return added.id, orjson.loads(stored.payload)


async def test_a_sync_handler_runs_on_the_loops_thread_while_its_watch_looks_on() -> None:
    store = MemoryQueueStore()
    ran_on: list[int] = []

    def handler(query: Any, set_cancel_handler: Any) -> dict[str, Any]:
        ran_on.append(threading.get_ident())
        set_cancel_handler({"pid": 1})
        return {"echo": query}

    queue = _queue(store, handler, execution_timeout=30.0)
    queue.executor.watch = watch = _Watch()
    began = time.monotonic()
    try:
        queue_id, result = await _execute(queue, store)
    finally:
        await queue.close(grace=0)
    assert result == {"result": {"echo": "k"}}
    assert ran_on == [threading.get_ident()]  # no hop to a handler thread
    (run,) = watch.begun
    assert run.queue_id == queue_id and watch.ended == 1
    assert began + 30 <= run.deadline <= time.monotonic() + 30  # its execution timeout
    assert watch.carried == [(queue_id, {"pid": 1})]  # carried out by the watch, at once


async def test_a_cancel_handler_the_watch_cannot_carry_is_recorded_the_usual_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryQueueStore()
    seen: list[Any] = []

    def handler(query: Any, set_cancel_handler: Any) -> str:
        set_cancel_handler({"pid": 2})
        return "ok"

    queue = _queue(store, handler)
    queue.executor.watch = _Watch(carries=False)
    update = queue.connection.optimistic_query_update

    async def updating(key: str, patch: dict[str, Any], queue_id: Any) -> Any:
        seen.append(patch)
        return await update(key, patch, queue_id)

    monkeypatch.setattr(queue.connection, "optimistic_query_update", updating)
    try:
        await _execute(queue, store)
    finally:
        await queue.close(grace=0)
    assert seen == [{"cancelHandler": {"pid": 2}}]


@pytest.mark.parametrize("timed_out", [True, False], ids=["timeout", "cancel"])
async def test_a_run_stopped_by_its_watch_ends_with_that_stops_error(timed_out: bool) -> None:
    """The watch's thread calls the cancel handler, which makes the handler give up; the
    error the handler ends with is not its own: its waiters get the timeout (or the
    cancellation), and the cancel handler is not called a second time by the loop."""
    store = MemoryQueueStore()
    given_up = threading.Event()
    cancels: list[tuple[int, Any]] = []

    def handler(query: Any, set_cancel_handler: Any) -> str:
        set_cancel_handler({"statement": 9})
        if not given_up.wait(20):
            return "never stopped"
        raise RuntimeError("interrupted")  # what a statement interrupted says

    def cancel(definition: dict[str, Any]) -> None:
        cancels.append((threading.get_ident(), definition["cancelHandler"]))
        given_up.set()

    events: list[str] = []
    queue = _queue(
        store, handler, cancel, execution_timeout=1.5, logger=lambda name, _: events.append(name)
    )
    queue.executor.watch = watch = _Watch(stopping=timed_out)
    try:
        _, result = await _execute(queue, store)
    finally:
        await queue.close(grace=0)
    expected = "Query execution timeout after 1.5 s" if timed_out else "Query was cancelled"
    assert expected in result["error"]
    assert "interrupted" not in result["error"]
    ((thread, handed),) = cancels
    assert thread != threading.get_ident() and handed == {"statement": 9}
    assert (ev.CANCELLING_TIMEOUT if timed_out else ev.CANCELLING_EXTERNAL) in events
    assert orjson.loads(watch.outcomes[0])["error"] == result["error"]


async def test_a_handler_with_an_async_cancel_handler_still_runs_in_a_thread() -> None:
    """An async cancel handler cannot be called from the watch's thread: that handler's
    query runs in a thread, its cancellation through the loop, as without a watch."""
    store = MemoryQueueStore()
    ran_on: list[int] = []

    def handler(query: Any, set_cancel_handler: Any) -> str:
        ran_on.append(threading.get_ident())
        return "ok"

    async def cancel(definition: dict[str, Any]) -> None:
        await asyncio.sleep(0)

    queue = _queue(store, handler, cancel)
    queue.executor.watch = watch = _Watch()
    try:
        _, result = await _execute(queue, store)
    finally:
        await queue.close(grace=0)
    assert result == {"result": "ok"}
    assert ran_on and ran_on[0] != threading.get_ident() and watch.begun == []
