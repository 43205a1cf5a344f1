"""Runs the throughput or idle-latency workload on a PostgreSQL peer (pgqueuer,
procrastinate), inside that peer's own virtual environment.

    <peer venv>/bin/python benchmarks/pg_peer_runner.py '{"peer": "pgqueuer", ...}'

Standalone (stdlib, psutil and the peer). For each repetition it makes the peer a fresh
database on the benchmark's PostgreSQL server, installs the peer's schema with the
peer's own command, starts 2 worker processes with its defaults, warms them, then runs
the request processes (asyncio, as these libraries are) and measures them and the
workers with the same `measure.py` as every other system. Neither peer stores a task's
return value: a job counts as answered when the peer reports it finished (pgqueuer's
`CompletionWatcher`; procrastinate's job status, polled for every unfinished job of a
request process in one query). It stops every process it started by pid, and prints one
JSON object.
"""
# mypy: ignore-errors

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import TreeMeter  # noqa: E402
from peer_runner import end, go_and_collect, plan, warm  # noqa: E402

BIN = Path(sys.executable).parent
# How often a procrastinate caller looks for its finished jobs: at once for a caller
# waiting on one job (idle latency), every 10 ms for one waiting on many (throughput).
POLL_ONE_S = 0.001
POLL_MANY_S = 0.01


def worker_commands(peer: str) -> tuple[list[list[str]], dict[str, str]]:
    """The commands that install the schema and start one worker process, and settings."""
    if peer == "pgqueuer":
        return [
            [str(BIN / "pgq"), "install"],
            [str(BIN / "pgq"), "run", "pg_peer_tasks:create_pgqueuer"],
        ], {
            "workers": "2 x pgq run (its defaults: batch size 10, LISTEN/NOTIFY)",
            "completion": "CompletionWatcher (LISTEN/NOTIFY; its 50 ms debounce for many"
            " jobs, 1 ms for one)",
        }
    if peer == "procrastinate":
        app = ["--app", "pg_peer_tasks.app"]
        return [
            [str(BIN / "procrastinate"), *app, "schema", "--apply"],
            [str(BIN / "procrastinate"), *app, "worker"],
        ], {
            "workers": "2 x procrastinate worker (its defaults: concurrency 1, LISTEN/NOTIFY)",
            "completion": f"job status polled every {POLL_ONE_S * 1000:g} ms for one job, "
            f"{POLL_MANY_S * 1000:g} ms for many, all of a caller's in one query",
        }
    raise SystemExit(f"unknown peer {peer}")


def _database_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"/{name}"))


def fresh_database(base: str, name: str) -> str:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return _database_url(base, name)


async def _share(peer: str, jobs: list, sequential: bool) -> list:
    import pg_peer_tasks as tasks

    if peer == "pgqueuer":
        return await _pgqueuer_share(tasks, jobs, sequential)
    return await _procrastinate_share(tasks, jobs, sequential)


async def _pgqueuer_share(tasks, jobs: list, sequential: bool) -> list:
    import asyncpg
    from pgqueuer.core.completion import CompletionWatcher
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    connection = await asyncpg.connect(tasks.DSN)
    driver = AsyncpgDriver(connection)
    queries = Queries(driver)
    # Its 50 ms debounce would add 50 ms to every answer of a caller waiting on one job.
    debounce = {"debounce": timedelta(milliseconds=1)} if sequential else {}
    try:
        async with CompletionWatcher(driver, queries=queries, **debounce) as watcher:

            async def one(name: str, priority: int) -> tuple[float, float]:
                started = time.time()
                (job_id,) = await queries.enqueue(name, None, priority)
                await watcher.wait_for(job_id)
                return started, time.time()

            if sequential:
                return [await one(name, priority) for name, _, priority in jobs]
            return list(await asyncio.gather(*(one(n, p) for n, _, p in jobs)))
    finally:
        await connection.close()


async def _procrastinate_share(tasks, jobs: list, sequential: bool) -> list:
    import psycopg

    async with (
        tasks.app.open_async(),
        await psycopg.AsyncConnection.connect(tasks.DSN, autocommit=True) as conn,
    ):

        async def finished(ids: list[int]) -> set[int]:
            rows = await conn.execute(
                "SELECT id FROM procrastinate_jobs WHERE id = ANY(%s)"
                " AND status IN ('succeeded', 'failed')",
                (ids,),
            )
            return {row[0] for row in await rows.fetchall()}

        async def defer(priority: int) -> tuple[float, int]:
            started = time.time()
            return started, await tasks.noop.configure(priority=priority).defer_async()

        async def many(batch: list) -> list[tuple[float, float]]:
            deferred = await asyncio.gather(*(defer(priority) for _, _, priority in batch))
            started, ids = [s for s, _ in deferred], [i for _, i in deferred]
            ended: dict[int, float] = {}
            poll = POLL_ONE_S if len(batch) == 1 else POLL_MANY_S
            while len(ended) < len(ids):
                await asyncio.sleep(poll)
                now = time.time()
                for job_id in await finished([i for i in ids if i not in ended]):
                    ended[job_id] = now
            return [(s, ended[i]) for s, i in zip(started, ids, strict=True)]

        if sequential:
            return [record for job in jobs for record in await many([job])]
        return await many(jobs)


def producer(peer: str, jobs: list, sequential: bool, go, out, index: int) -> None:
    go.wait()
    out.put((index, asyncio.run(_share(peer, jobs, sequential))))


def run_once(spec: dict) -> dict:
    peer = spec["peer"]
    dsn = fresh_database(os.environ["QQ_PG_URL"], f"qq_peer_{peer}")
    env = {**os.environ, "QQ_PEER": peer, "QQ_PG_DSN": dsn, "PYTHONPATH": str(HERE)}
    env.update(_libpq_env(dsn))
    os.environ.update({"QQ_PEER": peer, "QQ_PG_DSN": dsn})
    (install, worker), _ = worker_commands(peer)
    subprocess.run(install, cwd=HERE, env=env, check=True, capture_output=True)
    workers = [
        subprocess.Popen(
            worker, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    processes: list = []
    try:
        # The workers up and warm: 50 jobs answered one after another.
        warm(context, producer, peer, [("noop", (), 0)] * 50, True)
        shares, sequential, _, _ = plan(spec)
        go = [context.Event() for _ in shares]
        out = context.Queue()
        processes = [
            context.Process(target=producer, args=(peer, jobs, sequential, go[i], out, i))
            for i, jobs in enumerate(shares)
        ]
        for process in processes:
            process.start()
        time.sleep(1.0)  # imported and waiting
        with TreeMeter() as meter:
            by_share = go_and_collect(go, [0.0] * len(go), out, processes)
    finally:
        end(processes, workers)
    return {"by_share": by_share, "cpu_s": meter.cpu_s, "peak_rss": meter.peak_rss}


def _libpq_env(dsn: str) -> dict[str, str]:
    """The database as libpq's variables too: pgq's commands read them."""
    parts = urlsplit(dsn)
    return {
        "PGHOST": parts.hostname or "127.0.0.1",
        "PGPORT": str(parts.port or 5432),
        "PGUSER": parts.username or "postgres",
        "PGDATABASE": parts.path.lstrip("/"),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    _, settings = worker_commands(spec["peer"])
    runs = [run_once(spec) for _ in range(spec["reps"])]
    print(json.dumps({"runs": runs, "settings": settings}))


if __name__ == "__main__":
    main()
