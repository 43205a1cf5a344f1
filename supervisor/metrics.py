"""What a supervisor has done, for Prometheus (`/metrics`) and the status page.

Counters and histograms live in a registry of this supervisor's own (no global state);
the server feeds them from the answers it sends (an ADD that joined an item is a dedup
hit, an ACK's outcome says ok / error / timeout / cancelled), the queue state is read
fresh at each scrape. Only a supervisor started with `--http` has one: without it the
hot path pays nothing. `prometheus_client` is the `http` extra.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from queryqueue.driver_socket.segments import parse_reference
from queryqueue.engine.responses import AddAndRetrieveResponse

RECENT = 50  # completions and errors kept for the status page
SERIES_STEP_S = 10  # one point of the throughput and latency charts per 10 s
SERIES_POINTS = 60  # ten minutes of them
_RUN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
_COMMAND_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Point:
    at: float  # start of the step, epoch s
    completed: int = 0
    errors: int = 0
    run_s_total: float = 0.0
    wait_s_total: float = 0.0


def outcome_of(result: Any) -> str:
    """An ACK's outcome as a label: ok, error, timeout, cancelled or retry. Only error
    outcomes (small) are parsed; a result is known by its first bytes."""
    if result is None or not isinstance(result, str) or parse_reference(result) is not None:
        return "ok"
    if result.startswith('{"result"') or result.startswith('{"$binary"'):
        return "ok"
    try:
        decoded = orjson.loads(result)
    except orjson.JSONDecodeError:
        return "ok"
    if not isinstance(decoded, dict) or "error" not in decoded:
        return "ok"
    if decoded.get("retry") is True:
        return "retry"
    return {"QueryTimeoutError": "timeout", "QueryCancelledError": "cancelled"}.get(
        str(decoded.get("errorType")), "error"
    )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.executions = Counter(
            "queryqueue_executions",
            "Queries that ended (ACKed), by outcome: ok, error, timeout, cancelled, retry",
            ["prefix", "outcome"],
            registry=r,
        )
        self.dedup_hits = Counter(
            "queryqueue_dedup_hits",
            "ADDs that joined an item already queued or running (no new execution)",
            ["prefix"],
            registry=r,
        )
        self.added = Counter("queryqueue_added", "New queue items", ["prefix"], registry=r)
        fast_track = "Queries added and retrieved in one command (run at once, no queueing)"
        self.fast_track_hits = Counter(
            "queryqueue_fast_track_hits", fast_track, ["prefix"], registry=r
        )
        retried = "Handler attempts run again after a transient failure (a handler's retries=)"
        self.retries = Counter("queryqueue_retries", retried, ["prefix", "handler"], registry=r)
        self.cancellations = Counter(
            "queryqueue_cancellations", "Items removed by CANCEL", ["prefix"], registry=r
        )
        self.wait_seconds = Histogram(
            "queryqueue_wait_seconds",
            "From queued to sent to a worker",
            ["prefix", "handler"],
            buckets=_RUN_BUCKETS,
            registry=r,
        )
        self.run_seconds = Histogram(
            "queryqueue_run_seconds",
            "From sent to a worker to ACKed",
            ["prefix", "handler"],
            buckets=_RUN_BUCKETS,
            registry=r,
        )
        self.command_seconds = Histogram(
            "queryqueue_command_seconds",
            "Supervisor commands, received to answered",
            ["command"],
            buckets=_COMMAND_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "queryqueue_batch_size",
            "Commands run in one store batch",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.state = _StateCollector()
        r.register(self.state)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.recent_errors: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.series: deque[_Point] = deque(maxlen=SERIES_POINTS)

    # -- fed by the server ------------------------------------------------------------------

    def answered(self, method: str, args: list[Any], answer: Any, seconds: float) -> None:
        """A command's successful answer."""
        self.command_seconds.labels(method).observe(seconds)
        prefix = _prefix(args)
        if prefix is None:
            return
        if method in ("add", "add_and_retrieve"):
            added = getattr(answer, "added", None)
            if added is False:
                self.dedup_hits.labels(prefix).inc()
            elif added:
                self.added.labels(prefix).inc()
            if isinstance(answer, AddAndRetrieveResponse) and answer.fast_tracked:
                self.fast_track_hits.labels(prefix).inc()
        elif method == "cancel" and answer is not None:
            self.cancellations.labels(prefix).inc()

    def retried(self, path: str, handler: str) -> None:
        """A worker said its query's handler runs again (its item's extra has `attempt`)."""
        self.retries.labels(path.rpartition(":")[0] or path, handler).inc()

    def failed(self, method: str, seconds: float) -> None:
        self.command_seconds.labels(method).observe(seconds)

    def batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def acked(self, path: str, result: Any, job: Any | None) -> None:
        """An ACK that removed its item. `job` is the pool's, when a worker ran it: it
        knows the handler and when the query was queued and sent."""
        prefix = path.rpartition(":")[0] or path
        outcome = outcome_of(result)
        self.executions.labels(prefix, outcome).inc()
        now_ms = time.time() * 1000
        handler = getattr(job, "handler", "") or ""
        wait_s = run_s = None
        if job is not None and job.sent_ms is not None:
            run_s = max(0.0, (now_ms - job.sent_ms) / 1000)
            self.run_seconds.labels(prefix, handler).observe(run_s)
            if job.added_ms is not None:
                wait_s = max(0.0, (job.sent_ms - job.added_ms) / 1000)
                self.wait_seconds.labels(prefix, handler).observe(wait_s)
        entry = {
            "at": round(now_ms / 1000, 3),
            "path": path,
            "prefix": prefix,
            "query_key": getattr(job, "query_key", None),
            "handler": handler or None,
            "outcome": outcome,
            "run_s": None if run_s is None else round(run_s, 4),
            "wait_s": None if wait_s is None else round(wait_s, 4),
        }
        self.recent.appendleft(entry)
        if outcome not in ("ok", "retry"):
            self.recent_errors.appendleft({**entry, "error": _error_text(result)})
        point = self._point(now_ms / 1000)
        point.completed += 1
        point.errors += outcome not in ("ok", "retry")
        point.run_s_total += run_s or 0.0
        point.wait_s_total += wait_s or 0.0

    def _point(self, now: float) -> _Point:
        at = now - now % SERIES_STEP_S
        if not self.series or self.series[-1].at < at:
            self.series.append(_Point(at))
        return self.series[-1]

    def chart(self) -> list[dict[str, Any]]:
        """Throughput (per s) and mean run time per step, oldest first, gaps as zeros."""
        self._point(time.time())
        return [
            {
                "at": p.at,
                "per_s": round(p.completed / SERIES_STEP_S, 3),
                "errors": p.errors,
                "mean_run_ms": round(1000 * p.run_s_total / p.completed, 2)
                if p.completed
                else None,
                "mean_wait_ms": round(1000 * p.wait_s_total / p.completed, 2)
                if p.completed
                else None,
            }
            for p in self.series
        ]


