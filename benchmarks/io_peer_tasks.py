"""The io_bound workload's task for each peer, in one file: imported inside each peer's
own virtual environment (never by queryqueue), chosen by $QQ_PEER. Every task waits
`seconds` as a network call would: asyncio.sleep where the peer runs coroutines,
time.sleep on its threads otherwise."""
# mypy: ignore-errors
# ruff: noqa

from __future__ import annotations

import asyncio
import os
import time

PEER = os.environ.get("QQ_PEER", "")
REDIS_URL = os.environ.get("QQ_REDIS_URL", "redis://127.0.0.1:6379/0")
PER_WORKER = int(os.environ.get("QQ_PER_WORKER", "32"))
SETTINGS: dict[str, str] = {}

if PEER == "saq":
    from saq import Queue

    queue = Queue.from_url(REDIS_URL)

    async def io_sleep(ctx, *, seconds):
        await asyncio.sleep(seconds)
        return 1

    settings = {"queue": queue, "functions": [io_sleep], "concurrency": PER_WORKER}
    SETTINGS["results"] = "one queue.jobs() of every unfinished job per 10 ms"

elif PEER == "arq":
    from arq.connections import RedisSettings

    async def io_sleep(ctx, seconds):
        await asyncio.sleep(seconds)
        return 1

    class WorkerSettings:
        functions = [io_sleep]
        redis_settings = RedisSettings.from_dsn(REDIS_URL)
        max_jobs = PER_WORKER
        # Its default polls the queue every 0.5 s: 10 ms as we give Huey's SQLite.
        poll_delay = 0.01

    SETTINGS["worker"] = "max_jobs=32, poll_delay=0.01 (default 0.5)"
    SETTINGS["results"] = "one MGET of every unfinished job's result key per 10 ms"

elif PEER == "celery-threads":
    from celery import Celery

    celery = Celery("io_peer_tasks", broker=REDIS_URL, backend=REDIS_URL)
    celery.conf.worker_hijack_root_logger = False
    celery.conf.worker_prefetch_multiplier = 1

    @celery.task
    def io_sleep(seconds):
        time.sleep(seconds)
        return 1

    SETTINGS["prefetch"] = "worker_prefetch_multiplier=1"

elif PEER == "dramatiq-threads":
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.results import Results
    from dramatiq.results.backends import RedisBackend

    broker = RedisBroker(url=REDIS_URL)
    broker.add_middleware(Results(backend=RedisBackend(url=REDIS_URL)))
    dramatiq.set_broker(broker)
    SETTINGS["middleware"] = "Results(RedisBackend)"

    @dramatiq.actor(store_results=True, max_retries=0)
    def io_sleep(seconds):
        time.sleep(seconds)
        return 1
