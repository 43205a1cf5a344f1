"""What a store keeps, and the hooks it implements: items and results as the rules see
them, the row shapes SQL stores read them in, and `StoreTransaction`, the persistence seam
every store fills in (`QueueStore` in `store.py` holds the rules)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from queryqueue.engine import validation as v
from queryqueue.engine.errors import InvalidCommandError
from queryqueue.engine.responses import ItemStatus, QueueId, QueueKey, ResultResponse, ResultStatus


@dataclass(frozen=True, slots=True)
class Item:
    """One queue item as stored. `payload` is only loaded when asked for."""

    id: QueueId
    prefix: str
    key: str
    status: ItemStatus
    priority: int
    created: int
    heartbeat: int | None
    orphaned: int | None  # absolute deadline in ms, only when ADD gave ORPHANED
    extra: str | None
    process_id: str | None
    exclusive: bool
    external_id: str | None
    payload: str | None = None

    @property
    def path(self) -> str:
        return f"{self.prefix}:{self.key}"


@dataclass(frozen=True, slots=True)
class StoredResult:
    id: QueueId
    path: str
    value: str
    deleted: bool
    expire: int
    external_id: str | None
    consumed_by: str | None = None  # the token of the RESULT-by-path read that consumed it


# SQL stores read items and results in these column orders, and map rows back here.
ITEM_COLUMNS = (
    "id, prefix, key, status, priority, created, heartbeat, orphaned, extra, process_id, "
    "exclusive, external_id"
)
RESULT_COLUMNS = "id, path, value, deleted, expire, external_id, consumed_by"
STATUS_CODE: dict[ItemStatus, int] = {"pending": 0, "active": 1}
STATUS_NAME: dict[int, ItemStatus] = {0: "pending", 1: "active"}
# What an INSERT of a new item writes (the store gives it its id), as `inserted_values`.
INSERTED_COLUMNS = (
    "prefix, key, status, priority, created, heartbeat, orphaned, extra, process_id,"
    " exclusive, external_id, payload"
)


def inserted_values(item: Item) -> tuple[Any, ...]:
    """`item`'s INSERTED_COLUMNS, its status as stored."""
    return (
        item.prefix,
        item.key,
        STATUS_CODE[item.status],
        item.priority,
        item.created,
        item.heartbeat,
        item.orphaned,
        item.extra,
        item.process_id,
        item.exclusive,
        item.external_id,
        item.payload,
    )


def item_from_row(row: Sequence[Any]) -> Item:
    """An ITEM_COLUMNS row (plus payload, when selected) as an Item."""
    # Positional, in field order: a frozen dataclass's keyword call costs twice as much,
    # and every listing and lookup builds these.
    return Item(
        row[0],
        row[1],
        row[2],
        STATUS_NAME[row[3]],
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        row[9],
        bool(row[10]),
        row[11],
        row[12] if len(row) > 12 else None,
    )


def result_from_row(row: Sequence[Any] | None) -> StoredResult | None:
    if row is None:
        return None
    return StoredResult(row[0], row[1], row[2], bool(row[3]), row[4], row[5], row[6])


@dataclass(frozen=True, slots=True)
class PrefixOverview:
    prefix: str
    pending: int
    active: int
    oldest_created: int | None


@dataclass(frozen=True, slots=True)
class ResultReuse:
    """Which of the path's results an ADD may be answered from, as of `since` (ms): an
    unread one, or with `fresh_after` set one read already whose expiry is later than
    that (it was stored within the caller's max age)."""

    since: int
    fresh_after: int | None = None


