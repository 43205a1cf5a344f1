"""Runs the io_bound workload on one peer, inside that peer's own virtual environment.

    <peer venv>/bin/python benchmarks/io_peer_runner.py '{"peer": "saq", "n": 2000, ...}'

Standalone (stdlib, psutil and the peer): it starts the peer's workers (2 processes x
32), spawns the request processes (each sends its share at once and records when each
result arrives), measures the workers' and Redis's memory with `measure.py`, stops every
process it started by pid, and prints one JSON object.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from measure import TreeMeter, redis_server_pids  # noqa: E402
from peer_runner import collect, end, warm  # noqa: E402

BIN = Path(sys.executable).parent
PER_WORKER = 32
POLL_S = 0.01  # how often a request process looks for its async peer's results


def worker_commands(peer: str) -> tuple[list[list[str]], dict[str, str]]:
    """The commands that start 2 worker processes running 32 tasks each."""
    if peer == "saq":
        command = [str(BIN / "saq"), "io_peer_tasks.settings", "--quiet"]
        return [command, command], {"workers": "2 x saq, concurrency 32 each"}
    if peer == "arq":
        command = [str(BIN / "arq"), "io_peer_tasks.WorkerSettings"]
        return [command, command], {"workers": "2 x arq"}
    if peer == "celery-threads":
        return [
            [
                str(BIN / "celery"), "-A", "io_peer_tasks", "worker", "-P", "threads", "-c",
                str(PER_WORKER), "-n", f"w{i}@%h", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "WARNING",
            ]
            for i in (1, 2)
        ], {"workers": "2 x celery worker -P threads -c 32"}  # fmt: skip
    if peer == "dramatiq-threads":
        command = [
            str(BIN / "dramatiq"), "io_peer_tasks", "--processes", "2", "--threads",
            str(PER_WORKER),
        ]  # fmt: skip
        return [command], {"workers": "dramatiq --processes 2 --threads 32"}
    raise SystemExit(f"unknown peer {peer}")


async def _async_share(peer: str, count: int, seconds: float, tag: str) -> list:
    """Enqueue the share at once, then look for every unfinished job's result in one
    round trip every POLL_S: for each job, when its result was first seen (saq's per-job
    wait missed a completion now and then and waited forever; arq's polls each job)."""
    import io_peer_tasks as tasks

    keys = [f"{tag}-{i}" for i in range(count)]
    started: dict[str, float] = {}
    if peer == "saq":
        from saq.job import TERMINAL_STATUSES

        queue = tasks.queue
        await queue.connect()

        async def enqueue(key: str) -> None:
            started[key] = time.time()
            await queue.enqueue("io_sleep", seconds=seconds, key=key)

        async def finished(waiting: list[str]) -> list[str]:
            jobs = await queue.jobs(waiting)
            return [
                k
                for k, job in zip(waiting, jobs, strict=True)
                if job is not None and job.status in TERMINAL_STATUSES
            ]

        close = queue.disconnect
    else:
        from arq import create_pool
        from arq.constants import result_key_prefix

        redis = await create_pool(tasks.WorkerSettings.redis_settings)

        async def enqueue(key: str) -> None:
            started[key] = time.time()
            await redis.enqueue_job("io_sleep", seconds, _job_id=key)

        async def finished(waiting: list[str]) -> list[str]:
            found = await redis.mget(*(result_key_prefix + k for k in waiting))
            return [k for k, value in zip(waiting, found, strict=True) if value is not None]

        close = redis.aclose
    try:
        await asyncio.gather(*(enqueue(key) for key in keys))
        ended: dict[str, float] = {}
        while len(ended) < count:
            await asyncio.sleep(POLL_S)
            now = time.time()
            for key in await finished([k for k in keys if k not in ended]):
                ended[key] = now
        return [(started[k], ended[k]) for k in keys]
    finally:
        await close()


def _sync_share(peer: str, count: int, seconds: float) -> list:
    import io_peer_tasks as tasks

    sent = []
    for _ in range(count):
        started = time.time()
        if peer == "celery-threads":
            sent.append((started, tasks.io_sleep.apply_async((seconds,))))
        else:
            sent.append((started, tasks.io_sleep.send(seconds)))
    records = []
    for started, handle in sent:  # in the order sent, as they finish
        if peer == "celery-threads":
            handle.get(timeout=600)
        else:
            handle.get_result(block=True, timeout=600_000)
        records.append((started, time.time()))
    return records


def producer(peer: str, count: int, seconds: float, tag: str, go, out, index: int) -> None:
    go.wait()
    if peer in ("saq", "arq"):
        records = asyncio.run(_async_share(peer, count, seconds, tag))
    else:
        records = _sync_share(peer, count, seconds)
    out.put((index, records))


def run_once(spec: dict, rep: int) -> dict:
    from redis import Redis

    peer = spec["peer"]
    env = {**os.environ, "QQ_PEER": peer, "PYTHONPATH": str(HERE)}
    os.environ["QQ_PEER"] = peer
    Redis.from_url(os.environ["QQ_REDIS_URL"]).flushdb()
    commands, _ = worker_commands(peer)
    workers = [
        subprocess.Popen(
            command, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for command in commands
    ]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    processes: list = []
    try:
        # The workers up and warm: a round of instant tasks answered.
        warm(context, producer, peer, 64, 0.0, f"w{rep}")
        producers = spec["producers"]
        go, out = context.Event(), context.Queue()
        processes = [
            context.Process(
                target=producer,
                args=(peer, spec["n"] // producers, spec["seconds"], f"r{rep}p{i}", go, out, i),
            )
            for i in range(producers)
        ]
        for process in processes:
            process.start()
        time.sleep(1.0)  # imported and waiting
        by_share = [[] for _ in processes]
        roots = [worker.pid for worker in workers]
        with TreeMeter(roots=roots, extra_pids=redis_server_pids()) as meter:
            go.set()
            for index, records in collect(out, processes):
                by_share[index] = records
    finally:
        end(processes, workers)
    return {"by_share": by_share, "peak_rss": meter.peak_rss}


def main() -> None:
    spec = json.loads(sys.argv[1])
    _, settings = worker_commands(spec["peer"])
    os.environ["QQ_PEER"] = spec["peer"]
    runs = [run_once(spec, rep) for rep in range(spec["reps"])]
    import io_peer_tasks

    print(json.dumps({"runs": runs, "settings": {**settings, **io_peer_tasks.SETTINGS}}))


if __name__ == "__main__":
    main()