class _StateCollector(Collector):
    """Gauges read from a status snapshot taken just before the scrape (the store is read
    off the loop for it, so nothing here waits)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.snapshot
        store = status  # the store's part of the status is at its top level
        for name, doc, field in (
            ("queryqueue_pending", "Items waiting for a slot", "pending"),
            ("queryqueue_active", "Items running (holding a slot)", "active"),
            ("queryqueue_oldest_age_seconds", "Age of the oldest item", "oldest_age_ms"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["prefix"])
            for row in store.get("prefixes", []):
                value = row.get(field)
                if value is not None:
                    scale = 1000 if field.endswith("_ms") else 1
                    gauge.add_metric([row["prefix"]], value / scale)
            yield gauge
        yield _gauge(
            "queryqueue_results_held", "Results kept for readers", store.get("results_held")
        )
        yield _gauge(
            "queryqueue_long_polls", "Parked RESULT_BLOCKING waiters", store.get("waiters")
        )
        pool = status.get("pool") or {}
        yield _budget(pool)
        yield _gauge("queryqueue_workers_alive", "Worker processes alive", pool.get("alive"))
        yield _gauge("queryqueue_workers_size", "Worker processes wanted", pool.get("size"))
        for name, doc, field in (
            ("queryqueue_worker_restarts", "Workers replaced after dying", "replaced"),
            ("queryqueue_worker_kills", "Workers terminated by the supervisor", "terminated"),
            ("queryqueue_worker_recycles", "Workers retired (task or memory limit)", "recycled"),
            ("queryqueue_reclaimed_items", "Items given back after their worker died", "reclaimed"),
        ):
            yield _gauge(name, doc, pool.get(field))
        shm = status.get("shared_memory") or {}
        yield _gauge(
            "queryqueue_shm_bytes", "Shared memory held by result segments", shm.get("bytes")
        )
        files = status.get("files") or {}
        yield _gauge(
            "queryqueue_db_bytes", "Size of the SQLite database file", files.get("db_bytes")
        )
        yield _gauge("queryqueue_wal_bytes", "Size of the SQLite WAL file", files.get("wal_bytes"))
        # SQLite FULL in a supervisor (syncer.py): the WAL is synced when an answer waits
        # for a commit (commits nobody waits for wait for the next sync or checkpoint).
        wal = status.get("wal") or {}
        for name, doc, field in (
            ("queryqueue_wal_syncs", "WAL fsyncs made for answers (FULL)", "wal_syncs"),
            (
                "queryqueue_commits_unsynced",
                "Commits since the last WAL fsync (FULL)",
                "commits_unsynced",
            ),
            (
                "queryqueue_answers_held_for_sync",
                "Answers that waited for a WAL fsync (FULL)",
                "answers_held_for_sync",
            ),
        ):
            yield _gauge(name, doc, wal.get(field))
        yield _gauge("queryqueue_connections", "Client connections", status.get("connections"))


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc)
    if isinstance(value, int | float) and not isinstance(value, bool):
        gauge.add_metric([], value)
    return gauge


def _prefix(args: list[Any]) -> str | None:
    if args and isinstance(args[0], str) and ":" in args[0]:
        return args[0].rpartition(":")[0]
    return None


def _error_text(result: Any) -> str | None:
    try:
        decoded = orjson.loads(result)
    except (orjson.JSONDecodeError, TypeError):
        return None
    return str(decoded.get("error"))[:500] if isinstance(decoded, dict) else None


def _budget(pool: dict[str, Any]) -> GaugeMetricFamily:
    """The concurrency of the queue the pool runs: the supervisor's, whatever callers send."""
    gauge = GaugeMetricFamily(
        "queryqueue_budget", "Concurrency of the queue the pool runs", labels=["prefix"]
    )
    for prefix, concurrency in (pool.get("budget") or {}).items():
        gauge.add_metric([prefix], concurrency)
    return gauge
