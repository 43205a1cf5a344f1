"""The queue store contract: Cube Store's QUEUE command set, and the one algorithm behind it.

`QueueStore` owns the rules of every command (validation, dedup, concurrency, visibility,
orphaned/stalled, result consumption, wake-ups). A concrete store only provides
persistence: `_atomic()` yields a `StoreTransaction` (records.py) whose small hooks read
and write items, counters and results, so every store has the same semantics by
construction and one conformance suite checks them all. Every command is one atomic
transaction; bad input raises `InvalidCommandError` before anything is written. Cube
Store's semantics, but for the differences the documentation's Cube compatibility page
lists. Listings: listing.py; the pool's step: retrieve_next.py.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from queryqueue.engine import validation as v
from queryqueue.engine.add_rules import joined as joined_by
from queryqueue.engine.add_rules import reuse_of
from queryqueue.engine.aio import wait_within
from queryqueue.engine.clock import Clock, SystemClock
from queryqueue.engine.commands import queue_command
from queryqueue.engine.errors import (
    ExclusiveAccessError,
    InvalidCommandError,
)
from queryqueue.engine.group_commit import GroupCommit
from queryqueue.engine.lanes import OffLoop
from queryqueue.engine.listing import ListingCommands
from queryqueue.engine.maintenance import MaintenanceCommands
from queryqueue.engine.records import (
    Item,
    StoredResult,
    StoreTransaction,
    active_at_once,
    merge_extra_json,
    new_item,
    with_start_query_time,
)
from queryqueue.engine.responses import (
    AckResponse,
    AddAndRetrieveResponse,
    AddToQueueResponse,
    QueryDefResponse,
    QueueKey,
    ResultResponse,
    ResultStatus,
    RetrieveResponse,
)
from queryqueue.engine.result_rules import blocking_lookup, lookup_result
from queryqueue.engine.retrieve_next import RetrieveNext
from queryqueue.engine.upkeep import Upkeep
from queryqueue.engine.waiters import AckEvent, ResultWaiters, SlotWatchers, Waiter

T = TypeVar("T")
DEFAULT_RESULT_TTL_MS = 5 * 60 * 1000


class QueueStore(GroupCommit, OffLoop, ListingCommands, MaintenanceCommands, RetrieveNext, Upkeep):
    """The QUEUE command set. Subclasses implement `_atomic()` and `close()` only."""

    shared = False  # read by other hosts' supervisors too (results must live in it)

    def __init__(
        self, *, clock: Clock | None = None, result_ttl_ms: int = DEFAULT_RESULT_TTL_MS
    ) -> None:
        if result_ttl_ms <= 0:
            raise ValueError("result_ttl_ms must be positive")
        self.clock: Clock = clock or SystemClock()
        self.result_ttl_ms = result_ttl_ms
        self.waiters = ResultWaiters()
        self.slot_watchers = SlotWatchers()  # told once an ACK or CANCEL committed

    @abstractmethod
    def _atomic(self) -> AbstractContextManager[StoreTransaction]:
        """One atomic, serialized transaction; rolled back if the block raises."""

    @abstractmethod
    def close(self) -> None: ...

    def _run_command(self, run: Callable[[], T]) -> T:
        """Every command runs through here (the command table's decorator): a store that
        must re-run a command on a fresh connection overrides this, nothing else."""
        return run()

    def _after_commit(self, effect: Callable[[], object]) -> None:
        """Run `effect` once the current command's changes are committed."""
        effect()

    # -- QUEUE ADD / ADD_AND_RETRIEVE -------------------------------------------------

    @queue_command(response=AddToQueueResponse, take_process_id=True, resend="always", adds=True)
    def add(
        self,
        path: str,
        payload: str,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
    ) -> AddToQueueResponse:
        """QUEUE ADD [EXCLUSIVE] [PRIORITY n] [ORPHANED s] [EXTERNAL_ID e] path payload.

        `if_no_result` (our extension; Cube clients never send it): a result of the path
        that nobody has read yet answers instead, as a joined item (`added` False, its
        id), so a caller whose RESULT came just before the ACK runs nothing twice. With
        `max_age_ms`, so does one read already if it was stored within that many ms
        (kept in shared memory, it is not: see `reusable_result`)."""
        new = new_item(
            path,
            payload,
            priority,
            orphaned,
            external_id,
            exclusive,
            process_id,
            self.clock.now_ms(),
        )
        reuse = reuse_of(new.created, if_no_result, max_age_ms, self.result_ttl_ms)
        with self._atomic() as tx:
            joined = joined_by(tx, new, reuse)
            if joined is not None:
                pending, _ = tx.counts(new.prefix)
                return AddToQueueResponse(id=joined, added=False, pending=pending)
            pending, _ = tx.counts(new.prefix)
            queue_id = tx.insert(new)
            return AddToQueueResponse(id=queue_id, added=True, pending=pending + 1)

    @queue_command(response=AddAndRetrieveResponse, take_process_id=True, adds=True)
    def add_and_retrieve(
        self,
        path: str,
        payload: str,
        concurrency: int,
        *,
        priority: int = 0,
        orphaned: float | None = None,
        external_id: str | None = None,
        exclusive: bool = False,
        process_id: str | None = None,
        if_no_result: bool = False,
        max_age_ms: int | None = None,
        start_query_time: int | None = None,
        list_active: bool = True,
    ) -> AddAndRetrieveResponse:
        """QUEUE ADD_AND_RETRIEVE ... path payload concurrency: insert, then retrieve if the
        prefix has a slot for it and for everything already pending (`start_query_time`
        as RETRIEVE's, for the item it retrieves). `list_active` False (our extension): no
        listing of the prefix's active keys in the answer, for a caller that reads none."""
        new = new_item(
            path,
            payload,
            priority,
            orphaned,
            external_id,
            exclusive,
            process_id,
            self.clock.now_ms(),
        )
        reuse = reuse_of(new.created, if_no_result, max_age_ms, self.result_ttl_ms)
        v.check_concurrency(concurrency)
        v.check_non_negative_ms("start_query_time", start_query_time, nullable=True)
        v.check_bool("list_active", list_active)
        with self._atomic() as tx:
            joined = joined_by(tx, new, reuse)
            pending, active = tx.counts(new.prefix)
            retrieved: str | None = None
            if joined is not None:
                queue_id = joined
            elif active + pending < concurrency:
                # A fresh item is always visible to its adder (EXCLUSIVE needs its process
                # id); retrieved, it goes straight to active and never counts as pending.
                extra = with_start_query_time(None, start_query_time)
                queue_id = tx.insert(active_at_once(new, extra))
                retrieved = new.payload
            else:
                queue_id = tx.insert(new)
                pending += 1
            return AddAndRetrieveResponse(
                id=queue_id,
                added=joined is None,
                pending=pending,
                active=_join(tx.active_keys(new.prefix)) if list_active else None,
                payload=retrieved,
                extra=None,
            )

    # -- QUEUE RETRIEVE ----------------------------------------------------------------

    @queue_command(response=RetrieveResponse, take_process_id=True)
    def retrieve(
        self,
        key: QueueKey,
        *,
        concurrency: int = 1,
        extended: bool = True,
        process_id: str | None = None,
        start_query_time: int | None = None,
    ) -> RetrieveResponse | None:
        """QUEUE RETRIEVE [EXTENDED] CONCURRENCY n key: move a pending item to active.

        Priority-blind: the caller picks the item. Fails (None, or with `extended` a row
        whose payload and id are None) when the prefix has `concurrency` active items, the
        item is missing or already active, or it is another process's exclusive item.

        `start_query_time` (our extension): the retrieving write merges it into extra as
        `startQueryTime`, as Cube's processQuery does next; the answer's extra is as it was.
        """
        v.check_key(key)
        v.check_concurrency(concurrency)
        v.check_process_id(process_id)
        v.check_non_negative_ms("start_query_time", start_query_time, nullable=True)
        now = self.clock.now_ms()
        with self._atomic() as tx:
            item = tx.find(key, with_payload=True)
            prefix = item.prefix if item is not None else _prefix_of(key)
            if prefix is None:
                pending, active_keys = 0, []
            else:
                pending, _ = tx.counts(prefix)
                active_keys = tx.active_keys(prefix)
            retrievable = (
                item is not None
                and len(active_keys) < concurrency
                and item.status == "pending"
                and self._may_retrieve(item, process_id)
            )
            if not retrievable or item is None:
                if not extended:
                    return None
                return RetrieveResponse(
                    payload=None, extra=None, pending=pending, active=_join(active_keys), id=None
                )
            tx.activate(item, now, with_start_query_time(item.extra, start_query_time))
            return RetrieveResponse(
                payload=item.payload,
                extra=item.extra,
                pending=pending - 1,
                active=_join(tx.active_keys(item.prefix)),
                id=item.id,
            )

    @staticmethod
    def _may_retrieve(item: Item, process_id: str | None) -> bool:
        if not item.exclusive:
            return True
        if process_id is None:
            raise ExclusiveAccessError(
                f"item {item.path!r} is EXCLUSIVE; RETRIEVE needs the caller's process id"
            )
        return item.process_id == process_id

    # -- QUEUE ACK / RESULT / RESULT_BLOCKING ------------------------------------------

    @queue_command(response=AckResponse, resend="by_id", frees_slot=True)
    def ack(self, key: QueueKey, result: str | None) -> AckResponse:
        """QUEUE ACK key result|NULL: remove the item (any status), keep its result, and
        wake every RESULT_BLOCKING waiter of it. Unknown or already acked → success False."""
        v.check_key(key)
        v.check_json("result", result, nullable=True)
        with self._atomic() as tx:
            item = tx.find(key)
            if item is None:
                return AckResponse(success=False)
            self._complete(tx, item, result)
        return AckResponse(success=True)

    def _complete(self, tx: StoreTransaction, item: Item, result: str | None) -> None:
        """Remove `item` with `result` as its outcome: kept for readers, and every
        RESULT_BLOCKING waiter woken once it is committed."""
        now = self.clock.now_ms()
        tx.delete(item)
        # A waiter by id takes the result as it wakes: taken here, waking costs no transaction
        # (claimed: timing out meanwhile on a blocking store's loop, it waits for this).
        taken = result is not None and self.waiters.claim(item.id)
        if result is not None:
            tx.insert_result(
                StoredResult(
                    id=item.id,
                    path=item.path,
                    value=result,
                    deleted=taken,
                    expire=now + self.result_ttl_ms,
                    external_id=item.external_id,
                )
            )
        self._purge_when_due(tx, now)
        tx.acked(item, result)
        event = AckEvent(item.id, item.path, result, item.external_id, taken)
        # Decide, then act: waiters are woken only once the result is committed.
        self._after_commit(lambda: self.waiters.publish(event))
        self._after_commit(self.slot_watchers.publish)

    def watch_slots(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback`, on the running loop, after every ACK or CANCEL (for processes
        that alone may retrieve some items, their streams); returns what stops it."""
        return self.slot_watchers.add(callback)

    @queue_command(response=ResultResponse, resend="by_id")
    def result(
        self, key: QueueKey, *, external_id: str | None = None, consumer: str | None = None
    ) -> ResultResponse | None:
        """QUEUE RESULT [EXTERNAL_ID e] key.

        By external id or by queue id a result reads many times while it lives; by path it
        is consumed by the first read. A path result created for another external id is not
        served to a caller that names its own.

        `consumer` (our extension) is a token naming this read: a path result consumed by
        the same token is served again, so a client can safely re-send a read whose answer
        it lost (a supervisor crash between commit and reply).
        """
        v.check_key(key)
        v.check_external_id(external_id)
        if consumer is not None and (not isinstance(consumer, str) or not 0 < len(consumer) <= 64):
            raise InvalidCommandError("consumer must be a string of 1 to 64 characters")
        with self._atomic() as tx:
            return lookup_result(tx, key, external_id, self.clock.now_ms(), consumer)

    @queue_command(response=ResultResponse, resend="by_id")
    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        """QUEUE RESULT_BLOCKING timeout key: RESULT, or wait up to `timeout_ms` for the ACK.
        The waiter subscribes before it reads, so an ACK in between is never missed. An ACK
        with NULL answers a row whose payload is None; a timeout answers None."""
        found, waiter = self.result_blocking_start(key, timeout_ms)
        return found if waiter is None else await self.result_blocking_wait(key, timeout_ms, waiter)

    async def result_blocking_wait(
        self, key: QueueKey, timeout_ms: int, waiter: Waiter
    ) -> ResultResponse | None:
        """After the first half found nothing: the ACK's answer, or None at the timeout."""
        try:
            event = await wait_within(waiter.future, timeout_ms / 1000)
        except TimeoutError:
            return None
        finally:
            self.waiters.unsubscribe(waiter)
        return self.result_blocking_woken(key, event)

    def result_blocking_start(
        self, key: QueueKey, timeout_ms: int
    ) -> tuple[ResultResponse | None, Waiter | None]:
        """RESULT_BLOCKING's first half (a server runs it in a batch): subscribe, then look.
        The result found, or the waiter to await, unsubscribe and pass to `..._woken`."""
        v.check_key(key)
        v.check_non_negative_ms("timeout", timeout_ms)
        waiter = self.waiters.subscribe(key)
        try:
            with self._atomic() as tx:
                found = blocking_lookup(tx, key, self.clock.now_ms())
        except BaseException:
            self.waiters.unsubscribe(waiter)
            raise
        if found is not None:
            self.waiters.unsubscribe(waiter)
            return found, None
        return None, waiter

    def result_blocking_woken(self, key: QueueKey, event: AckEvent) -> ResultResponse:
        """RESULT_BLOCKING's second half: the ACK that woke the waiter, as its answer."""
        if event.result is not None and not (event.taken and isinstance(key, int)):
            with self._atomic() as tx:
                # Cube Store: a waiter by path takes the row, a waiter by id leaves it readable.
                if isinstance(key, int):
                    tx.mark_result_consumed(event.id)
                else:
                    tx.delete_result(event.id)
        return ResultResponse(
            payload=event.result,
            type=ResultStatus.SUCCESS,
            id=event.id,
            external_id=event.external_id,
        )

    # -- QUEUE GET / CANCEL / HEARTBEAT / MERGE_EXTRA / TRUNCATE ----------------------

    @queue_command(response=QueryDefResponse, resend="always")
    def get(self, key: QueueKey) -> QueryDefResponse | None:
        v.check_key(key)
        with self._atomic() as tx:
            item = tx.find(key, with_payload=True)
        if item is None or item.payload is None:
            return None
        return QueryDefResponse(payload=item.payload, extra=item.extra)

    @queue_command(response=QueryDefResponse, resend="by_id", frees_slot=True)
    def cancel(self, key: QueueKey, *, result: str | None = None) -> QueryDefResponse | None:
        """QUEUE CANCEL key: remove a pending or active item. No result, no wake-up.

        `result` (our extension; Cube Store has none) is the cancelled query's outcome: it
        is kept and answers every waiter as an ACK's would, in the same transaction, so
        callers learn of the cancellation instead of waiting it out and running it again."""
        v.check_key(key)
        v.check_json("result", result, nullable=True)
        with self._atomic() as tx:
            item = tx.find(key, with_payload=True)
            if item is None or item.payload is None:
                return None
            if result is None:
                tx.delete(item)
                self._after_commit(self.slot_watchers.publish)
            else:
                self._complete(tx, item, result)
        return QueryDefResponse(payload=item.payload, extra=item.extra)

    @queue_command(resend="always")
    def heartbeat(self, key: QueueKey) -> bool:
        """QUEUE HEARTBEAT key. Returns whether the item exists (Cube Store answers nothing)."""
        v.check_key(key)
        now = self.clock.now_ms()
        with self._atomic() as tx:
            item = tx.find(key)
            if item is None:
                return False
            tx.set_heartbeat(item, now)
            return True

    @queue_command(resend="always")
    def merge_extra(self, key: QueueKey, extra: str) -> bool:
        """QUEUE MERGE_EXTRA key json: shallow-merge two JSON objects (new keys win); a JSON
        null clears extra; anything else replaces it. Returns whether the item exists."""
        v.check_key(key)
        v.check_json("extra", extra)
        with self._atomic() as tx:
            item = tx.find(key)
            if item is None:
                return False
            tx.set_extra(item, merge_extra_json(item.extra, extra))
            return True


def _join(keys: list[str]) -> str | None:
    return ",".join(keys) if keys else None


def _prefix_of(key: QueueKey) -> str | None:
    return key.rpartition(":")[0] if isinstance(key, str) else None
