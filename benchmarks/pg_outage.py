"""The PostgreSQL store's outage experiments, as numbers:

    python -m benchmarks.pg_outage [--out FILE.json]

1. a lock held by another session on one prefix: ping and another prefix's ADD meanwhile;
2. a connection that stops answering (a TCP proxy that stops forwarding), with
   `--pg-network-timeout 2`: ping meanwhile, how long the ADD takes to fail, how soon
   service is back once the proxy forwards again;
3. a 2 s "restart" under load (every connection cut, new ones refused): how long after
   the database is back every caller has its answer, executions per key, slots held;
4. a partition of one of two hosts (8 s or more, its lease 4 s) while its workers run two
   queries of 6 s: runs started and ended per query, whether two runs of one query ever
   overlapped, how long its callers (on the other host) waited.

Needs a PostgreSQL server (QUERYQUEUE_TEST_POSTGRES, as the tests). The proxy is the
tests' own (tests/postgres_util.py). Nothing here asserts anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from queryqueue import ContinueWaitError, SocketQueueDriver, StoreError
from queryqueue.supervisor.launch import SupervisorProcess, launch
from tests.postgres_util import URL, Proxy, drop_schema, fresh_schema
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]


def _host(work: Path, name: str, schema: str, url: str, *options: str) -> SupervisorProcess:
    """A supervisor of `schema` at `url` (PostgreSQL itself, or a proxy in front of it)."""
    return launch(
        work / f"{name}.db",
        work / f"{name}.sock",
        "--schema",
        schema,
        *options,
        store=url,
        cwd=REPO,
    )


async def _timed(awaitable: Awaitable[Any]) -> tuple[float, Any]:
    started = time.monotonic()
    try:
        answer = await awaitable
    except Exception as exc:
        answer = exc
    return time.monotonic() - started, answer


async def held_lock(work: Path) -> dict[str, Any]:
    import psycopg

    from queryqueue.driver_postgres.statements import prefix_lock_key

    schema = fresh_schema()
    host = _host(work, "l", schema, URL, "--pg-lock-timeout", "20")
    driver = SocketQueueDriver(host.socket_path)
    try:
        await driver.add("q:warm", "{}")
        with psycopg.connect(URL, autocommit=True) as other:
            other.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (prefix_lock_key(schema, "p"),)
            )
            locked = asyncio.ensure_future(_timed(driver.add("p:k", "{}")))
            await asyncio.sleep(0.5)
            ping, _ = await _timed(driver.ping())
            other_prefix, _ = await _timed(driver.add("q:k", "{}"))
            await asyncio.sleep(3)
            other.execute("SELECT pg_advisory_unlock_all()")
            waited, answer = await locked
        return {
            "ping_ms": round(ping * 1000, 2),
            "other_prefix_add_ms": round(other_prefix * 1000, 2),
            "locked_prefix_answered_after_s": round(waited, 2),
            "locked_prefix_answer": type(answer).__name__,
        }
    finally:
        await driver.close()
        host.stop()
        drop_schema(schema)


async def frozen_connection(work: Path) -> dict[str, Any]:
    schema, proxy = fresh_schema(), Proxy()
    host = _host(work, "f", schema, proxy.url, "--pg-network-timeout", "2")
    driver = SocketQueueDriver(host.socket_path)
    try:
        await driver.add("p:a", "{}")
        proxy.freeze()
        add = asyncio.ensure_future(_timed(driver.add("p:b", "{}")))
        await asyncio.sleep(0.3)
        ping, _ = await _timed(driver.ping())
        failed_after, error = await add
        proxy.resume()
        resumed = time.monotonic()
        while True:
            try:
                await driver.add("p:c", "{}")
                break
            except StoreError:
                await asyncio.sleep(0.05)
        return {
            "network_timeout_s": 2,
            "ping_ms": round(ping * 1000, 2),
            "add_failed_after_s": round(failed_after, 2),
            "error": str(error)[:120],
            "back_after_resume_s": round(time.monotonic() - resumed, 2),
        }
    finally:
        await driver.close()
        host.stop()
        proxy.close()
        drop_schema(schema)


async def restart_under_load(work: Path) -> dict[str, Any]:
    from tests.apps.pool_app import app

    os.environ["POOL_TRACE"] = str(work / "trace")
    schema, proxy = fresh_schema(), Proxy()
    host = _host(work, "r", schema, proxy.url, "--app", "tests.apps.pool_app:app", "--workers", "2")
    driver = SocketQueueDriver(host.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=30)

    async def ask(key: str) -> Any:
        while True:
            try:
                return await queue.execute_in_queue("sql", key, {"key": key, "seconds": 0.4})
            except (ContinueWaitError, StoreError):
                await asyncio.sleep(0.05)

    try:
        keys = [f"r{i}" for i in range(10)]
        asks = [asyncio.ensure_future(ask(key)) for key in keys]
        await wait_until(lambda: (work / "trace").exists(), within=30)  # queries run
        proxy.cut()
        await asyncio.sleep(2.0)
        proxy.resume()
        back = time.monotonic()
        await asyncio.gather(*asks)
        answered = time.monotonic() - back
        starts = [
            line for line in (work / "trace").read_text().splitlines() if line.startswith("start")
        ]
        return {
            "queries": len(keys),
            "query_s": 0.4,
            "workers": 2,
            "outage_s": 2.0,
            "all_answered_after_back_s": round(answered, 2),
            "executions": len(starts),
            "active_after": len(await driver.active("sql")),
        }
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        host.stop()
        proxy.close()
        drop_schema(schema)


async def partition(work: Path) -> dict[str, Any]:
    from tests.apps.pool_app import six
    from tests.trace import read_trace

    (work / "partition").mkdir()
    os.environ["POOL_TRACE"], os.environ["POOL_HEARTBEAT"] = str(work / "partition/trace"), "2.5"
    schema, proxy = fresh_schema(), Proxy()
    pool = ("--app", "tests.apps.pool_app:six", "--workers", "2", "--pg-host-timeout", "4")
    hosts = [_host(work, "pa", schema, proxy.url, *pool), _host(work, "pb", schema, URL, *pool)]
    drivers = [SocketQueueDriver(h.socket_path) for h in hosts]
    queues = [six.pool_queue(d, continue_wait_timeout=1.0) for d in drivers]

    async def ask(queue: Any, key: str) -> Any:
        while True:
            try:
                return await queue.execute_in_queue("ticking", key, {"key": key, "seconds": 6.0})
            except (ContinueWaitError, StoreError):
                await asyncio.sleep(0.05)

    def started() -> int:
        return sum(t[0] == "start" for t in read_trace(work / "partition"))

    async def sees_the_other() -> bool:  # at its last renewal (a build without it: yes)
        stats = await drivers[0].stats()
        return bool(stats.get("lease", {}).get("other_hosts", 1) >= 1)

    try:
        await wait_until(sees_the_other, within=30)
        keys = ["p0", "p1"]
        firsts = [asyncio.ensure_future(ask(queues[0], key)) for key in keys]
        await wait_until(lambda: started() == len(keys), within=30)
        callers = [asyncio.ensure_future(_timed(ask(queues[1], key))) for key in keys]
        for first in firsts:
            first.cancel()
        proxy.cut()
        cut = time.monotonic()
        waited = [seconds for seconds, _ in await asyncio.gather(*callers)]
        await asyncio.sleep(max(0.0, cut + 8.0 - time.monotonic()))  # past the queries' 6 s
        partitioned = time.monotonic() - cut
        proxy.resume()
        report = _partition_report(read_trace(work / "partition"), keys, waited)
        return {**report, "partition_s": round(partitioned, 1)}
    finally:
        for queue, driver in zip(queues, drivers, strict=True):
            await queue.shutdown(grace=0)
            await driver.close()
        for host in hosts:
            host.stop()
        proxy.close()
        drop_schema(schema)


def _partition_report(
    trace: list[list[str]], keys: list[str], waited: list[float]
) -> dict[str, Any]:
    runs: dict[str, list[tuple[str, float, float, bool]]] = {}
    for key in keys:
        for pid in dict.fromkeys(t[2] for t in trace if t[1] == key):
            times = [float(t[3]) for t in trace if t[1] == key and t[2] == pid]
            ended = any(t[0] == "end" for t in trace if t[1] == key and t[2] == pid)
            runs.setdefault(key, []).append((pid, min(times), max(times), ended))
    overlapped = sum(
        1
        for each in runs.values()
        for i, a in enumerate(each)
        for b in each[i + 1 :]
        if a[1] < b[2] and b[1] < a[2]
    )
    return {
        "queries": len(keys),
        "query_s": 6.0,
        "lease_s": 4,
        "runs_started": {k: len(v) for k, v in runs.items()},
        "runs_ended": {k: sum(r[3] for r in v) for k, v in runs.items()},
        "overlapping_runs": overlapped,
        "callers_answered_after_s": [round(w, 2) for w in waited],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_outage", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="qq-pg-outage-"))
    report = {
        "held_lock": asyncio.run(held_lock(work)),
        "frozen_connection": asyncio.run(frozen_connection(work)),
        "restart_under_load": asyncio.run(restart_under_load(work)),
        "partition": asyncio.run(partition(work)),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
