"""Who may read which result: the rules RESULT, RESULT_BLOCKING and ADD's `if_no_result`
(with its `max_age_ms`) share. Cube Store's: by path a result is consumed by its first
read; by queue id or by external id it reads many times while it lives."""

from __future__ import annotations

from queryqueue.engine.records import Item, StoreTransaction, result_response
from queryqueue.engine.responses import QueueId, QueueKey, ResultResponse

# How a result stored in shared memory starts: its value is a reference to the bytes
# (`{"$shm": name, ...}`), which live while it is unread or being read.
SHARED_REFERENCE_MARK = '{"$shm":'


def lookup_result(
    tx: StoreTransaction,
    key: QueueKey,
    external_id: str | None,
    now: int,
    consumer: str | None = None,
) -> ResultResponse | None:
    if external_id is not None:
        found = tx.latest_result_by_external_id(external_id, now)
        if found is not None:
            # Read-many, as in Cube Store: the by-path result stays for its reader.
            return result_response(found)
    if isinstance(key, int):
        found = tx.result_by_id(key, now)
        return None if found is None else result_response(found)
    else:
        found = tx.latest_result_by_path(key, now)
        if found is None:
            return None
        if found.deleted:
            # Consumed: only the very read that consumed it may have it again.
            if consumer is None or found.consumed_by != consumer:
                return None
            return result_response(found)
        if external_id is not None and found.external_id not in (None, external_id):
            return None
        tx.mark_result_consumed(found.id, consumer)
        return result_response(found)


def blocking_lookup(tx: StoreTransaction, key: QueueKey, now: int) -> ResultResponse | None:
    """RESULT_BLOCKING's first look: RESULT's rules, except that a waiter by id takes the
    path result as it does when woken, so whether the ACK came before or after it
    subscribed makes no difference. Watched first: an ACK elsewhere after the look
    tells this process."""
    tx.watch(key, now)
    found = lookup_result(tx, key, None, now)
    if found is not None and isinstance(key, int):
        tx.mark_result_consumed(found.id)
    return found


def reusable_result(
    tx: StoreTransaction, new: Item, now: int, fresh_after: int | None = None
) -> QueueId | None:
    """The id of `new.path`'s latest result if nobody has read it yet, or if it was read
    but expires after `fresh_after` (it is young enough for the caller), and it may be
    served to `new`'s external id. A result read already whose bytes are in shared memory
    is not: its segment went back to the pool with the read."""
    found = tx.latest_result_by_path(new.path, now)
    if found is None:
        return None
    if found.deleted and (
        fresh_after is None
        or found.expire <= fresh_after
        or found.value.startswith(SHARED_REFERENCE_MARK)
    ):
        return None
    if new.external_id is not None and found.external_id not in (None, new.external_id):
        return None
    return found.id
