"""The hosts workload: one queue on PostgreSQL served by 1, 2 and 3 supervisors ("hosts"),
each with 2 workers, sharing a budget of 6.

No-op queries, and queries that hold their worker 20 ms, from 6 request processes spread
over the hosts, each with 16 in flight. A host retrieves only what its workers can start,
so the budget is shared by the hosts' workers: with 20 ms queries each host adds its two
workers' worth (one host is held to 2 at once by its workers, three use the whole budget
of 6), and no host idles while another has a backlog. Each row gives its throughput
against one host's in the same run (`of_one_host`), the points measured in rounds.

    python -m benchmarks --only hosts
"""

from __future__ import annotations

from typing import Any

from benchmarks.drive import Job, Run, drive, postgres_hosts, postgres_unavailable
from benchmarks.ours import curve_row, summary_row

APP = "hosts"  # benchmarks.bench_app:hosts, budget 6
HOSTS = (1, 2, 3)
PRODUCERS = 6
IN_FLIGHT = 16
# (label, handler, query, share of n): 20 ms queries run at most 300 a second.
KINDS: tuple[tuple[str, str, dict[str, Any], float], ...] = (
    ("no-op", "noop", {}, 1.0),
    ("20 ms", "sleep", {"seconds": 0.02}, 0.5),
)


def rows(n: int, reps: int) -> list[dict[str, Any]]:
    reason = postgres_unavailable()
    if reason is not None:
        return [{"workload": "hosts", "system": "queryqueue (PostgreSQL)", "skipped": reason}]
    made = []
    for label, handler, query, share in KINDS:
        count_n = max(PRODUCERS, int(n * share))
        # In rounds, 1, 2 and 3 hosts in each: a drift in the machine's speed (2-3x here
        # within the hour) then reaches every point of the curve, not the ratios alone.
        runs: dict[int, list[Run]] = {count: [] for count in HOSTS}
        for rep in range(reps):
            for count in HOSTS:
                runs[count].append(_run(count, rep, handler, query, count_n))
        one_host: float | None = None
        for count in HOSTS:
            row = summary_row(
                "hosts",
                f"queryqueue ({count} host{'s' if count > 1 else ''}, {label} queries)",
                runs[count],
                count_n,
                settings=f"{count} supervisor(s) x 2 workers on one local PostgreSQL, budget 6,"
                f" {PRODUCERS} request processes x {IN_FLIGHT} in flight over the hosts,"
                f" {reps} round(s) of 1, 2 and 3 hosts",
                metric=("queries/s", [run.rate for run in runs[count]]),
                latency=True,
            )
            one_host = curve_row(row, f"supervisors, {label} queries", count, one_host)
            row["of_one_host"] = row["of_first"]
            row["settings"] = f"{row['of_one_host']}x one host's; {row['settings']}"
            made.append(row)
    return made


def _run(count: int, rep: int, handler: str, query: dict[str, Any], n: int) -> Run:
    with postgres_hosts(count, app=APP) as hosts:
        shares = [
            [Job(handler, [count, rep, p, i], query) for i in range(n // PRODUCERS)]
            for p in range(PRODUCERS)
        ]
        return drive(hosts, shares, in_flight=IN_FLIGHT, app_name=APP)
