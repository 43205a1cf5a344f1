"""A worker as `queryqueue status` shows it: its pid, phase, memory and what it runs."""

from __future__ import annotations

from typing import Any

import psutil

from queryqueue.supervisor.core.slots import Job, Phase, Slots, Worker


def describe(worker: Worker, now: float) -> dict[str, Any]:
    """The worker process whose first lane is `worker`: `running` is the query it started
    first, `queries` every query it runs (one per busy lane)."""
    try:
        rss: int | None = int(psutil.Process(worker.process.pid).memory_info().rss)
    except (psutil.Error, ValueError):
        rss = None
    queries = [_running(lane.job, now) for lane in worker.lanes if lane.job is not None]
    queries.sort(key=lambda query: -(query["running_s"] or 0))
    phases = {lane.phase for lane in worker.lanes}
    state = next(
        (phase for phase in (Phase.DRAINING, Phase.RETIRING, Phase.BUSY) if phase in phases),
        Phase.IDLE,
    )
    return {
        "pid": worker.process.pid,
        "state": state.value,
        "busy": bool(queries),
        "concurrency": len(worker.lanes),
        "executed": Slots.executed(worker),
        "rss": rss,
        "running": queries[0] if queries else None,
        "queries": queries,
    }


def _running(job: Job, now: float) -> dict[str, Any]:
    started = job.started_at
    elapsed = None if started is None else now - started
    return {
        "path": job.path,
        "queue_id": job.queue_id,
        "handler": job.handler,
        "query_key": job.query_key,
        "priority": job.priority,
        "running_s": None if elapsed is None else round(elapsed, 3),
    }