class StoreTransaction(Protocol):
    """Persistence hooks, all called inside one atomic transaction.

    Orders: `items()` and `orphaned_items()` return priority desc, queue id asc, except that
    `items(status="active")`, `active_keys()` and `stalled_items()` return queue id asc.
    Result reads ignore rows whose `expire` is not after `now`.
    """

    def find(self, key: QueueKey, *, with_payload: bool = False) -> Item | None: ...

    def expect_add(self, item: Item, reuse: ResultReuse | None) -> None:
        """An ADD of `item` comes next: what it may read (the item at its path, the path's
        latest result it may `reuse`, if any, the owner of its external id) and the
        id it would take may be asked for now, together. A store whose reads cost no
        round trip ignores this; the reads themselves still come, in the usual order."""
        ...

    def external_id_taken(self, external_id: str) -> bool: ...

    def insert(self, item: Item) -> QueueId:
        """Insert a new item (its `id` is ignored) and return the id assigned to it."""
        ...

    def activate(self, item: Item, now: int, extra: str | None) -> None:
        """Make `item` active: heartbeat `now`, and `extra` (its own, or with
        startQueryTime merged: RETRIEVE's `start_query_time`)."""

    def deactivate(self, item: Item, now: int) -> None:
        """Make an active `item` pending again, as if never retrieved (heartbeat `now`)."""

    def set_heartbeat(self, item: Item, now: int) -> None: ...

    def set_orphaned(self, item: Item, deadline: int) -> None: ...

    def set_extra(self, item: Item, extra: str | None) -> None: ...

    def delete(self, item: Item) -> None: ...

    def counts(self, prefix: str) -> tuple[int, int]:
        """(pending, active) of the prefix, for all processes."""
        ...

    def active_keys(self, prefix: str) -> list[str]: ...

    def items(
        self,
        prefix: str,
        status: ItemStatus | None,
        *,
        process_id: str | None,
        with_payload: bool,
        limit: int | None,
    ) -> list[Item]:
        """Items visible to `process_id`: not exclusive, or exclusive and owned by it."""
        ...

    def pool_head(self, prefix: str, process_id: str, limit: int) -> list[Item]:
        """PENDING's head as a supervisor's pool takes it: `items("pending")`'s first
        `limit`, with payloads. A store shared by hosts may put its own host's first,
        within a priority and a bounded window of that head."""
        ...

    def orphaned_items(self, prefix: str, now: int, orphaned_timeout_ms: int) -> list[Item]:
        """Pending items past their own deadline, or (without one) older than the timeout."""
        ...

    def stalled_items(self, prefix: str, now: int, heartbeat_timeout_ms: int) -> list[Item]:
        """Active items whose heartbeat (or creation, without one) is older than the timeout."""
        ...

    def insert_result(self, result: StoredResult) -> None: ...

    def result_by_id(self, id: QueueId, now: int) -> StoredResult | None: ...

    def latest_result_by_path(self, path: str, now: int) -> StoredResult | None: ...

    def latest_result_by_external_id(self, external_id: str, now: int) -> StoredResult | None: ...

    def mark_result_consumed(self, id: QueueId, consumer: str | None = None) -> None:
        """Mark consumed (once: a second mark keeps the first consumer)."""
        ...

    def delete_result(self, id: QueueId) -> None: ...

    def purge_expired_results(self, now: int, limit: int) -> int: ...

    def truncate(self) -> None: ...

    def overview(self, now: int) -> tuple[list[PrefixOverview], int]:
        """Per prefix (pending, active, oldest item's creation), and results still held."""
        ...

    def refresh_active_heartbeats(self, now: int) -> int:
        """Set the heartbeat of every active item to `now`; returns how many."""
        ...

    def acked(self, item: Item, result: str | None) -> None:
        """The item was acked in this transaction: a store shared by several processes
        tells the others here (their RESULT_BLOCKING waiters); others do nothing."""
        ...

    def watch(self, key: QueueKey, now: int) -> None:
        """A long poll of this process is about to look for `key`'s result, then wait for
        its ACK: a store shared by several processes makes sure that an ACK elsewhere
        tells this one, before the look, in its transaction; others do nothing."""
        ...


def result_response(found: StoredResult) -> ResultResponse:
    return ResultResponse(
        payload=found.value, type=ResultStatus.SUCCESS, id=found.id, external_id=found.external_id
    )


