"""The scale workload: what a query costs as the work grows along one axis at a time, each
point against the curve's first (`of_first`).

1. calls in flight in one asyncio process (1k, 10k, 50k), through a supervisor whose
   connection parks at most 1,024 long polls: the client holds the rest. Throughput, and
   the supervisor's memory beyond its base per call waiting;
2. backlog (0, 100k, 1M pending items) on the SQLite store in process: an ADD, a
   priority-10 retrieval past the backlog, `stats`, and a reconcile's read of the head
   (scale_backlog.py);
3. prefixes (1, 100, 1,000), one query in flight on each at the same total load: one
   queue per prefix with its own budget, its caller running its queries, as Cube runs a
   queue per tenant (scale_tenants.py);
4. supervisors on one PostgreSQL queue (1, 2, 3), no-op and 20 ms queries: the hosts
   workload (hosts.py), its rows repeated here;
5. the PostgreSQL peers (pgqueuer, procrastinate) beside queryqueue's PostgreSQL store,
   throughput and idle latency (scale_peers.py).

Every curve is measured in rounds, a repetition (or a slice of samples) of each of its
points in turn: a shared VM's speed can drift by 2x within the hour, and a point measured
only in its own minutes would carry that drift into its ratio.

    python -m benchmarks --only scale
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import hosts, peers, scale_backlog, scale_peers, scale_tenants
from benchmarks.drive import Job, Run, drive, supervisor_for
from benchmarks.measure import TreeMeter
from benchmarks.ours import curve_row, summary_row

LONG_POLLS = 1024  # the supervisor's default per connection


@dataclass(frozen=True)
class Points:
    waiters: list[int]  # calls in flight at once in one process
    waiter_calls: int  # queries at every point
    backlog: list[int]  # items pending
    prefixes: list[int]
    tenant_calls: int  # queries at every point
    idle_prefixes: int  # beside one busy prefix, the curve's last point


FULL = Points(
    [1_000, 10_000, 50_000], 50_000, [0, 100_000, 1_000_000], [1, 100, 1_000], 20_000, 10_000
)
QUICK = Points([1_000, 5_000], 5_000, [0, 10_000, 100_000], [1, 100, 1_000], 2_000, 1_000)


def steps(
    points: Points,
    reps: int,
    host_queries: int,
    pg_peers: list[tuple[peers.Peer, Path]],
    postgres_n: int,
    latency_n: int,
) -> list[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    return [
        ("queryqueue calls in flight", lambda: waiters(points.waiters, points.waiter_calls, reps)),
        ("queryqueue backlog", lambda: scale_backlog.rows(points.backlog)),
        (
            "queryqueue prefixes",
            lambda: scale_tenants.rows(
                points.prefixes, points.tenant_calls, reps, points.idle_prefixes
            ),
        ),
        ("queryqueue supervisors on PostgreSQL", lambda: supervisors(host_queries, reps)),
        (
            "PostgreSQL peers",
            lambda: scale_peers.rows(pg_peers, postgres_n, latency_n, reps),
        ),
    ]


def supervisors(n: int, reps: int) -> list[dict[str, Any]]:
    """The hosts workload's rows as curves: no-op and 20 ms queries, 1, 2, 3 supervisors."""
    made = hosts.rows(n, reps)
    for row in made:
        row["workload"] = "scale"
    return made


def waiters(points: list[int], total: int, reps: int) -> list[dict[str, Any]]:
    """`total` no-op queries from one process, `point` of them in flight at once; in
    rounds, every point in each, so a drift in the machine's speed reaches them alike."""
    runs: dict[int, list[Run]] = {point: [] for point in points}
    per_call: dict[int, list[float]] = {point: [] for point in points}
    for rep in range(reps):
        for point in points:
            with supervisor_for() as supervisor:
                jobs = [[Job("noop", ["waiters", point, rep, i], {}) for i in range(total)]]
                with TreeMeter(roots=[supervisor.pid], children=False) as meter:
                    runs[point].append(drive(supervisor, jobs, in_flight=point))
                per_call[point].append((meter.peak_rss - meter.start_rss) / point)
    made = []
    first: float | None = None
    for point in points:
        row = summary_row(
            "scale",
            f"queryqueue: {point:,} calls in flight in one process",
            runs[point],
            total,
            settings=f"one asyncio process, {total:,} no-op queries, {point:,} at once; "
            f"the supervisor parks {LONG_POLLS:,} long polls a connection, 2 workers",
            metric=("queries/s", [r.rate for r in runs[point]]),
            latency=True,
        )
        row["supervisor_bytes_per_call"] = round(max(per_call[point]))
        first = curve_row(row, "calls in flight", point, first)
        made.append(row)
    return made
