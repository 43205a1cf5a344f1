"""A QueueApp whose workers run several queries at once, for the tests of lanes: its
handlers trace where and when they ran in $POOL_TRACE, and wait while the file named by
$POOL_GATE exists (the test lets them go)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from queryqueue import QueueApp

app = QueueApp(
    "lanes",
    concurrency=4,
    worker_concurrency=3,
    continue_wait_timeout=1.0,
    heartbeat_interval=0.25,
)
# Executions time out after a second.
short = QueueApp(
    "lanes_short",
    concurrency=3,
    worker_concurrency=3,
    execution_timeout=1.0,
    continue_wait_timeout=1.0,
    heartbeat_interval=0.25,
)
# Eight at once in one worker.
eight = QueueApp(
    "lanes_eight", concurrency=8, worker_concurrency=8, continue_wait_timeout=1.0,
    heartbeat_interval=0.25,
)  # fmt: skip

_in_flight = 0  # this process's handlers running now
_lock = threading.Lock()


def _trace(*fields: object) -> None:
    with open(os.environ["POOL_TRACE"], "a") as out:
        out.write(" ".join(str(f) for f in fields) + "\n")


def _gate_open() -> bool:
    gate = os.environ.get("POOL_GATE")
    return not gate or not os.path.exists(gate)


def _entered() -> int:
    global _in_flight
    with _lock:
        _in_flight += 1
        return _in_flight


def _left() -> None:
    global _in_flight
    with _lock:
        _in_flight -= 1


async def held(query: Any, set_cancel_handler: Any) -> dict[str, Any]:
    """Waits (asyncio) at the gate; returns how many ran in this process as it started."""
    set_cancel_handler({"key": query["key"]})
    together = _entered()
    _trace("start", query["key"], os.getpid(), time.monotonic(), together)
    try:
        while not _gate_open():  # noqa: ASYNC110 - a file another process removes
            await asyncio.sleep(0.01)
        await asyncio.sleep(query.get("seconds", 0))
    finally:
        _left()
        _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"key": query["key"], "pid": os.getpid(), "together": together}


def held_sync(query: Any, set_cancel_handler: Any) -> dict[str, Any]:
    """`held` for a sync handler, on a worker's thread."""
    together = _entered()
    _trace("start", query["key"], os.getpid(), time.monotonic(), together)
    try:
        while not _gate_open():
            time.sleep(0.01)
        time.sleep(query.get("seconds", 0))
    finally:
        _left()
        _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"key": query["key"], "pid": os.getpid(), "together": together}


def met(query: Any, set_cancel_handler: Any) -> bool:
    """True once `query["n"]` handlers run in this process at once (False after 30 s)."""
    _entered()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with _lock:
                if _in_flight >= query["n"]:
                    return True
            time.sleep(0.005)
        return False
    finally:
        # Leave only once every one has seen the meeting (or given up).
        time.sleep(0.2)
        _left()


async def met_async(query: Any, set_cancel_handler: Any) -> bool:
    _entered()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _in_flight >= query["n"]:
                return True
            await asyncio.sleep(0.005)
        return False
    finally:
        await asyncio.sleep(0.2)
        _left()


def cancelled(definition: dict[str, Any]) -> None:
    _trace("cancel", definition["query"]["key"], os.getpid(), time.monotonic())


for each in (app, short, eight):
    each.handler("held")(held)
    each.handler("held_sync")(held_sync)
    each.handler("met")(met)
    each.handler("met_async")(met_async)
    each.cancel_handler("held")(cancelled)
    each.cancel_handler("held_sync")(cancelled)


@app.on_worker_start
async def opened() -> None:
    app.state.opened = os.getpid()
    _trace("worker-start", "-", os.getpid(), time.monotonic())


@app.on_worker_stop
def closed() -> None:
    _trace("worker-stop", "-", os.getpid(), time.monotonic(), app.state.opened)


@app.handler("opened_by")
async def opened_by(query: Any, set_cancel_handler: Any) -> int:
    """The pid the worker's start hook recorded in `app.state`."""
    return int(app.state.opened)
