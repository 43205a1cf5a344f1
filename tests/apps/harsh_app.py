"""A QueueApp whose handlers treat their worker badly, for the pool's hardening tests.
Each leaves `<event> <key> <pid> <monotonic time>` lines in $POOL_TRACE."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from queryqueue import QueueApp

app = QueueApp(
    "harsh",
    concurrency=2,
    execution_timeout=3.0,
    heartbeat_interval=0.25,
    continue_wait_timeout=0.5,
)


def _trace(*fields: object) -> None:
    with open(os.environ["POOL_TRACE"], "a") as out:
        out.write(" ".join(str(f) for f in fields) + "\n")


@app.handler("suicide")
def suicide(query: Any, set_cancel_handler: Any) -> None:
    _trace("start", query["key"], os.getpid(), time.monotonic())
    os.kill(os.getpid(), signal.SIGKILL)


@app.handler("sleep")
def sleep(query: Any, set_cancel_handler: Any) -> dict[str, Any]:
    _trace("start", query["key"], os.getpid(), time.monotonic())
    time.sleep(query["seconds"])
    _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"slept": query["seconds"], "pid": os.getpid()}