def merge_extra_json(current: str | None, new: str) -> str | None:
    """MERGE_EXTRA's rule: two JSON objects merge (new keys win); null clears; else replace."""
    update = orjson.loads(new)
    if update is None:
        return None
    if current is None:
        return new
    base = orjson.loads(current)
    if isinstance(base, dict) and isinstance(update, dict):
        return orjson.dumps({**base, **update}).decode()
    return new


def with_start_query_time(extra: str | None, start_query_time: int | None) -> str | None:
    """A retrieved item's extra, with `startQueryTime` merged in when one is given."""
    if start_query_time is None:
        return extra
    return merge_extra_json(extra, f'{{"startQueryTime":{start_query_time}}}')


def active_at_once(item: Item, extra: str | None) -> Item:
    """`item` as ADD_AND_RETRIEVE inserts it when it has a slot: active from its creation
    (its heartbeat), with `extra`. Built, not dataclasses.replace: one per fast-tracked
    query, and replace walks the fields each time."""
    return Item(
        item.id,
        item.prefix,
        item.key,
        "active",
        item.priority,
        item.created,
        item.created,
        item.orphaned,
        extra,
        item.process_id,
        item.exclusive,
        item.external_id,
        item.payload,
    )


def new_item(
    path: str,
    payload: str,
    priority: int,
    orphaned: float | None,
    external_id: str | None,
    exclusive: bool,
    process_id: str | None,
    now: int,
) -> Item:
    """ADD's arguments, checked (InvalidCommandError names the bad one), as a new item."""
    prefix, key = v.split_path(path)
    v.check_json("payload", payload)
    v.check_priority(priority)
    orphaned_ms = v.check_orphaned_seconds(orphaned)
    v.check_external_id(external_id)
    v.check_process_id(process_id)
    if not isinstance(exclusive, bool):
        raise InvalidCommandError("exclusive must be a bool")
    if exclusive and process_id is None:
        raise InvalidCommandError("EXCLUSIVE needs the process id of the connection")
    return Item(
        id=0,
        prefix=prefix,
        key=key,
        status="pending",
        priority=priority,
        created=now,
        heartbeat=None,
        orphaned=None if orphaned_ms is None else now + orphaned_ms,
        extra=None,
        process_id=process_id,
        exclusive=exclusive,
        external_id=external_id,
        payload=payload,
    )


# Priority groups `oldest_created` seeks one by one before it scans instead: a queue
# uses a few priorities, and each group is one index seek.
OLDEST_GROUPS = 32
OldestSeek = Callable[[int, int], "tuple[int, int] | None"]


def oldest_created(seek: OldestSeek, scan: Callable[[], int | None]) -> int | None:
    """When a prefix's oldest item was added, found without reading its backlog: items
    come in the order of their ids, so the oldest is the first (lowest id) of some
    priority group of pending or active items. `seek(status, below)` is the first item
    (its priority, its creation) of the highest priority below `below`, by the queue's
    index (prefix, status, priority DESC, id): one seek a group. A prefix with more
    groups than `OLDEST_GROUPS` is scanned (`scan`)."""
    firsts: list[int] = []
    for status in STATUS_NAME:
        below = v.MAX_PRIORITY + 1
        for _ in range(OLDEST_GROUPS):
            found = seek(status, below)
            if found is None:
                break
            below, created = found
            firsts.append(created)
        else:
            return scan()
    return min(firsts, default=None)


def oldest_of(one: Callable[[str, tuple[Any, ...]], Any], prefix: str, mark: str) -> int | None:
    """`oldest_created` on a SQL store: `one(sql, parameters)` its one-row read, `mark`
    its parameter placeholder (`?` or `%s`)."""

    def seek(status: int, below: int) -> tuple[int, int] | None:
        row = one(
            f"SELECT priority, created FROM items WHERE prefix = {mark} AND status = {mark}"
            f" AND priority < {mark} ORDER BY priority DESC, id LIMIT 1",
            (prefix, status, below),
        )
        return None if row is None else (int(row[0]), int(row[1]))

    def scan() -> int | None:
        row = one(f"SELECT min(created) FROM items WHERE prefix = {mark}", (prefix,))
        return None if row is None or row[0] is None else int(row[0])

    return oldest_created(seek, scan)
