"""Micro-benchmark: commands/s of the queue store in one process.

    python -m benchmarks.store_bench            # full run, ~1 minute
    python -m benchmarks.store_bench --quick    # CI-sized

Measures ADD, ADD_AND_RETRIEVE, ACK and RESULT on the SQLite store at synchronous=NORMAL
and FULL, beside the in-memory store as the no-durability reference measured in the
same run. Each figure is the median of the repetitions (min-max shown); every repetition
uses a fresh database. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import micro
from queryqueue.driver_sqlite.store import SqliteQueueStore, Synchronous
from queryqueue.engine.memory_store import MemoryQueueStore
from queryqueue.engine.store import QueueStore

PAYLOAD = json.dumps(
    {"queryHandler": "sql", "query": {"sql": "SELECT 1" + " " * 150}, "priority": 0}
)
RESULT = json.dumps({"result": [[1, "x" * 100]]})
COMMANDS = ["ADD", "ADD_AND_RETRIEVE", "ACK", "RESULT"]


def _one_round(make: Callable[[], QueueStore], n: int) -> dict[str, float]:
    """Commands/s of each command over `n` calls on a fresh store."""
    store = make()
    rates: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        ids = [store.add(f"bench:a{i}", PAYLOAD).id for i in range(n)]
        rates["ADD"] = n / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        for i in range(n):
            # An idle prefix each time: every call inserts and retrieves (the full fast track)
            # and the active list stays as short as a real queue's.
            store.add_and_retrieve(f"fast{i}:b", PAYLOAD, 4, priority=10)
        rates["ADD_AND_RETRIEVE"] = n / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        for queue_id in ids:
            store.ack(queue_id, RESULT)
        rates["ACK"] = n / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        for queue_id in ids:
            store.result(queue_id)
        rates["RESULT"] = n / (time.perf_counter() - t0)
    finally:
        store.close()
    return rates


def run(n: int, repetitions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qq-store-bench-") as tmp:
        counter = iter(range(1_000_000))

        def sqlite(sync: Synchronous) -> Callable[[], QueueStore]:
            return lambda: SqliteQueueStore(
                Path(tmp) / f"{sync}-{next(counter)}.db", synchronous=sync
            )

        subjects: dict[str, Callable[[], QueueStore]] = {
            "memory (reference)": MemoryQueueStore,
            "sqlite NORMAL": sqlite("NORMAL"),
            "sqlite FULL": sqlite("FULL"),
        }
        _one_round(MemoryQueueStore, min(n, 200))  # warm-up
        _one_round(sqlite("NORMAL"), min(n, 200))
        rows: dict[str, dict[str, dict[str, float]]] = {}
        for name, make in subjects.items():
            rounds = [_one_round(make, n) for _ in range(repetitions)]
            rows[name] = {
                command: {
                    "median": statistics.median(r[command] for r in rounds),
                    "min": min(r[command] for r in rounds),
                    "max": max(r[command] for r in rounds),
                }
                for command in COMMANDS
            }
    reference = rows["memory (reference)"]
    for row in rows.values():
        for command, figures in row.items():
            figures["vs_memory"] = figures["median"] / reference[command]["median"]
    return {
        "benchmark": "store_commands_per_second",
        "calls_per_command": n,
        "repetitions": repetitions,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": _cpus(),
        },
        "rows": rows,
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def table(report: dict[str, Any]) -> str:
    lines = [
        f"queue store, commands/s, median of {report['repetitions']} x {report['calls_per_command']} calls"
        " (min-max; ratio to memory)",
        f"{'store':<20}" + "".join(f"{c:>34}" for c in COMMANDS),
    ]
    for name, row in report["rows"].items():
        cells = []
        for command in COMMANDS:
            f = row[command]
            cells.append(
                f"{f['median']:>9,.0f} ({f['min']:,.0f}-{f['max']:,.0f}; {f['vs_memory']:.2f}x)"
            )
        lines.append(f"{name:<20}" + "".join(f"{c:>34}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return micro.sized_main(
        argv, __doc__, "store", run, table, n_help="calls per command per repetition"
    )


if __name__ == "__main__":
    raise SystemExit(main())
