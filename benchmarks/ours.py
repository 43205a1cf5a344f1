"""The workloads on queryqueue: a real supervisor with its worker pool, and request
processes that submit through `QueueApp.pool_queue`, exactly as an application would."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.measure import TreeMeter, quantiles, spread
from queryqueue.supervisor import loops
from queryqueue.supervisor.launch import SupervisorProcess, launch

APP = "benchmarks.bench_app:app"
# The checkout: supervisors start here, where `--app benchmarks...` resolves.
REPO = Path(__file__).resolve().parents[1]
POSTGRES_URL = os.environ.get(
    "QUERYQUEUE_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
MiB = 1024 * 1024


@dataclass(frozen=True)
class Job:
    handler: str
    key: Any
    query: Any
    priority: int = 0
    view: bool = False  # read the result in place (a ResultView), released once checked


# -- request processes ------------------------------------------------------------------------


def _producer(
    index: int,
    socket_path: str,
    jobs: list[Job],
    in_flight: int,
    spacing: float,
    ready: Any,
    go: Any,
    leave: Any,
    out: Any,
    app_name: str = "app",
) -> None:
    # On the loop the supervisor and its workers run on: uvloop where installed, as an
    # ASGI server (uvicorn) picks it for a request process too.
    loops.run(
        _produce(index, socket_path, jobs, in_flight, spacing, ready, go, leave, out, app_name)
    )


async def _produce(
    index: int,
    socket_path: str,
    jobs: list[Job],
    in_flight: int,
    spacing: float,
    ready: Any,
    go: Any,
    leave: Any,
    out: Any,
    app_name: str,
) -> None:
    from benchmarks import bench_app
    from queryqueue.driver_socket.client import SocketQueueDriver
    from queryqueue.engine.errors import ContinueWaitError

    driver = SocketQueueDriver(socket_path, decode_in_place=True)  # as QueueApp's own
    queue = getattr(bench_app, app_name).pool_queue(driver)
    await driver.call("ping")  # connected before the clock starts
    ready.put(1)
    await asyncio.to_thread(go.wait)
    slots = asyncio.Semaphore(in_flight)
    records: list[tuple[float, float, bool]] = []

    async def one(job: Job) -> None:
        async with slots:
            started = time.time()
            ok = True
            while True:
                try:
                    if job.view:
                        view = await queue.run(job.handler, job.key, job.query, view=True)
                        ended = time.time()
                        ok = _intact(view.value, job)
                        await view.release()
                    else:
                        value = await queue.execute_in_queue(
                            job.handler, job.key, job.query, job.priority
                        )
                        ended = time.time()
                        ok = _intact(value, job)
                        del value
                    break
                except ContinueWaitError:
                    continue
                except Exception:
                    ok, ended = False, time.time()
                    break
            records.append((started, ended, ok))

    tasks = []
    for job in jobs:
        tasks.append(asyncio.ensure_future(one(job)))
        await asyncio.sleep(spacing)
    await asyncio.gather(*tasks)
    out.put((index, records))
    await asyncio.to_thread(leave.wait)  # stay alive until the meter has read our CPU time
    await queue.shutdown(grace=0)
    await driver.close()


def _intact(value: Any, job: Job) -> bool:
    """A large result reached the caller whole, every row of it (checked after the clock
    stopped: the same value made here, compared)."""
    if not (isinstance(job.query, dict) and job.query.get("check")):
        return True
    from benchmarks.bench_app import make

    expected = make(job.handler, int(job.query["size"]))
    if hasattr(expected, "equals"):
        return bool(expected.equals(value))
    return bool(bytes(value) == expected if isinstance(value, memoryview) else value == expected)


@dataclass
class Run:
    by_share: list[list[tuple[float, float, bool]]]
    cpu_s: float
    peak_rss: int
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    # CPU seconds by role: the supervisors, their workers, and the rest of the tree (the
    # request processes, this process and its meter).
    cpu_by_role: dict[str, float] | None = None

    @property
    def records(self) -> list[tuple[float, float, bool]]:
        return [r for share in self.by_share for r in share]

    @property
    def wall(self) -> float:
        return max(r[1] for r in self.records) - min(r[0] for r in self.records)

    @property
    def latencies(self) -> list[float]:
        return [r[1] - r[0] for r in self.records]

    @property
    def errors(self) -> int:
        return sum(not r[2] for r in self.records)

    @property
    def executions(self) -> int:
        return int(self.stats_after["pool"]["handed_off"] - self.stats_before["pool"]["handed_off"])

    @property
    def commands(self) -> int:
        return int(self.stats_after["commands_total"] - self.stats_before["commands_total"])

    @property
    def batches(self) -> int:
        return int(self.stats_after["batches"] - self.stats_before["batches"])


def stats(socket_path: Path) -> dict[str, Any]:
    from queryqueue.driver_socket.client import SocketQueueDriver

    async def ask() -> dict[str, Any]:
        driver = SocketQueueDriver(socket_path)
        try:
            return await driver.stats()
        finally:
            await driver.close()

    return asyncio.run(ask())


def drive(
    supervisor: SupervisorProcess | list[SupervisorProcess],
    shares: list[list[Job]],
    *,
    in_flight: int,
    spacing: list[float] | None = None,
    start_offsets: list[float] | None = None,
    app_name: str = "app",
) -> Run:
    """Run one list of jobs per request process, all starting together; measured from the
    moment they are told to go to the moment the last result arrived. With several
    supervisors (hosts sharing a PostgreSQL queue), request process i talks to the i-th."""
    hosts = supervisor if isinstance(supervisor, list) else [supervisor]
    context = multiprocessing.get_context("spawn")
    ready, out = context.Queue(), context.Queue()
    leave = context.Event()
    gos = [context.Event() for _ in shares]
    processes = [
        context.Process(
            target=_producer,
            args=(
                i,
                str(hosts[i % len(hosts)].socket_path),
                jobs,
                in_flight,
                (spacing or [0.0] * len(shares))[i],
                ready,
                gos[i],
                leave,
                out,
                app_name,
            ),
            daemon=True,
        )
        for i, jobs in enumerate(shares)
    ]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            ready.get(timeout=60)
        before = _summed([stats(h.socket_path) for h in hosts])
        by_share: list[list[tuple[float, float, bool]]] = [[] for _ in shares]
        with TreeMeter() as meter:
            roles_before = _cpu_by_role(hosts)
            began = time.monotonic()
            offsets = start_offsets or [0.0] * len(shares)
            for go, offset in sorted(zip(gos, offsets, strict=True), key=lambda g: g[1]):
                time.sleep(max(0.0, began + offset - time.monotonic()))
                go.set()
            for _ in processes:
                index, records = out.get(timeout=3600)
                by_share[index] = records
            roles_after = _cpu_by_role(hosts)
            after = _summed([stats(h.socket_path) for h in hosts])
        leave.set()
    finally:
        leave.set()
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)
    supervisors = _used(roles_before[0], roles_after[0])
    workers = _used(roles_before[1], roles_after[1])
    by_role = {
        "supervisor": supervisors,
        "workers": workers,
        "callers": max(0.0, meter.cpu_s - supervisors - workers),
    }
    return Run(by_share, meter.cpu_s, meter.peak_rss, before, after, by_role)


def _cpu_by_role(hosts: list[SupervisorProcess]) -> tuple[dict[int, float], dict[int, float]]:
    """CPU seconds so far of each supervisor and of each of their workers, by pid."""
    supervisors: dict[int, float] = {}
    workers: dict[int, float] = {}
    for host in hosts:
        try:
            process = psutil.Process(host.pid)
            supervisors[host.pid] = _own_cpu(process)
            children = process.children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            with contextlib.suppress(psutil.Error):
                workers[child.pid] = _own_cpu(child)
    return supervisors, workers


def _own_cpu(process: psutil.Process) -> float:
    # Not children_*: a worker reaped during the run would count twice.
    times = process.cpu_times()
    return float(times.user + times.system)


def _used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used between the two readings (a process started meanwhile: all of its)."""
    return sum(spent - before.get(pid, 0.0) for pid, spent in after.items())


