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
import multiprocessing
import os
import queue as stdlib_queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from queryqueue.demo_client import client_main
from queryqueue.demo_plan import (
    BACKGROUND,
    Outcome,
    digest,
    interactive_plan,
    make_warehouse,
    plan,
)
from queryqueue.demo_report import summarize
from queryqueue.supervisor.launch import SupervisorProcess, launch

__all__ = ["BACKGROUND", "Outcome", "digest", "plan", "run_demo", "summarize"]


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
    # The request processes reconcile with the same settings the workers execute with.
    settings = {"concurrency": workers, "execution_timeout": timeout}
    clients_of = _Clients(tmp / "supervisor.sock", warehouse, settings)
    supervisor = _supervisor(clients_of.socket_path, workers, timeout)
    try:  # from here on, whatever happens (SIGTERM too) stops what was started
        print(
            f"supervisor pid {supervisor.pid} with {workers} workers on {tmp / 'queue.db'}; "
            f"{clients} request processes x {users} users submit {requests} queries",
            flush=True,
        )
        clients_of.start(plan(requests, clients), interactive_plan(clients), users)
        results, elapsed, total = clients_of.collect(background=max(requests, 3))
        stats = asyncio.run(_stats(clients_of.socket_path))
    except KeyboardInterrupt:
        clients_of.kill()  # interrupted: nothing of theirs is awaited any more
        raise
    finally:
        clients_of.stop()
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
    report = summarize(results, expected, stats, elapsed, total, clients, timeout)
    print(report.text)
    print(f"demo finished in {time.perf_counter() - began:.1f} s", flush=True)
    return 0 if report.passed else 1


def _supervisor(socket_path: Path, workers: int, timeout: float) -> SupervisorProcess:
    env = {
        **os.environ,
        "QUERYQUEUE_DEMO_TIMEOUT": str(timeout),
        "QUERYQUEUE_DEMO_CONCURRENCY": str(workers),
    }
    return launch(
        socket_path.parent / "queue.db",
        socket_path,
        "--app",
        "queryqueue.demo_app:app",
        "--workers",
        str(workers),
        "--cancel-grace",
        "2",
        env=env,
    )


class _Clients:
    """The request processes: started with their shares, their outcomes collected as
    they come, stopped (by pid) at the end."""

    def __init__(self, socket_path: Path, warehouse: Path, settings: dict[str, Any]) -> None:
        self.socket_path, self.warehouse, self.settings = socket_path, warehouse, settings
        self.context = multiprocessing.get_context("spawn")
        self.outcomes = self.context.Queue()
        self.go, self.interactive_go = self.context.Event(), self.context.Event()
        self.processes: list[Any] = []
        self.interactive = 0

    def start(self, shares: list[list[Any]], lookups: list[list[Any]], users: int) -> None:
        self.interactive = sum(map(len, lookups))
        for share, mine in zip(shares, lookups, strict=True):
            process = self.context.Process(
                target=client_main,
                args=(
                    str(self.socket_path), str(self.warehouse), share, users, self.settings,
                    self.outcomes, self.go, mine, self.interactive_go,
                ),
                daemon=True,
            )  # fmt: skip
            process.start()
            self.processes.append(process)

    def collect(self, background: int) -> tuple[list[Outcome], float, int]:
        """Every outcome (the interactive phase once the background load is in), how
        long they took, and how many were asked."""
        started = time.perf_counter()
        self.go.set()
        progress = Progress(background + self.interactive)
        results: list[Outcome] = []
        while len(results) < progress.total:
            if len(results) >= background:
                self.interactive_go.set()
            try:
                outcome = self.outcomes.get(timeout=1.0)
            except stdlib_queue.Empty:
                if not any(p.is_alive() for p in self.processes):
                    break  # a request process died: what it did not report is an error
                continue
            results.append(outcome)
            progress.update(outcome, None)
        progress.finish()
        return results, time.perf_counter() - started, progress.total

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def stop(self) -> None:
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)


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


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(run_demo())
