"""Benchmark: commands/s and round-trip latency through the supervisor's socket.

    python -m benchmarks.socket_bench            # full run
    python -m benchmarks.socket_bench --quick    # CI-sized

Starts a real supervisor (SQLite, synchronous=NORMAL) on a temp database and measures, for
one and for several client processes, with and without pipelining (several requests in
flight on one connection): ADD (a write, group-committed) and PING (the framing and
dispatch alone, no store: the floor of a round trip over this socket). Each row is the
median of the repetitions. Prints a table and writes JSON.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import micro
from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.supervisor.launch import launch


def _client(
    socket_path: str, command: str, calls: int, in_flight: int, start_at: float
) -> tuple[list[float], float, float]:
    return asyncio.run(_client_async(socket_path, command, calls, in_flight, start_at))


async def _client_async(
    socket_path: str, command: str, calls: int, in_flight: int, start_at: float
) -> tuple[list[float], float, float]:
    driver = SocketQueueDriver(socket_path)
    await driver.call("ping")  # connect before the clock starts
    tag = uuid.uuid4().hex[:8]
    latencies: list[float] = []
    per_worker = calls // in_flight

    async def worker(w: int) -> None:
        for i in range(per_worker):
            t0 = time.perf_counter()
            if command == "ping":
                await driver.call("ping")
            else:
                await driver.call("add", f"bench:{tag}-{w}-{i}", '{"q":1}')
            latencies.append(time.perf_counter() - t0)

    await asyncio.sleep(max(0.0, start_at - time.time()))  # all processes start together
    started = time.time()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    ended = time.time()
    await driver.close()
    return latencies, started, ended


def _run_case(
    socket_path: Path, command: str, processes: int, in_flight: int, calls: int
) -> dict[str, float]:
    start_at = time.time() + 0.5
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        results = pool.starmap(
            _client, [(str(socket_path), command, calls, in_flight, start_at)] * processes
        )
    latencies = sorted(x for r in results for x in r[0])
    # Wall time across processes: first start to last end (one host, one clock).
    wall = max(1e-9, max(r[2] for r in results) - min(r[1] for r in results))
    return {
        "commands_per_s": len(latencies) / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


def run(quick: bool, repetitions: int) -> dict[str, Any]:
    calls = 400 if quick else 5_000
    cases = [
        (command, processes, in_flight)
        for command in ("ping", "add")
        for processes in (1, 4)
        for in_flight in (1, 16)
    ]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="qq-bench-", dir="/tmp") as tmp:
        socket_path = Path(tmp) / "s.sock"
        supervisor = launch(Path(tmp) / "q.db", socket_path)
        try:
            _run_case(socket_path, "ping", 1, 1, 100)  # warm-up
            for command, processes, in_flight in cases:
                runs = [
                    _run_case(socket_path, command, processes, in_flight, calls)
                    for _ in range(repetitions)
                ]
                rows.append(
                    {
                        "command": command,
                        "client_processes": processes,
                        "in_flight_per_connection": in_flight,
                        "calls_per_process": calls,
                        **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                        "commands_per_s_min": min(r["commands_per_s"] for r in runs),
                        "commands_per_s_max": max(r["commands_per_s"] for r in runs),
                    }
                )
        finally:
            supervisor.stop()
    floor: dict[tuple[int, int], float] = {
        (r["client_processes"], r["in_flight_per_connection"]): r["commands_per_s"]
        for r in rows
        if r["command"] == "ping"
    }
    for row in rows:
        row["vs_ping"] = (
            row["commands_per_s"]
            / floor[(row["client_processes"], row["in_flight_per_connection"])]
        )
    return {
        "benchmark": "supervisor_socket",
        "repetitions": repetitions,
        "store": "sqlite synchronous=NORMAL",
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"supervisor socket, median of {report['repetitions']} runs ({report['store']})",
        f"{'command':<8}{'procs':>6}{'in flight':>10}{'cmd/s':>12}{'(min-max)':>20}{'p50 ms':>9}{'p99 ms':>9}{'vs ping':>9}",
    ]
    for r in report["rows"]:
        spread = f"({r['commands_per_s_min']:,.0f}-{r['commands_per_s_max']:,.0f})"
        lines.append(
            f"{r['command']:<8}{r['client_processes']:>6}{r['in_flight_per_connection']:>10}"
            f"{r['commands_per_s']:>12,.0f}{spread:>20}"
            f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['vs_ping']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = micro.parser(__doc__, "socket").parse_args(argv)
    report = run(args.quick, args.repetitions or (1 if args.quick else 5))
    print(table(report))
    print(f"written to {micro.write_report(report, 'socket', quick=args.quick, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
