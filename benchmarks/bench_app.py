"""The queue the benchmarks run: no-op, sleeping and large-result handlers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from queryqueue.app import QueueApp

# Callers wait for their results without going back in between (no continue-wait noise).
app = QueueApp("bench", concurrency=2, continue_wait_timeout=60.0, heartbeat_interval=5.0)

_made: dict[tuple[str, int], Any] = {}
ROW_TEXT = 1000  # characters of text per JSON row: ~1 KiB a row


@app.handler("noop")
def noop(query: Any, set_cancel_handler: Any) -> int:
    return 1


@app.handler("sleep")
def sleep(query: Any, set_cancel_handler: Any) -> int:
    time.sleep(query["seconds"])
    return 1


def make(kind: str, size: int) -> Any:
    """A result of about `size` bytes, made once per process (so a handler's run times
    only the transfer, and a caller can check what it got against the same value)."""
    if (kind, size) not in _made:
        _made[kind, size] = _MAKERS[kind](size)
    return _made[kind, size]


def _blob(size: int) -> str:
    return ("0123456789abcdef" * (size // 16 + 1))[:size]


def _rows(size: int) -> list[dict[str, Any]]:
    text = _blob(ROW_TEXT)
    return [{"id": i, "text": text} for i in range(size // (ROW_TEXT + 20))]


def _bytes(size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


def _arrow(size: int) -> Any:
    import numpy as np
    import pyarrow as pa

    rows = size // 24  # an int64, a float64 and an 8-byte timestamp a row
    ids = np.arange(rows, dtype="int64")
    return pa.table(
        {"id": ids, "value": ids * 0.5, "at": pa.array(ids * 1000, type=pa.timestamp("us"))}
    )


_MAKERS = {"blob": _blob, "rows": _rows, "bytes": _bytes, "arrow": _arrow}


@app.handler("blob")
def blob(query: Any, set_cancel_handler: Any) -> str:
    """A JSON string of `size` characters."""
    return make("blob", int(query["size"]))  # type: ignore[no-any-return]


@app.handler("rows")
def rows(query: Any, set_cancel_handler: Any) -> list[dict[str, Any]]:
    """JSON rows of ~1 KiB, `size` bytes of them."""
    return make("rows", int(query["size"]))  # type: ignore[no-any-return]


@app.handler("bytes")
def raw(query: Any, set_cancel_handler: Any) -> bytes:
    return make("bytes", int(query["size"]))  # type: ignore[no-any-return]


@app.handler("arrow")
def arrow(query: Any, set_cancel_handler: Any) -> Any:
    """An Arrow table of `size` bytes of columns."""
    return make("arrow", int(query["size"]))


# Queries that wait on I/O: a budget of 64, each worker process running 32 at once (the
# io_bound workload overrides the split with --workers and --worker-concurrency).
io = QueueApp(
    "bench_io",
    concurrency=64,
    worker_concurrency=32,
    continue_wait_timeout=60.0,
    heartbeat_interval=5.0,
)


@io.handler("sleep_async")
async def sleep_async(query: Any, set_cancel_handler: Any) -> int:
    """Waits `seconds` as a network call would, on the worker's loop."""
    await asyncio.sleep(query["seconds"])
    return 1


@io.handler("sleep_sync")
def sleep_sync(query: Any, set_cancel_handler: Any) -> int:
    """Waits `seconds` as a blocking driver would, on a worker's thread."""
    time.sleep(query["seconds"])
    return 1


# The callers' side of examples/postgres_app.py's queue (its supervisor runs the example's
# handlers; a caller needs only the queue's name).
pg_example = QueueApp("pg", concurrency=32, continue_wait_timeout=60.0)


# One queue on PostgreSQL served by several hosts of 2 workers each (the hosts workload):
# a budget of 6, shared by what each host's workers can run.
hosts = QueueApp("bench_hosts", concurrency=6, continue_wait_timeout=60.0)
hosts.handler("noop")(noop)
hosts.handler("sleep")(sleep)


# Two workers running 10 queries each at a budget of 20: as many at once as a PostgreSQL
# peer's two workers that take 10 jobs at a time (pgqueuer's default batch).
wide = QueueApp("bench_wide", concurrency=20, continue_wait_timeout=60.0)
wide.handler("noop")(noop)