def _summed(many: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters drive() reads, added up over hosts."""
    return {
        "pool": {"handed_off": sum(m["pool"]["handed_off"] for m in many)},
        "commands_total": sum(m["commands_total"] for m in many),
        "batches": sum(m["batches"] for m in many),
    }


def postgres_unavailable() -> str | None:
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3):
            return None
    except psycopg.Error as exc:
        return f"no PostgreSQL at {POSTGRES_URL}: {str(exc).strip().splitlines()[0]}"


@contextmanager
def postgres_hosts(
    count: int, *options: str, app: str = "app"
) -> Iterator[list[SupervisorProcess]]:
    """`count` supervisors, each with 2 workers of `app` (bench_app's), sharing a fresh
    PostgreSQL schema."""
    import psycopg
    from psycopg import sql

    schema = f"qq_bench_{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
        hosts: list[SupervisorProcess] = []
        try:
            for i in range(count):
                hosts.append(
                    launch(
                        Path(tmp) / f"host{i}.db",
                        Path(tmp) / f"host{i}.sock",
                        "--schema",
                        schema,
                        "--app",
                        f"benchmarks.bench_app:{app}",
                        "--workers",
                        "2",
                        *options,
                        store=POSTGRES_URL,
                        cwd=REPO,
                    )
                )
            warm = [[Job("noop", ["warm", i], {}) for i in range(200)]]
            drive(hosts, warm, in_flight=16, app_name=app)
            yield hosts
        finally:
            for host in hosts:
                host.stop()
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )


@contextmanager
def supervisor_for(*options: str, warm: bool = True) -> Iterator[SupervisorProcess]:
    """A fresh store and pool (2 workers) per use, warmed up, stopped by pid afterwards."""
    with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
        supervisor = launch(
            Path(tmp) / "queue.db",
            Path(tmp) / "s.sock",
            "--app",
            APP,
            "--workers",
            "2",
            *options,
            cwd=REPO,
        )
        try:
            if warm:
                drive(
                    supervisor, [[Job("noop", ["warm", i], {}) for i in range(200)]], in_flight=16
                )
            yield supervisor
        finally:
            supervisor.stop()


def _noop_shares(n: int, processes: int, tag: str) -> list[list[Job]]:
    return [[Job("noop", [tag, p, i], {}) for i in range(n // processes)] for p in range(processes)]


# -- workloads -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One way to run queryqueue: what the rows call it, and how its hosts are started."""

    system: str
    hosts: Callable[[], AbstractContextManager[list[SupervisorProcess]]]
    settings: str


def sqlite_setup(synchronous: str = "NORMAL") -> Setup:
    return Setup(
        f"queryqueue (SQLite {synchronous})",
        lambda: _one_host(supervisor_for("--synchronous", synchronous)),
        f"2 workers, SQLite synchronous={synchronous}",
    )


def postgres_setup(count: int) -> Setup:
    return Setup(
        f"queryqueue (PostgreSQL, {count} supervisor{'s' if count > 1 else ''})",
        lambda: postgres_hosts(count),
        f"{count} supervisor(s) x 2 workers on one local PostgreSQL "
        "(READ COMMITTED, an advisory lock per prefix)",
    )


@contextmanager
def _one_host(
    supervisor: AbstractContextManager[SupervisorProcess],
) -> Iterator[list[SupervisorProcess]]:
    with supervisor as host:
        yield [host]


def _postgres_or_skip(
    workload: str, make: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    reason = postgres_unavailable()
    if reason is not None:
        return [{"workload": workload, "system": "queryqueue (PostgreSQL)", "skipped": reason}]
    return make()


def throughput(
    n: int,
    reps: int,
    setups: list[Setup] | None = None,
    producers: int = 4,
    in_flight: int = 64,
) -> list[dict[str, Any]]:
    rows = []
    for setup in setups or [sqlite_setup("NORMAL"), sqlite_setup("FULL")]:
        runs = []
        for rep in range(reps):
            with setup.hosts() as hosts:
                runs.append(
                    drive(hosts, _noop_shares(n, producers, f"t{rep}"), in_flight=in_flight)
                )
        rows.append(
            _row(
                "throughput",
                setup.system,
                runs,
                n,
                settings=f"{setup.settings}, {producers} request processes x {in_flight} "
                "in flight, concurrency 2",
                metric=("queries/s", [len(r.records) / r.wall for r in runs]),
            )
        )
    return rows


def postgres_throughput(n: int, reps: int) -> list[dict[str, Any]]:
    return _postgres_or_skip(
        "throughput", lambda: throughput(n, reps, [postgres_setup(1), postgres_setup(2)])
    )


IDLE_PATHS = ((10, "fast track (priority 10)"), (0, "queued (priority 0)"))


def idle_latency(n: int, reps: int, setup: Setup | None = None) -> list[dict[str, Any]]:
    """One caller, sequential: `n` queries at priority 10 (the fast track) and `n` at 0,
    alternating query by query in the same run of the same supervisor. Which path is
    faster is a difference of a few per cent; two supervisors started one after the other
    differ by more (their stores, where the scheduler puts them), so the paths are
    measured side by side, not in runs of their own."""
    setup = setup or sqlite_setup()
    runs = []
    for rep in range(reps):
        with setup.hosts() as hosts:
            jobs = [
                Job("noop", ["lat", rep, i], {}, IDLE_PATHS[i % len(IDLE_PATHS)][0])
                for i in range(n * len(IDLE_PATHS))
            ]
            runs.append(drive(hosts, [jobs], in_flight=1))
    rows = []
    for index, (_, label) in enumerate(IDLE_PATHS):
        of_path = functools.partial(_latencies_of_path, index)
        rows.append(
            _row(
                "idle_latency",
                f"{setup.system}, {label}",
                runs,
                n,
                settings=f"one caller, sequential, priorities 10 and 0 alternating in the "
                f"same runs (CPU, commands and batches: both together), {setup.settings}",
                metric=("p50 ms", [quantiles(of_path(r))["p50_ms"] for r in runs]),
                latency_of=of_path,
            )
        )
    return rows


def _latencies_of_path(index: int, run: Run) -> list[float]:
    """The latencies of the queries of IDLE_PATHS[index] in a run of them alternating (one
    in flight: a run's records come in its jobs' order)."""
    return [end - start for start, end, _ in run.records[index :: len(IDLE_PATHS)]]


def postgres_idle_latency(n: int, reps: int) -> list[dict[str, Any]]:
    return _postgres_or_skip("idle_latency", lambda: idle_latency(n, reps, postgres_setup(1)))


def dedup_storm(n: int, reps: int, processes: int = 8) -> list[dict[str, Any]]:
    runs = []
    for rep in range(reps):
        with supervisor_for() as supervisor:
            shares = [
                [Job("sleep", ["storm", rep], {"seconds": 0.2}) for _ in range(n // processes)]
                for _ in range(processes)
            ]
            runs.append(drive(supervisor, shares, in_flight=n))
    row = _row(
        "dedup_storm",
        "queryqueue",
        runs,
        n,
        settings=f"{n} identical requests from {processes} processes at once, a 200 ms query",
        metric=("executions", [float(r.executions) for r in runs]),
        latency=True,
    )
    return [row]


def priority_burst(backlog: int, urgent: int, reps: int) -> list[dict[str, Any]]:
    """A backlog of 20 ms priority-0 queries, then `urgent` arrivals 50 ms apart: their wait,
    at priority 10 and (control) at priority 0."""
    rows = []
    for priority in (10, 0):
        runs = []
        for rep in range(reps):
            with supervisor_for() as supervisor:
                background = [
                    Job("sleep", ["bg", rep, priority, i], {"seconds": 0.02})
                    for i in range(backlog)
                ]
                arrivals = [
                    Job("noop", ["urgent", rep, priority, i], {}, priority) for i in range(urgent)
                ]
                run = drive(
                    supervisor,
                    [background, arrivals],
                    in_flight=backlog,
                    spacing=[0.0, 0.05],
                    start_offsets=[0.0, 0.5],
                )
                runs.append(run)
        rows.append(
            _row(
                "priority_burst",
                f"queryqueue, arrivals at priority {priority}"
                + (" (control)" if priority == 0 else ""),
                runs,
                urgent,
                settings=f"{backlog} x 20 ms priority-0 backlog on 2 workers (concurrency 2), "
                f"then {urgent} arrivals 50 ms apart",
                metric=("p50 wait ms", [quantiles(_waits(r))["p50_ms"] for r in runs]),
                latency_of=_waits,
            )
        )
    return rows


def _waits(run: Run) -> list[float]:
    """The arrivals' waits (the second request process), not the backlog's."""
    return [end - start for start, end, _ in run.by_share[1]]


# (label, handler, read in place) of each form the large-results workload moves.
RESULT_FORMS = [
    ("JSON text", "blob", False),
    ("JSON rows (1 KiB each)", "rows", False),
    ("bytes", "bytes", False),
    ("bytes, zero-copy view", "bytes", True),
    ("Arrow table", "arrow", False),
    ("Arrow table, zero-copy view", "arrow", True),
]


def large_results(sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for label, options, forms in (
        ("queryqueue (shared memory)", (), RESULT_FORMS),
        ("queryqueue (through the socket)", ("--shm-threshold", "0"), RESULT_FORMS[:1]),
    ):
        with supervisor_for(*options) as supervisor:
            for form, handler, view in forms:
                for size in sizes_mib:
                    rows.append(
                        _large_result(supervisor, f"{label}, {form}", handler, view, size, reps)
                    )
    return rows


def _large_result(
    supervisor: SupervisorProcess, label: str, handler: str, view: bool, size: int, reps: int
) -> dict[str, Any]:
    """One long-lived caller asks `reps` + 1 times in a row (the first warms: the worker
    makes the value once, the segment pool and the caller's mappings have a fitting
    segment); the first is not counted."""
    query = {"size": size * MiB, "check": True}
    jobs = [Job(handler, [handler, view, size, rep], query, view=view) for rep in range(reps + 1)]
    run = drive(supervisor, [jobs], in_flight=1)
    if run.errors:
        raise RuntimeError(f"large_results {label} {size} MiB: {run.errors} results not intact")
    ordered = sorted(run.records)
    return _row(
        "large_results",
        f"{label}, {size} MiB",
        [run],
        1,
        settings=f"one caller, {reps} results in a row after a warm one; time from enqueue "
        "to the decoded result (each checked whole against the same value, after the clock "
        "stops)",
        metric=("GB/s", [size * MiB / (end - start) / 1e9 for start, end, _ in ordered[1:]]),
    )


def soak(n: int, producers: int = 4, in_flight: int = 64) -> list[dict[str, Any]]:
    with supervisor_for() as supervisor:
        pid = supervisor.pid
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            process = psutil.Process(pid)
            while not stop.wait(0.5):
                samples.append((time.monotonic(), int(process.memory_info().rss)))

        sampler = threading.Thread(target=sample, daemon=True)
        begin_rss = int(psutil.Process(pid).memory_info().rss)
        sampler.start()
        try:
            run = drive(supervisor, _noop_shares(n, producers, "soak"), in_flight=in_flight)
        finally:
            stop.set()
            sampler.join()
        db = supervisor.db
        wal = db.with_name(db.name + "-wal")
        sizes = {
            "db_mb": round(db.stat().st_size / MiB, 2),
            "wal_mb": round(wal.stat().st_size / MiB, 2) if wal.exists() else 0.0,
        }
    middle = samples[len(samples) // 2][1] if samples else begin_rss
    end = samples[-1][1] if samples else begin_rss
    row = _row(
        "soak",
        "queryqueue (SQLite NORMAL)",
        [run],
        n,
        settings=f"2 workers, {producers} request processes x {in_flight} in flight",
        metric=("queries/s", [len(run.records) / run.wall]),
    )
    row.update(
        {
            "supervisor_rss_mb": {
                "start": round(begin_rss / MiB, 1),
                "middle": round(middle / MiB, 1),
                "end": round(end / MiB, 1),
            },
            **sizes,
        }
    )
    return [row]


def _cpu_ms_per_query(runs: list[Run]) -> dict[str, Any]:
    """The median CPU milliseconds a query of each role, when the runs measured them."""
    measured = [(r.cpu_by_role, len(r.records)) for r in runs]
    if any(by_role is None or not queries for by_role, queries in measured):
        return {}
    return {
        "cpu_ms_per_query": {
            role: round(spread([b[role] / q * 1000 for b, q in measured if b])["median"], 3)
            for role in ("supervisor", "workers", "callers")
        }
    }


def _row(
    workload: str,
    system: str,
    runs: list[Run],
    n: int,
    *,
    settings: str,
    metric: tuple[str, list[float]],
    latency: bool = False,
    latency_of: Callable[[Run], list[float]] | None = None,
) -> dict[str, Any]:
    name, values = metric
    queries = sum(len(r.records) for r in runs) / len(runs)
    row: dict[str, Any] = {
        "workload": workload,
        "system": system,
        "n": n,
        "repetitions": len(runs),
        "metric": name,
        **spread(values),
        "cpu_s_per_1000": spread([r.cpu_s / max(1, len(r.records)) * 1000 for r in runs]),
        "peak_rss_mb": round(max(r.peak_rss for r in runs) / MiB, 1),
        "errors": sum(r.errors for r in runs),
        "executions": spread([float(r.executions) for r in runs])["median"],
        **_cpu_ms_per_query(runs),
        "commands_per_query": round(
            sum(r.commands for r in runs) / max(1.0, queries * len(runs)), 2
        ),
        # Transactions a query, what group commit and the lane's linger save.
        "batches_per_query": round(sum(r.batches for r in runs) / max(1.0, queries * len(runs)), 2),
        "settings": settings,
    }
    if latency or latency_of is not None:
        per_run = [quantiles(latency_of(r) if latency_of else r.latencies) for r in runs]
        row["latency_ms"] = {k: spread([q[k] for q in per_run])["median"] for k in per_run[0]}
    return row
