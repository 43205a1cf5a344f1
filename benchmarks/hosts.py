"""The hosts workload: one queue on PostgreSQL served by 1, 2 and 3 supervisors ("hosts"),
each with 2 workers, sharing a budget of 6.

No-op queries, and queries that hold their worker 20 ms, from 6 request processes spread
over the hosts, each with 16 in flight. A host retrieves only what its workers can start,
so the budget is shared by the hosts' workers: with 20 ms queries each host adds its two
workers' worth (one host is held to 2 at once by its workers, three use the whole budget
of 6), and no host idles while another has a backlog. Each row gives its throughput
against one host's in the same run (`of_one_host`).

    python -m benchmarks --only hosts
"""

from __future__ import annotations

from typing import Any

from benchmarks.drive import Job, drive, postgres_hosts, postgres_unavailable
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
        one_host: float | None = None
        for count in HOSTS:
            runs = []
            for rep in range(reps):
                with postgres_hosts(count, app=APP) as hosts:
                    shares = [
                        [
                            Job(handler, [count, rep, p, i], query)
                            for i in range(count_n // PRODUCERS)
                        ]
                        for p in range(PRODUCERS)
                    ]
                    runs.append(drive(hosts, shares, in_flight=IN_FLIGHT, app_name=APP))
            rates = [run.rate for run in runs]
            row = summary_row(
                "hosts",
                f"queryqueue ({count} host{'s' if count > 1 else ''}, {label} queries)",
                runs,
                count_n,
                settings=f"{count} supervisor(s) x 2 workers on one local PostgreSQL, budget 6,"
                f" {PRODUCERS} request processes x {IN_FLIGHT} in flight over the hosts",
                metric=("queries/s", rates),
                latency=True,
            )
            one_host = curve_row(row, f"supervisors, {label} queries", count, one_host)
            row["of_one_host"] = row["of_first"]
            row["settings"] = f"{row['of_one_host']}x one host's; {row['settings']}"
            made.append(row)
    return made
