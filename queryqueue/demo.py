"""`queryqueue demo`: a real workload through a supervisor, a worker pool and several
request processes, on a temporary SQLite queue.

1. Generates a sales "warehouse" (a SQLite file, `--rows` rows, no download).
2. Starts `queryqueue supervisor --app queryqueue.demo_app:app --workers N` on a temp queue.
3. Starts `--clients` request processes that submit `--requests` analytical queries between
   them, many users at once: popular queries are asked by many processes at the same time
   (deduplicated), interactive lookups at priority 10 (the fast track) among background
   reports at priority 0, one stream query, one query cancelled while it runs and one that
   runs into the execution timeout; then, on the drained queue, an interactive phase (one
   user per process, think time between lookups, priority 10 and 0 alternately).
4. Checks every result against a direct execution of the same SQL and prints a summary.

Exits 0 only when every result was correct and the cancel and the timeout did what they
should.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import queue as stdlib_queue
import random
import signal
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from queryqueue.supervisor.launch import launch

REGIONS = [f"region-{i}" for i in range(8)]
PRODUCTS = [f"product-{i:02d}" for i in range(50)]

# Background reports (priority 0): full scans, a few hundred ms each on a million rows.
BACKGROUND = [
    "SELECT region, count(*), round(sum(amount), 2) FROM sales GROUP BY region ORDER BY region",
    "SELECT region, product, max(amount) FROM sales GROUP BY region, product ORDER BY 1, 2",
    "SELECT count(DISTINCT customer) FROM sales WHERE amount > 500",
    *(
        f"SELECT product, round(avg(amount), 2), sum(quantity) FROM sales "
        f"WHERE region = '{r}' GROUP BY product ORDER BY product"
        for r in REGIONS[:4]
    ),
    *(
        f"SELECT day / 30 AS month, round(sum(amount * quantity), 2) FROM sales "
        f"WHERE product = '{p}' GROUP BY month ORDER BY month"
        for p in PRODUCTS[:4]
    ),
    *(
        f"SELECT quantity, count(*) FROM sales WHERE day BETWEEN {d} AND {d + 29} "
        f"GROUP BY quantity ORDER BY quantity"
        for d in (0, 90, 180)
    ),
]
# Interactive lookups (priority 10): one customer, through an index.
INTERACTIVE = [
    f"SELECT customer, count(*), round(sum(amount), 2), max(day) FROM sales "
    f"WHERE customer = {c} GROUP BY customer"
    for c in range(0, 100_000, 2_500)
]
STREAM_SQL = "SELECT id, region, product, amount FROM sales WHERE customer < 40 ORDER BY id"
# Never ends by itself: one is cancelled, the other runs into the execution timeout.
ENDLESS = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    "SELECT count(*) FROM (SELECT x FROM c LIMIT 100000000000) /* {tag} */"
)
CANCEL_SQL = ENDLESS.format(tag="cancelled by the demo")
TIMEOUT_SQL = ENDLESS.format(tag="runs into the execution timeout")


@dataclass(frozen=True)
class Request:
    index: int
    kind: str  # sql | stream | cancel | timeout
    sql: str
    priority: int


@dataclass
class Outcome:
    index: int
    kind: str
    sql: str
    priority: int
    seconds: float
    status: str  # ok | cancelled | timed out | error
    digest: str | None = None
    detail: str = ""
    fast_tracked: bool = False
    rows: int = 0


def make_warehouse(path: Path, rows: int) -> None:
    """`rows` pseudo-random sales, generated inside SQLite (seconds for millions)."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        PRAGMA journal_mode = OFF;
        PRAGMA synchronous = OFF;
        CREATE TABLE sales (
            id INTEGER PRIMARY KEY, day INT, region TEXT, product TEXT,
            customer INT, quantity INT, amount REAL
        );
        """
    )
    conn.execute(
        """
        INSERT INTO sales (day, region, product, customer, quantity, amount)
        WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < ?)
        SELECT (i * 7919) % 365,
               'region-' || ((i * 31) % 8),
               'product-' || substr('0' || ((i * 131) % 50), -2),
               (i * 2654435761) % 100000,
               1 + (i * 17) % 9,
               ((i * 48271) % 100000) / 100.0
        FROM seq
        """,
        (rows,),
    )
    conn.execute("CREATE INDEX sales_customer ON sales (customer)")
    conn.commit()
    conn.close()


def plan(requests: int, clients: int, seed: int = 7) -> list[list[Request]]:
    """Each client's requests. Popular reports are asked far more often than others, so
    identical queries are in flight in several processes at once."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(BACKGROUND))]
    specials = [
        Request(0, "cancel", CANCEL_SQL, 10),
        Request(1, "timeout", TIMEOUT_SQL, 10),
        Request(2, "stream", STREAM_SQL, 0),
    ]
    made: list[Request] = []
    for index in range(len(specials), max(requests, len(specials))):
        if rng.random() < 0.2:
            made.append(Request(index, "sql", rng.choice(INTERACTIVE), 10))
        else:
            made.append(Request(index, "sql", rng.choices(BACKGROUND, weights)[0], 0))
    shares: list[list[Request]] = [[] for _ in range(clients)]
    for n, special in enumerate(specials):
        shares[n % clients].append(special)
    for n, request in enumerate(made):
        shares[n % clients].append(request)
    return shares


