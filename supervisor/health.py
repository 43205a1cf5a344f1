"""Whether a supervisor is healthy, for `queryqueue health` and `/healthz`: its store
answered the status query (which reads it), its pool has every worker it should, and its
event loop answered at all, within the prober's deadline. What it says names the problem,
never any data of the queue."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def problems(status: Mapping[str, Any]) -> list[str]:
    """What is wrong with a supervisor whose status (`QueueServer.describe`) is `status`:
    nothing, when it is healthy."""
    found = []
    pool = status.get("pool")
    if isinstance(pool, Mapping):
        alive, size = pool.get("alive"), pool.get("size")
        if isinstance(alive, int) and isinstance(size, int) and alive < size:
            found.append(f"the pool has {alive} of its {size} workers")
    return found
