"""What the supervisor counts of the commands it serves: by kind, with their latency
(enqueue to answer) over recent samples, and its batches; `describe` and the status
page show it."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_LATENCY_SAMPLES = 2048


@dataclass
class _Kind:
    count: int = 0
    errors: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCY_SAMPLES))


class Stats:
    """Commands by kind and their latency (enqueue to answer, in ms) over recent samples."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.kinds: dict[str, _Kind] = {}
        self.batches = 0
        self.batched_commands = 0
        self.throttled = 0  # times a connection was not read until its client caught up
        self.purged = 0  # expired results the idle sweeps deleted
        self.purge_sweeps = 0  # sweeps that found any to delete

    def record(self, kind: str, seconds: float, ok: bool) -> None:
        entry = self.kinds.get(kind)
        if entry is None:  # not setdefault: that builds a _Kind (and its deque) every call
            entry = self.kinds[kind] = _Kind()
        entry.count += 1
        entry.errors += 0 if ok else 1
        entry.latencies.append(seconds * 1000)

    def swept(self, purged: int) -> None:
        if purged:
            self.purged += purged
            self.purge_sweeps += 1

    def snapshot(self) -> dict[str, Any]:
        uptime = time.monotonic() - self.started
        total = sum(k.count for k in self.kinds.values())
        return {
            "uptime_s": round(uptime, 3),
            "commands_total": total,
            "commands_per_s": round(total / uptime, 1) if uptime > 0 else 0.0,
            "batches": self.batches,
            "mean_batch": round(self.batched_commands / self.batches, 2) if self.batches else 0.0,
            "throttled": self.throttled,
            "purged": {"results": self.purged, "sweeps": self.purge_sweeps},
            "commands": {
                name: {
                    "count": k.count,
                    "errors": k.errors,
                    "p50_ms": _percentile(k.latencies, 0.50),
                    "p99_ms": _percentile(k.latencies, 0.99),
                }
                for name, k in sorted(self.kinds.items())
            },
        }


def _percentile(samples: deque[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