INTERACTIVE_PER_CLIENT = 8  # the interactive phase: one user per process, one at a time
THINK_TIME = 0.05  # seconds between one user's lookups


def interactive_plan(clients: int, per_client: int = INTERACTIVE_PER_CLIENT) -> list[list[Request]]:
    """The interactive phase, once the background load has drained: each process asks
    lookups of its own one at a time, alternately at priority 10 and 0, so the fast track
    (room in the budget) is seen beside the queued path on the same queue."""
    return [
        [
            Request(
                100_000 + client * per_client + n,
                "interactive",
                INTERACTIVE[(client * per_client + n) % len(INTERACTIVE)],
                10 if n % 2 == 0 else 0,
            )
            for n in range(per_client)
        ]
        for client in range(clients)
    ]


def digest(rows: Any) -> str:
    return hashlib.sha1(orjson.dumps(rows)).hexdigest()


# -- a request process ---------------------------------------------------------------------


def client_main(
    socket_path: str,
    warehouse: str,
    requests: list[Request],
    users: int,
    settings: dict[str, Any],
    outcomes: Any,
    go: Any,
    interactive: list[Request] | None = None,
    interactive_go: Any = None,
) -> None:
    asyncio.run(
        _client(
            socket_path,
            warehouse,
            requests,
            users,
            settings,
            outcomes,
            go,
            interactive or [],
            interactive_go,
        )
    )


