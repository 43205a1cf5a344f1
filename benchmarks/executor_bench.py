"""Micro-benchmark: the CPU one execution of a no-op query costs its executor, in one process.

    python -m benchmarks.executor_bench            # full run, ~1 minute
    python -m benchmarks.executor_bench --quick    # CI-sized

`Executor.execute_query` from a retrieved item to its stored ACK, on the in-memory store
and the loop a worker runs (uvloop where installed), for four handlers: a sync one whose
outcome comes back through the loop's wake-up (any process but a pool's worker), the same
waited for on the spot (`SYNC_HANDLER_WAIT`: a pool's worker, for a handler whose cancel
handler is async), the same run on the loop's thread under a `WorkerWatch` (a pool's
worker), and an async one (no thread). CPU of the whole process (the handler's thread included) a query,
median of the repetitions (min-max), the subjects alternating within each round. Prints
a table and writes JSON; asserts nothing about speed.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from typing import Any

import multiprocess

from benchmarks import micro
from queryqueue.engine.memory_store import MemoryQueueStore
from queryqueue.engine.queue import QueryQueue
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.supervisor import loops
from queryqueue.supervisor.watch import WorkerWatch
from queryqueue.supervisor.worker import SYNC_HANDLER_WAIT

PAYLOAD = '{"queryHandler": "noop", "query": 1}'
CHUNK = 250


def _sync_noop(query: Any, set_cancel_handler: Any) -> int:
    return 1


async def _async_noop(query: Any, set_cancel_handler: Any) -> int:
    return 1


# handler, the wait on the spot, and whether it runs on the loop's thread, watched
SUBJECTS: dict[str, tuple[Any, float, bool]] = {
    "sync, through the loop": (_sync_noop, 0.0, False),
    "sync, on the spot": (_sync_noop, SYNC_HANDLER_WAIT, False),
    "sync, on the loop (pool worker)": (_sync_noop, 0.0, True),
    "async (no thread)": (_async_noop, 0.0, False),
}


async def _one_round(handler: Any, wait: float, watched: bool, n: int) -> float:
    """CPU microseconds a query over `n` executions on a fresh queue."""
    store = MemoryQueueStore()
    queue = QueryQueue(
        "bench", query_handlers={"noop": handler}, driver=store, reconcile=False, concurrency=CHUNK
    )
    queue.executor.sync_handler_wait = wait
    pool_end, worker_end = multiprocess.Pipe()
    if watched:
        queue.executor.watch = WorkerWatch(worker_end, lambda _: None, asyncio.get_running_loop())
    spent = 0.0
    try:
        for start in range(0, n, CHUNK):
            # Retrieved a chunk at a time: the memory store's active list stays short.
            items = []
            for i in range(start, min(n, start + CHUNK)):
                added = store.add(f"bench:k{i}", PAYLOAD)
                store.retrieve(added.id, concurrency=CHUNK)
                query = {"queryHandler": "noop", "query": 1}
                items.append(RetrievedQuery(f"k{i}", added.id, added.id, 0, query, started_ms=1))
            began = time.process_time()
            for retrieved in items:
                await queue.execute_query(retrieved)
            spent += time.process_time() - began
        return spent / n * 1e6
    finally:
        await queue.close(grace=0)
        if isinstance(queue.executor.watch, WorkerWatch):
            queue.executor.watch.close()
        pool_end.close()
        worker_end.close()


async def _rounds(n: int, repetitions: int) -> dict[str, list[float]]:
    for handler, wait, watched in SUBJECTS.values():  # warm-up: threads started, code hot
        await _one_round(handler, wait, watched, min(n, 200))
    measured: dict[str, list[float]] = {name: [] for name in SUBJECTS}
    for _ in range(repetitions):
        for name, (handler, wait, watched) in SUBJECTS.items():
            measured[name].append(await _one_round(handler, wait, watched, n))
    return measured


def run(n: int, repetitions: int) -> dict[str, Any]:
    measured = loops.run(_rounds(n, repetitions))
    rows = {
        name: {
            "median_us": statistics.median(figures),
            "min_us": min(figures),
            "max_us": max(figures),
        }
        for name, figures in measured.items()
    }
    return {
        "benchmark": "executor_cpu_us_per_query",
        "executions_per_round": n,
        "repetitions": repetitions,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "rows": rows,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"executor, CPU us a no-op query, median of {report['repetitions']} x "
        f"{report['executions_per_round']} executions (min-max)"
    ]
    for name, row in report["rows"].items():
        lines.append(
            f"{name:<34}{row['median_us']:>8.1f}  ({row['min_us']:.1f}-{row['max_us']:.1f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return micro.sized_main(argv, __doc__, "executor", run, table, n_help="executions per round")


if __name__ == "__main__":
    raise SystemExit(main())
