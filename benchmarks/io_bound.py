"""The io_bound workload: queries that wait on I/O, not the CPU, at a budget of 64.

Each of `n` distinct queries waits `seconds` (asyncio.sleep in the async form, time.sleep
in the sync form), all sent at once from 4 request processes. The ideal schedule runs 64 at
a time back to back: `n / ceil(n / 64) / seconds` queries a second, and a p99 time to
result of the 99th percentile of those completion times. Rows:

- queryqueue with 2 workers x 32 (async and sync handlers), and 64 workers x 1 (async) for
  the memory a process per query costs;
- the peers at the same concurrency, each in its own environment (peers.py): saq and arq
  (async handlers, Redis), Celery (threads pool, Redis) and Dramatiq (threads, Redis);
- the async handler of examples/postgres_app.py on a real PostgreSQL, `SELECT
  pg_sleep(0.05)` at its budget of 32 (2 workers x 16).

Memory is the peak RSS of what serves the queries: our supervisor and its workers; a
peer's workers and the Redis server.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks.drive import POSTGRES_URL, REPO, Job, drive, postgres_unavailable
from benchmarks.measure import TreeMeter, quantiles, spread
from queryqueue.supervisor.launch import SupervisorProcess, launch

APP = "benchmarks.bench_app:io"
BUDGET = 64
PRODUCERS = 4
MiB = 1024 * 1024

# (workers, queries each at once, handler form)
SHAPES = [(2, 32, "async"), (2, 32, "sync"), (64, 1, "async")]


def ideal(n: int, seconds: float, budget: int = BUDGET) -> dict[str, float]:
    """Throughput and time-to-result quantiles of `n` queries run `budget` at a time."""
    finished = [(i // budget + 1) * seconds for i in range(n)]
    rate = n / (math.ceil(n / budget) * seconds)
    return {"queries_per_s": round(rate, 1), **quantiles(finished)}


@contextlib.contextmanager
def _supervisor(workers: int, each: int) -> Iterator[SupervisorProcess]:
    with tempfile.TemporaryDirectory(prefix="qq-io-", dir="/tmp") as tmp:
        options = ("--workers", str(workers), "--worker-concurrency", str(each))
        supervisor = launch(
            Path(tmp) / "queue.db", Path(tmp) / "s.sock", "--app", APP, *options, cwd=REPO
        )
        try:
            yield supervisor
        finally:
            supervisor.stop()


def _shares(n: int, handler: str, seconds: float, tag: str) -> list[list[Job]]:
    per = n // PRODUCERS
    return [
        [Job(handler, [tag, p, i], {"seconds": seconds}) for i in range(per)]
        for p in range(PRODUCERS)
    ]


def ours(n: int, reps: int, seconds: float = 0.1) -> list[dict[str, Any]]:
    rows = []
    best = ideal(n, seconds)
    for workers, each, form in SHAPES:
        handler = f"sleep_{form}"
        rates, latencies, rss, errors = [], [], [], 0
        for rep in range(reps):
            with _supervisor(workers, each) as supervisor:
                warm = _shares(BUDGET * 2, handler, 0.0, f"warm{rep}")
                drive(supervisor, warm, in_flight=BUDGET, app_name="io")
                with TreeMeter(roots=[supervisor.pid]) as meter:
                    run = drive(
                        supervisor, _shares(n, handler, seconds, f"r{rep}"), in_flight=n,
                        app_name="io",
                    )  # fmt: skip
            rates.append(run.rate)
            latencies.append(run.latencies)
            rss.append(meter.peak_rss / MiB)
            errors += run.errors
        rows.append(
            summary_row(
                f"queryqueue ({workers} workers x {each}, {form} handler)",
                n, rates, latencies, rss, best,
                settings=f"--workers {workers} --worker-concurrency {each}, budget {BUDGET},"
                f" {PRODUCERS} request processes; RSS: supervisor and workers",
                errors=errors,
            )
        )  # fmt: skip
    return rows


def postgres_example(n: int, reps: int, seconds: float = 0.05) -> list[dict[str, Any]]:
    """The example's async handler on psycopg's pool against PostgreSQL, at budget 32."""
    reason = postgres_unavailable()
    system = "queryqueue (examples/postgres_app.py: psycopg async pool, PostgreSQL)"
    if reason is not None:
        return [{"workload": "io_bound", "system": system, "skipped": reason}]
    budget, rates, latencies, rss, errors = 32, [], [], [], 0
    query = {"sql": "SELECT pg_sleep(%s), 1", "params": [seconds]}
    os.environ["PG_DSN"] = POSTGRES_URL  # the example's workers read it
    for rep in range(reps):
        with tempfile.TemporaryDirectory(prefix="qq-io-", dir="/tmp") as tmp:
            supervisor = launch(
                Path(tmp) / "queue.db", Path(tmp) / "s.sock", "--app", "postgres_app:app",
                cwd=REPO / "examples",
            )  # fmt: skip
            try:
                warm = [[Job("sql", ["warm", rep, i], query) for i in range(budget)]]
                drive(supervisor, warm, in_flight=budget, app_name="pg_example")
                shares = [
                    [Job("sql", [rep, p, i], query) for i in range(n // PRODUCERS)]
                    for p in range(PRODUCERS)
                ]
                with TreeMeter(roots=[supervisor.pid]) as meter:
                    run = drive(supervisor, shares, in_flight=n, app_name="pg_example")
            finally:
                supervisor.stop()
        rates.append(run.rate)
        latencies.append(run.latencies)
        rss.append(meter.peak_rss / MiB)
        errors += run.errors
    return [
        summary_row(
            system, n, rates, latencies, rss, ideal(n, seconds, budget),
            settings=f"2 workers x 16 (the example's app), budget {budget}, SELECT"
            f" pg_sleep({seconds}) on local PostgreSQL; RSS: supervisor and workers",
            errors=errors,
        )
    ]  # fmt: skip


def peer_rows(n: int, reps: int, seconds: float = 0.1) -> list[dict[str, Any]]:
    """The peers at the same concurrency (2 worker processes x 32), or why not."""
    rows = []
    best = ideal(n, seconds)
    ready, skipped = peers.available(peers.IO_PEERS)
    for skip in skipped:
        rows.append({"workload": "io_bound", **skip})
    for peer, python in ready:
        spec = {"peer": peer.name, "workload": "io_bound", "n": n, "seconds": seconds}
        try:
            answer = peers.run(python, {**spec, "reps": reps, "producers": PRODUCERS})
        except RuntimeError as exc:
            rows.append(
                {"workload": "io_bound", "system": peers.LABELS[peer.name], "failed": str(exc)}
            )
            continue
        runs = answer["runs"]
        records = [[r for share in run["by_share"] for r in share] for run in runs]
        rates = [len(rs) / (max(r[1] for r in rs) - min(r[0] for r in rs)) for rs in records]
        rows.append(
            summary_row(
                peers.LABELS[peer.name], n, rates,
                [[r[1] - r[0] for r in rs] for rs in records],
                [run["peak_rss"] / MiB for run in runs], best,
                settings="; ".join(f"{k}: {v}" for k, v in answer["settings"].items())
                + "; RSS: workers and redis-server",
            )
        )  # fmt: skip
    return rows


def summary_row(
    system: str,
    n: int,
    rates: list[float],
    latencies: list[list[float]],
    rss: list[float],
    best: dict[str, float],
    settings: str,
    errors: int = 0,
) -> dict[str, Any]:
    per_run = [quantiles(lat) for lat in latencies]
    latency = {k: spread([q[k] for q in per_run])["median"] for k in per_run[0]}
    row: dict[str, Any] = {
        "workload": "io_bound",
        "system": system,
        "n": n,
        "repetitions": len(rates),
        "metric": "queries/s",
        **spread(rates),
        "latency_ms": latency,
        "peak_rss_mb": round(max(rss), 1),
        "ideal": best,
        "of_ideal": round(spread(rates)["median"] / best["queries_per_s"], 3),
        "p99_of_ideal": round(latency["p99_ms"] / best["p99_ms"], 3),
        "settings": settings,
    }
    if errors:
        row["errors"] = errors
    return row
