"""The peers' task modules, in one file: imported inside each peer's own virtual
environment (never by queryqueue), configured by $QQ_PEER and $QQ_PEER_DIR.

Every setting that is not the library's default is listed in SETTINGS and printed with
the results.
"""
# mypy: ignore-errors
# ruff: noqa

from __future__ import annotations

import os

PEER = os.environ.get("QQ_PEER", "")
WORKDIR = os.environ.get("QQ_PEER_DIR", "/tmp")
REDIS_URL = os.environ.get("QQ_REDIS_URL", "redis://127.0.0.1:6379/0")
# redis-py 8 gives a connection a 5 s socket timeout unless told otherwise: a result wait
# longer than that (the priority burst's control arrivals wait seconds behind the backlog)
# ended in a read timeout and lost the round (RQ's forking worker lost 4 of 5). The waits
# ask for up to 600 s (peer_runner.wait); the socket allows a little more.
REDIS_SOCKET_TIMEOUT_S = 660
REDIS_SETTING = f"socket_timeout={REDIS_SOCKET_TIMEOUT_S} s (redis-py's 5 s ends long waits)"
SETTINGS: dict[str, str] = {}

if PEER.startswith("huey"):
    if PEER == "huey-sqlite":
        from huey import SqliteHuey

        huey = SqliteHuey("bench", filename=os.path.join(WORKDIR, "huey.db"))
        SETTINGS["storage"] = "SqliteHuey (its defaults: WAL, synchronous=NORMAL)"
    else:
        from huey import PriorityRedisHuey
        from redis import ConnectionPool

        pool = ConnectionPool.from_url(REDIS_URL, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
        huey = PriorityRedisHuey("bench", connection_pool=pool, notify_result=True)
        SETTINGS["storage"] = "PriorityRedisHuey(notify_result=True): priorities, pushed results"
        SETTINGS["redis"] = REDIS_SETTING

    @huey.task()
    def noop():
        return 1

    @huey.task()
    def sleep(seconds):
        import time

        time.sleep(seconds)
        return 1

elif PEER.startswith("rq"):
    from redis import Redis
    from rq import Queue

    redis = Redis.from_url(REDIS_URL, socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    SETTINGS["redis"] = REDIS_SETTING
    high = Queue("high", connection=redis)
    default = Queue("default", connection=redis)

    def noop():
        return 1

    def sleep(seconds):
        import time

        time.sleep(seconds)
        return 1

elif PEER == "celery":
    from celery import Celery

    celery = Celery("peer_tasks", broker=REDIS_URL, backend=REDIS_URL)
    celery.conf.broker_transport_options = {
        "priority_steps": list(range(10)),
        "queue_order_strategy": "priority",
    }
    celery.conf.worker_hijack_root_logger = False
    SETTINGS["broker_transport_options"] = "priority_steps 0-9, queue_order_strategy=priority"

    @celery.task
    def noop():
        return 1

    @celery.task
    def sleep(seconds):
        import time

        time.sleep(seconds)
        return 1

elif PEER == "dramatiq":
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.results import Results
    from dramatiq.results.backends import RedisBackend

    broker = RedisBroker(url=REDIS_URL)
    broker.add_middleware(Results(backend=RedisBackend(url=REDIS_URL)))
    dramatiq.set_broker(broker)
    SETTINGS["middleware"] = "Results(RedisBackend)"

    @dramatiq.actor(store_results=True, max_retries=0)
    def noop():
        return 1

    @dramatiq.actor(store_results=True, max_retries=0)
    def sleep(seconds):
        import time

        time.sleep(seconds)
        return 1