async def _client(
    socket_path: str,
    warehouse: str,
    requests: list[Request],
    users: int,
    settings: dict[str, Any],
    outcomes: Any,
    go: Any,
    interactive: list[Request],
    interactive_go: Any,
) -> None:
    from queryqueue.demo_app import app
    from queryqueue.driver_socket.client import SocketQueueDriver
    from queryqueue.engine.errors import QueryCancelledError, QueryError, QueryTimeoutError

    fast_tracked: set[str] = set()

    def on_event(message: str, fields: dict[str, Any]) -> None:
        if message == "Added to queue" and fields.get("fastTrack"):
            fast_tracked.add(str(fields.get("requestId")))

    driver = SocketQueueDriver(socket_path)
    queue = app.pool_queue(driver, logger=on_event, **settings)
    todo: asyncio.Queue[Request] = asyncio.Queue()
    for request in requests:
        todo.put_nowait(request)
    cancelled: set[int] = set()
    cancelling: set[asyncio.Task[None]] = set()

    async def ask(request: Request) -> Outcome:
        request_id = f"{os.getpid()}-{request.index}"
        query = {"warehouse": warehouse, "sql": request.sql}
        started = time.perf_counter()

        def outcome(status: str, **details: Any) -> Outcome:
            return Outcome(
                request.index,
                request.kind,
                request.sql,
                request.priority,
                time.perf_counter() - started,
                status,
                fast_tracked=request_id in fast_tracked,
                **details,
            )

        if request.kind == "stream":
            stream = await queue.execute_in_queue(
                "stream", [request.sql], query, request.priority, request_id=request_id
            )
            rows = await stream.rows()
            return outcome("ok", digest=digest(rows), rows=len(rows))
        if request.kind == "cancel":
            cancelling.add(asyncio.ensure_future(cancel_when_running(request, request_id)))
        try:
            result = await queue.run(
                "sql",
                [request.sql],
                query,
                priority=request.priority,
                request_id=request_id,
                stage_query_key=[request.sql],
            )
        except QueryCancelledError:
            return outcome("cancelled" if request.index in cancelled else "error")
        except QueryTimeoutError as exc:
            return outcome("timed out", detail=str(exc))
        except QueryError as exc:
            return outcome("error", detail=str(exc))
        return outcome("ok", digest=digest(result), rows=len(result))

    async def cancel_when_running(request: Request, request_id: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stage = await queue.get_query_stage([request.sql])
            if stage is not None and stage["stage"] == "Executing query":
                await asyncio.sleep(0.3)  # let it run a little: it is interrupted, not skipped
                break
            await asyncio.sleep(0.05)
        cancelled.add(request.index)
        await queue.cancel_query_by_request_id(request_id)

    async def user() -> None:
        while not todo.empty():
            request = todo.get_nowait()
            try:
                result = await ask(request)
            except Exception as exc:  # reported, never lost
                result = Outcome(
                    request.index, request.kind, request.sql, request.priority, 0.0, "error"
                )
                result.detail = f"{type(exc).__name__}: {exc}"
            outcomes.put(result)

    go.wait()
    try:
        await asyncio.gather(*(user() for _ in range(users)))
        if interactive and interactive_go is not None:
            await asyncio.to_thread(interactive_go.wait)  # every process's load is done
            # One user per process with a little think time between lookups, the
            # processes out of step: as people at screens, not a load generator.
            client = (interactive[0].index - 100_000) // INTERACTIVE_PER_CLIENT
            await asyncio.sleep(THINK_TIME * client / 4)
            for request in interactive:
                todo.put_nowait(request)
                await user()
                await asyncio.sleep(THINK_TIME)
    finally:
        await queue.shutdown(grace=0)
        await driver.close()


# -- the demo ---------------------------------------------------------------------------------


@dataclass
class Progress:
    total: int
    tty: bool = field(default_factory=lambda: sys.stderr.isatty())
    done: int = 0
    errors: int = 0
    started: float = field(default_factory=time.perf_counter)
    _shown: int = -1

    def update(self, outcome: Outcome, executions: int | None) -> None:
        self.done += 1
        self.errors += outcome.status == "error"
        width = 30
        filled = width * self.done // self.total
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} queries"
            f"{'' if executions is None else f', {executions} executions'}"
            f", {self.errors} errors, {time.perf_counter() - self.started:.1f} s"
        )
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif self.done * 10 // self.total != self._shown:
            self._shown = self.done * 10 // self.total
            print(line, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def run_demo(
    *,
    requests: int = 400,
    workers: int = 2,
    rows: int = 1_000_000,
    clients: int = 4,
    users: int = 8,
) -> int:
    if min(requests, workers, rows, clients, users) < 1:
        print("queryqueue demo: every size must be at least 1", file=sys.stderr)
        return 2
    # SIGTERM (a `timeout`, a CI runner) stops the demo the way Ctrl-C does, through the
    # `finally` that stops the supervisor, its workers and the request processes.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with tempfile.TemporaryDirectory(prefix="queryqueue-demo-") as tmp:
            return _run(Path(tmp), requests, workers, rows, clients, users)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(tmp: Path, requests: int, workers: int, rows: int, clients: int, users: int) -> int:
    began = time.perf_counter()
    warehouse = tmp / "warehouse.db"
    print(f"warehouse: generating {rows:,} sales rows ...", flush=True)
    make_warehouse(warehouse, rows)
    timeout = 3.0 + 2.0 * rows / 1_000_000  # the heaviest report stays well under it
    socket_path = tmp / "supervisor.sock"
    env = {
        **os.environ,
        "QUERYQUEUE_DEMO_TIMEOUT": str(timeout),
        "QUERYQUEUE_DEMO_CONCURRENCY": str(workers),
    }
    supervisor = launch(
        tmp / "queue.db",
        socket_path,
        "--app",
        "queryqueue.demo_app:app",
        "--workers",
        str(workers),
        "--cancel-grace",
        "2",
        env=env,
    )
    # The request processes reconcile with the same settings the workers execute with.
    settings = {"concurrency": workers, "execution_timeout": timeout}
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    try:
        print(
            f"supervisor pid {supervisor.pid} with {workers} workers on {tmp / 'queue.db'}; "
            f"{clients} request processes x {users} users submit {requests} queries",
            flush=True,
        )
        outcomes = context.Queue()
        go = context.Event()
        interactive_go = context.Event()
        phase = interactive_plan(clients)
        for share, lookups in zip(plan(requests, clients), phase, strict=True):
            process = context.Process(
                target=client_main,
                args=(
                    str(socket_path),
                    str(warehouse),
                    share,
                    users,
                    settings,
                    outcomes,
                    go,
                    lookups,
                    interactive_go,
                ),
                daemon=True,
            )
            process.start()
            processes.append(process)
        started = time.perf_counter()
        go.set()
        background = max(requests, 3)
        progress = Progress(background + sum(map(len, phase)))
        results: list[Outcome] = []
        while len(results) < progress.total:
            if len(results) >= background:
                interactive_go.set()
            try:
                outcome = outcomes.get(timeout=1.0)
            except stdlib_queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break  # a request process died: what it did not report is an error
                continue
            results.append(outcome)
            progress.update(outcome, None)
        elapsed = time.perf_counter() - started
        progress.finish()
        stats = asyncio.run(_stats(socket_path))
    except KeyboardInterrupt:
        for process in processes:  # interrupted: nothing of theirs is awaited any more
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
        supervisor.stop()
    print("checking every result against a direct execution ...", flush=True)
    expected = {
        sql: digest(_direct(warehouse, sql))
        for sql in {
            o.sql
            for o in results
            if o.kind in ("sql", "stream", "interactive") and o.status == "ok"
        }
    }
    report = summarize(results, expected, stats, elapsed, progress.total, clients, timeout)
    print(report.text)
    print(f"demo finished in {time.perf_counter() - began:.1f} s", flush=True)
    return 0 if report.passed else 1


def _direct(warehouse: Path, sql: str) -> list[list[Any]]:
    from queryqueue.demo_app import run_sql

    return run_sql(str(warehouse), sql)


async def _stats(socket_path: Path) -> dict[str, Any]:
    from queryqueue.driver_socket.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path, reconnect_timeout=2.0)
    try:
        return await driver.stats()
    finally:
        await driver.close()


