"""A QueueApp for the worker-pool tests: handlers that leave a trace of where and when
they ran, in the file named by $POOL_TRACE."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from queryqueue import QueryStream, QueueApp
from queryqueue.supervisor import loops

# A stall timeout of 1 s (4 heartbeats) keeps the tests that wait for one short; tests of
# several hosts that must never see a live query reaped by the other host under a loaded
# CI machine's pauses set POOL_HEARTBEAT (read in each supervisor as it loads the app).
app = QueueApp(
    "pool",
    concurrency=2,
    continue_wait_timeout=1.0,
    heartbeat_interval=float(os.environ.get("POOL_HEARTBEAT", "0.25")),
)


def _trace(*fields: object) -> None:
    with open(os.environ["POOL_TRACE"], "a") as out:
        out.write(" ".join(str(f) for f in fields) + "\n")


@app.handler("sql")
def run(query: Any, set_cancel_handler: Any) -> Any:
    set_cancel_handler({"pid": os.getpid()})
    _trace("start", query["key"], os.getpid(), time.monotonic())
    time.sleep(query.get("seconds", 0.05))
    _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"key": query["key"], "pid": os.getpid()}


_failed: dict[str, int] = {}


@app.handler("flaky", retries=2, retry_on=(ConnectionError,), backoff=0.01)
def flaky(query: Any) -> Any:
    """Fails twice with a transient error for each key, then answers."""
    _failed[query["key"]] = failures = _failed.get(query["key"], 0) + 1
    if failures <= 2:
        raise ConnectionError(f"attempt {failures} of {query['key']} failed")
    return {"key": query["key"], "attempts": failures}


@app.handler("gated")
def gated(query: Any, set_cancel_handler: Any) -> Any:
    """Runs until the test removes the file named by $POOL_GATE: holds its slot for as
    long as the test needs it held, however slow the machine."""
    _trace("start", query["key"], os.getpid(), time.monotonic())
    gate = os.environ.get("POOL_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.01)
    _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"key": query["key"], "pid": os.getpid()}


@app.handler("loop")
async def loop_kind(query: Any, set_cancel_handler: Any) -> str:
    return loops.running_name()


@app.cancel_handler("sql")
def cancel(definition: dict[str, Any]) -> None:
    # Last: the pid its handler set as its cancel handler (where it ran), as this got it.
    recorded = (definition.get("cancelHandler") or {}).get("pid")
    _trace("cancel", definition["query"]["key"], os.getpid(), time.monotonic(), recorded)


@app.stream
async def stream(query: Any, rows: QueryStream) -> None:
    for i in range(query["rows"]):
        await rows.write({"i": i, "pid": os.getpid()})


@app.handler("gil")
def hold_the_gil(query: Any, set_cancel_handler: Any) -> float:
    """Holds the GIL in one C call for about `query["seconds"]`, measured on this CPU: the
    fastest of a few calibration calls sets the size, so the long call cannot be shorter."""
    probe = 10**6
    fastest = min(_timed_sum(probe) for _ in range(5))
    n = int(probe * query["seconds"] / max(fastest, 1e-6))
    started = time.monotonic()
    _trace("gil-start", "gil", os.getpid(), started)
    sum(range(n))  # one long C call: this worker's own heartbeat cannot run
    _trace("gil-end", "gil", os.getpid(), time.monotonic())
    return time.monotonic() - started


def _timed_sum(n: int) -> float:
    started = time.perf_counter()
    sum(range(n))
    return time.perf_counter() - started


@app.handler("stubborn")
def stubborn(query: Any, set_cancel_handler: Any) -> str:
    _trace("start", query["key"], os.getpid(), time.monotonic())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # never looks at a cancellation
        time.sleep(0.05)
    return "finished anyway"


@app.cancel_handler("stubborn")
def cancel_stubborn(definition: dict[str, Any]) -> None:
    _trace("cancel", definition["query"]["key"], os.getpid(), time.monotonic())


_given_up = threading.Event()


@app.handler("polite")
def polite(query: Any, set_cancel_handler: Any) -> str:
    """Runs until its cancel handler tells it to stop, as an interrupted statement does;
    traces the thread it ran on."""
    _given_up.clear()
    set_cancel_handler({"pid": os.getpid()})
    _trace("start", query["key"], os.getpid(), time.monotonic(), threading.current_thread().name)
    if _given_up.wait(query.get("seconds", 60)):
        raise RuntimeError("interrupted")
    return "finished"


@app.cancel_handler("polite")
def cancel_polite(definition: dict[str, Any]) -> None:
    _trace("cancel", definition["query"]["key"], os.getpid(), time.monotonic())
    _given_up.set()


def big_text(size: int, seed: str) -> str:
    """`size` characters the caller can re-create to check what arrived."""
    block = "".join(f"{seed}:{i:08d};" for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


@app.handler("big")
def big(query: Any, set_cancel_handler: Any) -> str:
    _trace("start", query["key"], os.getpid(), time.monotonic())
    gate = os.environ.get("POOL_GATE")
    while gate and os.path.exists(gate):  # held until the test has every caller in
        time.sleep(0.01)
    text = big_text(query["size"], query["key"])
    _trace("end", query["key"], os.getpid(), time.monotonic())
    return text


_hoard: list[bytes] = []


@app.handler("hoard")
def hoard(query: Any, set_cancel_handler: Any) -> int:
    """Keeps what it allocates, like a leaking extension would."""
    _hoard.append(b"x" * query["bytes"])
    return os.getpid()


# A queue whose executions time out after half a second.
short = QueueApp(
    "short",
    concurrency=1,
    execution_timeout=0.5,
    continue_wait_timeout=1.0,
    heartbeat_interval=0.25,
)
short.handler("sql")(run)
short.cancel_handler("sql")(cancel)
short.handler("polite")(polite)
short.cancel_handler("polite")(cancel_polite)


def _with_heartbeat(name: str, concurrency: int) -> QueueApp:
    """A queue whose stall timeout is the tests' (POOL_HEARTBEAT, as `app`'s)."""
    heartbeat = float(os.environ.get("POOL_HEARTBEAT", "0.25"))
    return QueueApp(
        name, concurrency=concurrency, continue_wait_timeout=1.0, heartbeat_interval=heartbeat
    )


# One query at a time: one running query leaves a pool of one worker no idle slot.
single = _with_heartbeat("single", 1)
single.handler("sql")(run)
single.cancel_handler("sql")(cancel)
single.handler("hoard")(hoard)

# Two queues for one supervisor, each with its own budget (and pool).
one = QueueApp("one", concurrency=1, continue_wait_timeout=1.0, heartbeat_interval=0.25)
one.handler("sql")(run)
three = QueueApp("three", concurrency=3, continue_wait_timeout=1.0, heartbeat_interval=0.25)
three.handler("sql")(run)
three.handler("hoard")(hoard)


# Hosts sharing a budget of 6 (2 workers each on 3 hosts); their stall timeout as the
# multi-host tests set it (POOL_HEARTBEAT).
six = _with_heartbeat("six", 6)
six.handler("sql")(run)


@six.handler("ticking")
def ticking(query: Any, set_cancel_handler: Any) -> Any:
    """As `sql`, with a trace line every 50 ms while it runs: its last one tells when the
    process running it was last alive, should it die mid-query."""
    _trace("start", query["key"], os.getpid(), time.monotonic())
    deadline = time.monotonic() + query["seconds"]
    while time.monotonic() < deadline:
        _trace("tick", query["key"], os.getpid(), time.monotonic())
        time.sleep(0.05)
    _trace("end", query["key"], os.getpid(), time.monotonic())
    return {"key": query["key"], "pid": os.getpid()}
