"""The queue the benchmarks run: no-op, sleeping and large-result handlers."""

from __future__ import annotations

import time
from typing import Any

from queryqueue.supervisor.app import QueueApp

# Callers wait for their results without going back in between (no continue-wait noise).
app = QueueApp("bench", concurrency=2, continue_wait_timeout=60.0, heartbeat_interval=5.0)

_blobs: dict[int, str] = {}


@app.handler("noop")
def noop(query: Any, set_cancel_handler: Any) -> int:
    return 1


@app.handler("sleep")
def sleep(query: Any, set_cancel_handler: Any) -> int:
    time.sleep(query["seconds"])
    return 1


@app.handler("blob")
def blob(query: Any, set_cancel_handler: Any) -> str:
    """A result of `size` characters, made once per worker so only its transfer is timed."""
    size = int(query["size"])
    if size not in _blobs:
        _blobs[size] = ("0123456789abcdef" * (size // 16 + 1))[:size]
    return _blobs[size]
