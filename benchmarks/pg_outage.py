"""The PostgreSQL store's outage experiments, as numbers:

    python -m benchmarks.pg_outage [--out FILE.json]

1. a lock held by another session on one prefix: ping and another prefix's ADD meanwhile;
2. a connection that stops answering (a TCP proxy that stops forwarding), with
   `--pg-network-timeout 2`: ping meanwhile, how long the ADD takes to fail, how soon
   service is back once the proxy forwards again;
3. a 2 s "restart" under load (every connection cut, new ones refused): how long after
   the database is back every caller has its answer, executions per key, slots held.

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_outage", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="qq-pg-outage-"))
    report = {
        "held_lock": asyncio.run(held_lock(work)),
        "frozen_connection": asyncio.run(frozen_connection(work)),
        "restart_under_load": asyncio.run(restart_under_load(work)),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
