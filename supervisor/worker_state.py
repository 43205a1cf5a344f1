"""A worker as `queryqueue status` shows it: its pid, phase, memory and what it runs."""

from __future__ import annotations

from typing import Any

import psutil

from queryqueue.supervisor.core.slots import Worker


def describe(worker: Worker, now: float) -> dict[str, Any]:
    job = worker.job
    try:
        rss: int | None = int(psutil.Process(worker.process.pid).memory_info().rss)
    except (psutil.Error, ValueError):
        rss = None
    running = None
    if job is not None:
        started = job.started_at
        elapsed = None if started is None else now - started
        running = {
            "path": job.path,
            "queue_id": job.queue_id,
            "handler": job.handler,
            "query_key": job.query_key,
            "priority": job.priority,
            "running_s": None if elapsed is None else round(elapsed, 3),
        }
    return {
        "pid": worker.process.pid,
        "state": worker.phase.value,
        "busy": job is not None,
        "executed": worker.executed,
        "rss": rss,
        "running": running,
    }
