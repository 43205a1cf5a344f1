"""Reference rows measured in the same run: the floors under any queue.

* `concurrent.futures.ProcessPoolExecutor` with 2 workers on the same no-op work: no
  durability, no dedup, no priorities, one submitting process;
* a raw round trip over the same kind of socket (Unix, 4-byte length-prefixed frames,
  an asyncio echo server), with the same request processes and pipelining as ours;
* a raw copy into and out of a pre-touched shared-memory segment.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import struct
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from benchmarks.measure import TreeMeter, quantiles, spread

MiB = 1024 * 1024
_HEADER = struct.Struct(">I")
_REQUEST = b'{"id":1,"cmd":"add","args":["bench:key-0-0","{}"],"kwargs":{}}'


def noop() -> int:
    return 1


def summary_row(
    workload: str, system: str, n: int, metric: str, values: list[float], **extra: Any
) -> dict[str, Any]:
    return {
        "workload": workload,
        "system": system,
        "n": n,
        "repetitions": len(values),
        "metric": metric,
        **spread(values),
        **extra,
    }


def pool_throughput(n: int, reps: int) -> dict[str, Any]:
    rates, cpu, rss = [], [], []
    for _ in range(reps):
        with ProcessPoolExecutor(2) as pool:
            list(pool.map(noop_arg, range(100)))  # warm
            with TreeMeter() as meter:
                started = time.perf_counter()
                futures = [pool.submit(noop) for _ in range(n)]
                for future in futures:
                    future.result()
                rates.append(n / (time.perf_counter() - started))
        cpu.append(meter.cpu_s / n * 1000)
        rss.append(meter.peak_rss)
    return summary_row(
        "throughput",
        "ProcessPoolExecutor (2 workers)",
        n,
        "queries/s",
        rates,
        cpu_s_per_1000=spread(cpu),
        peak_rss_mb=round(max(rss) / MiB, 1),
        settings="one submitting process; no durability, no dedup, no priorities",
    )


def noop_arg(_: int) -> int:
    return 1


def pool_latency(n: int, reps: int) -> dict[str, Any]:
    per_run = []
    for _ in range(reps):
        with ProcessPoolExecutor(2) as pool:
            list(pool.map(noop_arg, range(100)))
            latencies = []
            for _ in range(n):
                started = time.perf_counter()
                pool.submit(noop).result()
                latencies.append(time.perf_counter() - started)
        per_run.append(quantiles(latencies))
    return summary_row(
        "idle_latency",
        "ProcessPoolExecutor (2 workers)",
        n,
        "p50 ms",
        [q["p50_ms"] for q in per_run],
        latency_ms={k: spread([q[k] for q in per_run])["median"] for k in per_run[0]},
        settings="one caller, sequential submit().result()",
    )


# -- a raw socket round trip ----------------------------------------------------------------------


def _echo_server(path: str, ready: Any) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(4)
                body = await reader.readexactly(_HEADER.unpack(header)[0])
                writer.write(header + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(serve, path=path)
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _echo_client(path: str, calls: int, in_flight: int, go: Any, out: Any) -> None:
    async def main() -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        loop = asyncio.get_running_loop()
        waiting: deque[asyncio.Future[None]] = deque()
        latencies: list[float] = []

        async def replies() -> None:
            while True:  # the server answers in order: match replies first in, first out
                header = await reader.readexactly(4)
                await reader.readexactly(_HEADER.unpack(header)[0])
                waiting.popleft().set_result(None)

        async def one() -> None:
            for _ in range(calls // in_flight):
                started = time.perf_counter()
                answered = loop.create_future()
                waiting.append(answered)
                writer.write(_HEADER.pack(len(_REQUEST)) + _REQUEST)
                await answered
                latencies.append(time.perf_counter() - started)

        reading = asyncio.ensure_future(replies())
        await asyncio.to_thread(go.wait)
        started = time.time()
        await asyncio.gather(*(one() for _ in range(in_flight)))
        out.put((started, time.time(), latencies))
        reading.cancel()
        writer.close()

    asyncio.run(main())


def _echo_run(context: Any, procs: int, flight: int, calls: int) -> tuple[list[Any], float]:
    """One run of `procs` echo clients of `calls` round trips each: their records, and the
    CPU seconds of everything it ran."""
    with tempfile.TemporaryDirectory(prefix="qq-raw-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "echo.sock")
        ready = context.Event()
        server = context.Process(target=_echo_server, args=(path, ready), daemon=True)
        server.start()
        ready.wait(30)
        go, out = context.Event(), context.Queue()
        clients = [
            context.Process(target=_echo_client, args=(path, calls, flight, go, out))
            for _ in range(procs)
        ]
        for client in clients:
            client.start()
        time.sleep(0.5)  # clients connected and waiting
        with TreeMeter() as meter:
            go.set()
            results = [out.get(timeout=600) for _ in clients]
        for client in clients:
            client.join(30)
        server.kill()
        server.join(10)
    return results, meter.cpu_s


def raw_socket(n: int, reps: int, producers: int, in_flight: int) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    rows = []
    for procs, flight, workload in (
        (producers, in_flight, "throughput"),
        (1, 1, "idle_latency"),
    ):
        values, per_run, cpu = [], [], []
        for _ in range(reps):
            calls = n // procs if workload == "throughput" else n
            results, cpu_s = _echo_run(context, procs, flight, calls)
            wall = max(r[1] for r in results) - min(r[0] for r in results)
            done = sum(len(r[2]) for r in results)
            values.append(done / wall)
            per_run.append(quantiles([x for r in results for x in r[2]]))
            cpu.append(cpu_s / done * 1000)
        if workload == "throughput":
            rows.append(
                summary_row(
                    workload,
                    "raw socket round trip (echo)",
                    n,
                    "round trips/s",
                    values,
                    cpu_s_per_1000=spread(cpu),
                    settings=f"{procs} processes x {flight} in flight, no store, no work",
                )
            )
        else:
            rows.append(
                summary_row(
                    workload,
                    "raw socket round trip (echo)",
                    n,
                    "p50 ms",
                    [q["p50_ms"] for q in per_run],
                    latency_ms={k: spread([q[k] for q in per_run])["median"] for k in per_run[0]},
                    settings="one caller, sequential",
                )
            )
    return rows


def raw_shm_copy(sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes_mib:
        n = size * MiB
        data = b"x" * n
        segment = shared_memory.SharedMemory(create=True, size=n)
        buffer = segment.buf
        assert buffer is not None
        try:
            buffer[:n] = data  # pre-touch
            rates = []
            for _ in range(reps):
                started = time.perf_counter()
                buffer[:n] = data
                copied = bytes(buffer[:n])
                rates.append(n / (time.perf_counter() - started) / 1e9)
                del copied
        finally:
            del buffer
            segment.close()
            segment.unlink()
        rows.append(
            summary_row(
                "large_results",
                f"raw shared-memory copy, {size} MiB",
                1,
                "GB/s",
                rates,
                settings="write into a pre-touched segment, copy out; one process",
            )
        )
    return rows
