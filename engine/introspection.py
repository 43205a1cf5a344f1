"""What a queue can tell about its items: Cube's `getQueries` and `getQueryStage`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from queryqueue.engine.connection import QueryDef

if TYPE_CHECKING:
    from queryqueue.engine.queue import QueryQueue


async def get_queries(queue: QueryQueue) -> list[QueryDef]:
    """Every item of the queue with its statuses: orphaned, stalled, active, toProcess."""
    conn = queue.connection
    lists = await asyncio.gather(
        conn.get_orphaned_queries(),
        conn.get_stalled_queries(),
        conn.get_active_queries(),
        conn.get_to_process_queries(),
    )
    merged: dict[str, QueryDef] = {}
    for status, entries in zip(("orphaned", "stalled", "active", "toProcess"), lists, strict=True):
        for query_key_hash, queue_id in entries:
            if query_key_hash not in merged:
                query_def = await conn.get_query_def(query_key_hash, queue_id)
                if query_def is None:
                    continue
                # Cube's shape: `queryKey` is the hash, so cancel_query(entry["queryKey"])
                # cancels the entry (the caller's key is in the item's payload only).
                merged[query_key_hash] = {
                    **query_def,
                    "queryKey": query_key_hash,
                    "queryKeyHash": query_key_hash,
                    "queueId": queue_id,
                    "status": [],
                }
            merged[query_key_hash]["status"].append(status)
    return list(merged.values())


async def get_query_stage(
    queue: QueryQueue,
    stage_query_key: Any,
    priority_filter: int | None = None,
    stage_state: tuple[list[str], list[str], dict[str, QueryDef]] | None = None,
) -> dict[str, Any] | None:
    """`{"stage": "Executing query", "timeElapsed": ms}`, `{"stage": "#N in queue"}` or None."""
    active, to_process, defs = stage_state or await queue.fetch_query_stage_state()
    wanted = queue.hash_query_key(stage_query_key)
    for query_key_hash, query_def in defs.items():
        if query_def.get("stageQueryKey") is None:
            continue
        if queue.hash_query_key(query_def["stageQueryKey"]) != wanted:
            continue
        if priority_filter is not None and query_def.get("priority") != priority_filter:
            continue
        if query_key_hash in active:
            started = query_def.get("startQueryTime")
            return {
                "stage": "Executing query",
                "timeElapsed": None if started is None else queue.clock.now_ms() - started,
            }
        waiting = [
            h
            for h in to_process
            if priority_filter is None or defs.get(h, {}).get("priority") == priority_filter
        ]
        if query_key_hash in waiting:
            return {"stage": f"#{waiting.index(query_key_hash) + 1} in queue"}
        return None
    return None
