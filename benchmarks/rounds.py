"""Rounds: each runs one repetition of every system compared, and a system's rounds
become one row, as its repetitions in a row would. On a machine whose speed drifts within
the hour, each system then meets every hour of the run, not the one its turn fell in."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.measure import spread


def merged(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of each round's one repetition, one row a system and workload, as if
    its repetitions had run one after another (in the first round's order)."""
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for rows in rounds:
        for row in rows:
            groups.setdefault((row.get("workload"), row.get("system")), []).append(row)
    return [merged_row(group) for group in groups.values()]


def merged_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r for r in rows if "failed" in r]
    if failed or len(rows) == 1 or any("samples" not in r for r in rows):
        return failed[0] if failed else rows[0]  # a skip, a lack, a failure: as it came
    row = dict(rows[0])
    row.update(spread([v for r in rows for v in r["samples"]]))
    row["repetitions"] = sum(r["repetitions"] for r in rows)

    def each(key: str) -> list[Any]:
        return [r[key] for r in rows if key in r]

    if "cpu_s_per_1000" in row:
        row["cpu_s_per_1000"] = spread([v for c in each("cpu_s_per_1000") for v in c["samples"]])
    if "peak_rss_mb" in row:
        row["peak_rss_mb"] = max(each("peak_rss_mb"))
    if "errors" in row:
        row["errors"] = sum(each("errors"))
    if "executions" in row:
        row["executions"] = statistics.median(each("executions"))
    for mean in ("commands_per_query", "batches_per_query"):
        if mean in row:
            row[mean] = round(statistics.fmean(each(mean)), 2)
    for by_name in ("cpu_ms_per_query", "latency_ms"):
        if by_name in row:
            row[by_name] = {
                k: round(statistics.median(v[k] for v in each(by_name)), 3) for k in row[by_name]
            }
    return row