@dataclass
class Report:
    text: str
    passed: bool


def summarize(
    results: list[Outcome],
    expected: dict[str, str],
    stats: dict[str, Any],
    elapsed: float,
    requests: int,
    clients: int,
    timeout: float,
) -> Report:
    from queryqueue.supervisor.tables import table

    submitted = len(results)
    missing = requests - submitted
    executions = int(stats["pool"]["handed_off"]) + sum(o.kind == "stream" for o in results)
    # A result without its reference is wrong too: nothing passes unchecked.
    wrong = [o for o in results if o.status == "ok" and o.digest != expected.get(o.sql)]
    errors = [o for o in results if o.status == "error"]
    cancelled = [o for o in results if o.kind == "cancel"]
    timed_out = [o for o in results if o.kind == "timeout"]
    streamed = [o for o in results if o.kind == "stream"]
    urgent = [o for o in results if o.kind == "sql" and o.priority >= 10]
    fast = sum(o.fast_tracked for o in urgent)
    saved = submitted - executions
    summary = [
        ["queries submitted", f"{submitted} from {clients} processes"],
        ["executions", f"{executions} (dedup saved {saved}, {_share(saved, submitted)})"],
        [
            "fast track",
            f"{fast} of {len(urgent)} priority-10 queries ({_share(fast, len(urgent))})",
        ],
        ["interactive phase", _interactive(results)],
        ["throughput", f"{submitted / elapsed:.1f} queries/s over {elapsed:.1f} s"],
        ["stream", ", ".join(f"{o.rows} rows, {_verdict(o, expected)}" for o in streamed)],
        ["cancelled", ", ".join(f"{o.status} after {o.seconds:.1f} s" for o in cancelled)],
        [
            "timed out",
            ", ".join(
                f"{o.status} after {o.seconds:.1f} s (limit {timeout:.0f} s)" for o in timed_out
            ),
        ],
        ["errors", str(len(errors) + missing)],
        ["wrong results", str(len(wrong))],
        ["supervisor", f"{stats['commands_total']} commands, mean batch {stats['mean_batch']}"],
    ]
    latency = []
    for priority in sorted({o.priority for o in results if o.kind == "sql"}):
        seconds = sorted(o.seconds for o in results if o.kind == "sql" and o.priority == priority)
        latency.append(
            [
                str(priority),
                str(len(seconds)),
                f"{_quantile(seconds, 0.5) * 1000:.0f}",
                f"{_quantile(seconds, 0.99) * 1000:.0f}",
                f"{seconds[-1] * 1000:.0f}",
            ]
        )
    lines = [
        table(["", "demo summary"], summary),
        "",
        table(["priority", "queries", "p50 ms", "p99 ms", "max ms"], latency),
    ]
    for o in (errors + wrong)[:5]:
        lines.append(f"  {o.status}: {o.sql[:60]}... {o.detail[:200]}")
    passed = (
        not errors
        and not wrong
        and missing == 0
        and all(o.status == "cancelled" for o in cancelled)
        and all(o.status == "timed out" for o in timed_out)
        and all(o.status == "ok" for o in streamed)
        and executions < submitted
    )
    lines.append("PASSED: every result correct" if passed else "FAILED")
    return Report("\n".join(lines), passed)


def _interactive(results: list[Outcome]) -> str:
    """The fast track's share of the idle-queue lookups, and its latency beside the
    queued path's."""
    phase = [o for o in results if o.kind == "interactive" and o.status == "ok"]
    fast = sorted(o.seconds for o in phase if o.priority >= 10 and o.fast_tracked)
    urgent = [o for o in phase if o.priority >= 10]
    queued = sorted(o.seconds for o in phase if o.priority < 10)
    if not urgent or not queued:
        return "not run"
    fast_p50 = f"{_quantile(fast, 0.5) * 1000:.1f} ms" if fast else "-"
    return (
        f"{len(fast)} of {len(urgent)} priority-10 lookups on the fast track"
        f" ({_share(len(fast), len(urgent))}), p50 {fast_p50};"
        f" priority 0, queued: p50 {_quantile(queued, 0.5) * 1000:.1f} ms"
    )


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _verdict(outcome: Outcome, expected: dict[str, str]) -> str:
    if outcome.status != "ok":
        return outcome.status
    return "correct" if expected.get(outcome.sql) == outcome.digest else "WRONG"


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(run_demo())
