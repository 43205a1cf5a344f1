"""What an ADD joins instead of inserting: the item already at its path (Cube Store's
dedup), or, asked for (`if_no_result`, our extension), a result of the path it may be
answered from. Every store asks these same rules of its own rows.
"""

from __future__ import annotations

from queryqueue.engine import validation as v
from queryqueue.engine.errors import ExternalIdConflictError
from queryqueue.engine.records import Item, ResultReuse, StoreTransaction
from queryqueue.engine.responses import QueueId
from queryqueue.engine.result_rules import reusable_result


def reuse_of(
    now: int, if_no_result: bool, max_age_ms: int | None, result_ttl_ms: int
) -> ResultReuse | None:
    """The reuse an ADD asks for. A result's age is told by its expiry: it was stored
    `result_ttl_ms` before it (the store's TTL, which every result of it was given)."""
    v.check_non_negative_ms("max_age_ms", max_age_ms, nullable=True)
    if not if_no_result:
        return None
    fresh_after = None if max_age_ms is None else now - max_age_ms + result_ttl_ms
    return ResultReuse(now, fresh_after)


def joined(tx: StoreTransaction, new: Item, reuse: ResultReuse | None) -> QueueId | None:
    """What an ADD of `new` joins: the item at its path, or with `reuse` the path's
    result it may be answered from; None when it inserts."""
    tx.expect_add(new, reuse)
    existing = find_for_add(tx, new)
    if existing is not None:
        return existing.id
    return None if reuse is None else reusable_result(tx, new, reuse.since, reuse.fresh_after)


def find_for_add(tx: StoreTransaction, new: Item) -> Item | None:
    """The item already at `new.path`, after applying the re-ADD rule; raises on an
    EXTERNAL_ID held by another item."""
    existing = tx.find(new.path)
    if existing is not None:
        if (
            existing.status == "pending"
            and existing.orphaned is not None
            and new.orphaned is not None
            and new.orphaned > existing.orphaned
        ):
            tx.set_orphaned(existing, new.orphaned)
        return existing
    if new.external_id is not None and tx.external_id_taken(new.external_id):
        raise ExternalIdConflictError(
            f"external id {new.external_id!r} is already used by another queued item"
        )
    return None
