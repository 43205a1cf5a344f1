"""How a workload drives queryqueue: a real supervisor with its worker pool (on SQLite, or
several on PostgreSQL), and request processes that submit through `QueueApp.pool_queue`,
exactly as an application would, measured from go to the last result."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.measure import TreeMeter
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
    def rate(self) -> float:
        """Queries answered a second."""
        return len(self.records) / self.wall

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
    processes, (ready, gos, leave, out) = _producers(hosts, shares, in_flight, spacing, app_name)
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
        join_or_kill(processes)
    supervisors = _used(roles_before[0], roles_after[0])
    workers = _used(roles_before[1], roles_after[1])
    by_role = {
        "supervisor": supervisors,
        "workers": workers,
        "callers": max(0.0, meter.cpu_s - supervisors - workers),
    }
    return Run(by_share, meter.cpu_s, meter.peak_rss, before, after, by_role)


def _producers(
    hosts: list[SupervisorProcess],
    shares: list[list[Job]],
    in_flight: int,
    spacing: list[float] | None,
    app_name: str,
) -> tuple[list[Any], tuple[Any, list[Any], Any, Any]]:
    """One request process a share (not started), and what they are driven with: the
    queue each says it is ready on, the event each waits to go, the event to leave, the
    queue of their records."""
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
    return processes, (ready, gos, leave, out)


def join_or_kill(processes: list[Any]) -> None:
    """Each process joined, or killed when it does not end within 30 s."""
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join(10)


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


def noop_shares(n: int, processes: int, tag: str) -> list[list[Job]]:
    return [[Job("noop", [tag, p, i], {}) for i in range(n // processes)] for p in range(processes)]


@dataclass(frozen=True)
class Setup:
    """One way to run queryqueue: what the rows call it, and how its hosts are started."""

    system: str
    hosts: Callable[[], AbstractContextManager[list[SupervisorProcess]]]
    settings: str
    app: str = "app"  # bench_app's queue the callers ask


def sqlite_setup(synchronous: str = "NORMAL") -> Setup:
    return Setup(
        f"queryqueue (SQLite {synchronous})",
        lambda: _one_host(supervisor_for("--synchronous", synchronous)),
        f"2 workers, SQLite synchronous={synchronous}, concurrency 2",
    )


def postgres_setup(count: int, worker_concurrency: int = 1) -> Setup:
    """`count` supervisors of 2 workers; with `worker_concurrency`, each worker runs that
    many queries at once, on the wide queue (a budget of 20) instead of the budget of 2."""
    if worker_concurrency == 1:
        return Setup(
            f"queryqueue (PostgreSQL, {count} supervisor{'s' if count > 1 else ''})",
            lambda: postgres_hosts(count),
            f"{count} supervisor(s) x 2 workers on one local PostgreSQL "
            "(READ COMMITTED, an advisory lock per prefix), concurrency 2",
        )
    options = ("--worker-concurrency", str(worker_concurrency))
    return Setup(
        f"queryqueue (PostgreSQL, {count} supervisor, 2 workers x {worker_concurrency})",
        lambda: postgres_hosts(count, *options, app="wide"),
        f"{count} supervisor(s) x 2 workers running {worker_concurrency} queries each on one "
        f"local PostgreSQL, concurrency {2 * worker_concurrency}, budget 20",
        app="wide",
    )


@contextmanager
def _one_host(
    supervisor: AbstractContextManager[SupervisorProcess],
) -> Iterator[list[SupervisorProcess]]:
    with supervisor as host:
        yield [host]


def postgres_or_skip(
    workload: str, make: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    reason = postgres_unavailable()
    if reason is not None:
        return [{"workload": workload, "system": "queryqueue (PostgreSQL)", "skipped": reason}]
    return make()
