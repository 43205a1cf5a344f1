"""The prefixes curve: one queue per tenant, each with its own budget, at the same total load.

A supervisor serves the store (no pool); 4 request processes each hold a `QueryQueue` per
prefix they call, which runs its own queries as Cube's does (reconcile after every ADD
and ACK, no timer of its own). 1,000 calls are in flight at every point, as chains of
sequential calls: with N prefixes each prefix has 1,000/N chains and a budget of 1,000/N,
so the total budget is the same and, at 1,000 prefixes, each has one query in flight.
A last point runs one prefix's load beside 10,000 idle prefixes, each of which ran a
query whose result the store still holds: an idle tenant must cost a query nothing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.drive import REPO, join_or_kill
from benchmarks.measure import spread
from benchmarks.ours import curve_row
from queryqueue.driver_sqlite.store import SqliteQueueStore
from queryqueue.supervisor import loops
from queryqueue.supervisor.launch import launch

IN_FLIGHT = 1_000
PROCESSES = 4


def rows(points: list[int], total: int, reps: int, idle: int) -> list[dict[str, Any]]:
    shapes = [*((p, 0) for p in points), (1, idle)]
    rates: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
    for _ in range(reps):  # in rounds: each shape meets every drift of the machine
        for prefixes, idle_ones in shapes:
            rates[prefixes, idle_ones].append(_one_run(prefixes, total, idle_ones))
    made = []
    first: float | None = None
    for prefixes, idle_ones in shapes:
        beside = f" beside {idle_ones:,} idle ones" if idle_ones else ""
        named = f"{prefixes:,} prefix{'es' if prefixes > 1 else ''}"
        row: dict[str, Any] = {
            "workload": "scale",
            "system": f"queryqueue: {named}, one queue each{beside}",
            "n": total,
            "repetitions": reps,
            "metric": "queries/s",
            **spread(rates[prefixes, idle_ones]),
            "settings": f"{PROCESSES} processes, {IN_FLIGHT:,} calls in flight over {named}, "
            f"budget {IN_FLIGHT // prefixes:,} each, no-op queries run by the callers",
        }
        curve = "idle prefixes" if idle_ones else "prefixes"
        first = curve_row(row, curve, idle_ones or prefixes, first)
        made.append(row)
    return made


def _one_run(prefixes: int, total: int, idle: int) -> float:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
        socket_path = Path(tmp) / "s.sock"
        _idle_prefixes(Path(tmp) / "queue.db", idle)
        supervisor = launch(Path(tmp) / "queue.db", socket_path, cwd=REPO)
        try:
            ready, out = context.Queue(), context.Queue()
            go, leave = context.Event(), context.Event()
            chains = _chains(prefixes, total)
            processes = [
                context.Process(
                    target=_caller,
                    args=(
                        str(socket_path),
                        chains[p],
                        IN_FLIGHT // prefixes,
                        ready,
                        go,
                        leave,
                        out,
                    ),
                    daemon=True,
                )
                for p in range(PROCESSES)
            ]
            for process in processes:
                process.start()
            try:
                for _ in processes:
                    ready.get(timeout=60)
                began = time.monotonic()
                go.set()
                done = sum(out.get(timeout=1800) for _ in processes)
                wall = time.monotonic() - began
            finally:
                leave.set()
                join_or_kill(processes)
            return float(done / wall)
        finally:
            supervisor.stop()


def _idle_prefixes(db: Path, count: int) -> None:
    """`count` prefixes that each ran one query, its result still held."""
    store = SqliteQueueStore(db)
    try:

        def ran() -> None:
            for i in range(count):
                path = f"idle{i}:q"
                store.add(path, "{}")
                store.retrieve(path)
                store.ack(path, "1")

        store.batched(ran, lambda _: None)
    finally:
        store.close()


def _chains(prefixes: int, total: int) -> list[list[tuple[str, int]]]:
    """Each process's chains: (prefix, calls). Chain c calls prefix c mod N from process
    c mod 4, so a tenant's chains stay in one process once there are 4 or more tenants."""
    per_chain = max(1, total // IN_FLIGHT)
    by_process: list[list[tuple[str, int]]] = [[] for _ in range(PROCESSES)]
    for chain in range(IN_FLIGHT):
        by_process[chain % PROCESSES].append((f"t{chain % prefixes}", per_chain))
    return by_process


def _noop(query: Any) -> int:
    return 1


def _caller(
    socket_path: str,
    chains: list[tuple[str, int]],
    budget: int,
    ready: Any,
    go: Any,
    leave: Any,
    out: Any,
) -> None:
    loops.run(_calls(socket_path, chains, budget, (ready, go, leave, out)))


async def _calls(
    socket_path: str, chains: list[tuple[str, int]], budget: int, events: tuple[Any, ...]
) -> None:
    """Each process runs any process's queries of its prefixes (as Cube's reconcile does),
    so it stays until every process is done."""
    from queryqueue.driver_socket.client import SocketQueueDriver
    from queryqueue.engine.queue import QueryQueue

    driver = SocketQueueDriver(socket_path)
    queues: dict[str, QueryQueue] = {}
    for prefix, _ in chains:
        if prefix not in queues:
            queues[prefix] = QueryQueue(
                prefix,
                query_handlers={"noop": _noop},
                driver=driver,
                concurrency=budget,
                continue_wait_timeout=60.0,
            )
    ready, go, leave, out = events
    await driver.call("ping")
    ready.put(1)
    await asyncio.to_thread(go.wait)

    async def chain(number: int, prefix: str, calls: int) -> int:
        for i in range(calls):
            await queues[prefix].execute_in_queue("noop", [number, i], {})
        return calls

    done = await asyncio.gather(*(chain(n, p, c) for n, (p, c) in enumerate(chains)))
    out.put(sum(done))
    await asyncio.to_thread(leave.wait)
    for queue in queues.values():
        await queue.shutdown(grace=0)
    await driver.close()
