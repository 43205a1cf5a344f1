"""The workloads on queryqueue, each a list of rows with its spread over repetitions;
`drive.py` runs the supervisor and the request processes they measure."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from benchmarks.drive import (
    Job,
    MiB,
    Run,
    Setup,
    drive,
    noop_shares,
    postgres_or_skip,
    postgres_setup,
    sqlite_setup,
    supervisor_for,
)
from benchmarks.measure import quantiles, spread
from queryqueue.supervisor.launch import SupervisorProcess


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
                shares = noop_shares(n, producers, f"t{rep}")
                runs.append(drive(hosts, shares, in_flight=in_flight, app_name=setup.app))
        rows.append(
            summary_row(
                "throughput",
                setup.system,
                runs,
                n,
                settings=f"{setup.settings}, {producers} request processes x {in_flight} in flight",
                metric=("queries/s", [r.rate for r in runs]),
            )
        )
    return rows


def postgres_throughput(n: int, reps: int) -> list[dict[str, Any]]:
    return postgres_or_skip(
        "throughput",
        lambda: throughput(
            n,
            reps,
            [postgres_setup(1), postgres_setup(1, worker_concurrency=10), postgres_setup(2)],
        ),
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
        of_path = functools.partial(latencies_of_path, index)
        rows.append(
            summary_row(
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


def latencies_of_path(index: int, run: Run) -> list[float]:
    """The latencies of the queries of IDLE_PATHS[index] in a run of them alternating (one
    in flight: a run's records come in its jobs' order)."""
    return [end - start for start, end, _ in run.records[index :: len(IDLE_PATHS)]]


def postgres_idle_latency(n: int, reps: int) -> list[dict[str, Any]]:
    return postgres_or_skip("idle_latency", lambda: idle_latency(n, reps, postgres_setup(1)))


def dedup_storm(n: int, reps: int, processes: int = 8) -> list[dict[str, Any]]:
    runs = []
    for rep in range(reps):
        with supervisor_for() as supervisor:
            shares = [
                [Job("sleep", ["storm", rep], {"seconds": 0.2}) for _ in range(n // processes)]
                for _ in range(processes)
            ]
            runs.append(drive(supervisor, shares, in_flight=n))
    row = summary_row(
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
            summary_row(
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
    return summary_row(
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
            run = drive(supervisor, noop_shares(n, producers, "soak"), in_flight=in_flight)
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
    row = summary_row(
        "soak",
        "queryqueue (SQLite NORMAL)",
        [run],
        n,
        settings=f"2 workers, {producers} request processes x {in_flight} in flight",
        metric=("queries/s", [run.rate]),
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


def summary_row(
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


def curve_row(row: dict[str, Any], curve: str, point: int, first: float | None) -> float:
    """Mark `row` as `point` of `curve`, with its median against the curve's first point
    (`first`, None at the first): returns the first point's median."""
    row["curve"], row["point"] = curve, point
    first = first or row["median"]
    row["of_first"] = round(row["median"] / first, 2) if first else None
    return first
