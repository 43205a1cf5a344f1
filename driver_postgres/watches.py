"""Which ACKs a store tells the other hosts of, on a queue that several hosts share.

A host's own long polls are woken in process by its ACKs; another host's hear of an ACK
by its NOTIFY, which wakes every listening host and its backend. Most queries are
completed by the host whose callers added them (pool_head.py), and nobody elsewhere
waits for them. So an ACK of an item its own store added notifies only where another
host watches the item's path; an item another store added (or one added before items
had an origin) is always announced.

A host watches a path (`watch`) as a long poll of its own is about to look for the
result, unless the item is one its store added: under the prefix's lock, before the
result is read. The ACK holds the same lock: it either committed before, and the look
finds its result, or it sees the watch. A watch lasts `WATCH_MS`, and every look renews
it: a waiter looks again at least every safety re-check (30 s by default); one set to
look less often than that is woken by its own re-check instead.
A host that listened alone watches nothing; when it hears another host's hello, its
waiters look again (a new epoch, listening.py), and watch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from queryqueue.driver_postgres.lean import Rows
from queryqueue.engine.records import Item
from queryqueue.engine.responses import QueueKey

WATCH_MS = 600_000  # ten minutes
WATCH = (
    "INSERT INTO watches (path, expire) VALUES (%s, %s) ON CONFLICT (path)"
    " DO UPDATE SET expire = greatest(watches.expire, excluded.expire)"
)
# An expired watch not purged yet costs a NOTIFY nobody needed, never a missed one.
WATCHED = "EXISTS (SELECT 1 FROM watches WHERE path = %s)"


class Watches(ABC):
    """The watches of a PostgreSQL command (`PostgresTransaction`'s base): what it knows of
    which store added the items it found, its long polls' watches, and its NOTIFYs'
    condition."""

    _channel: str | None
    _origin: str
    # By id and by path, whether this store added an item, and its path: what the batch's
    # commands that succeeded learnt (`origins`, kept by the batch), and this one's.
    origins: dict[QueueKey, tuple[bool, str]]
    _batch_origins: dict[QueueKey, tuple[bool, str]]

    @abstractmethod
    def _write(self, query: str, params: tuple[Any, ...] = ()) -> Rows: ...

    @abstractmethod
    def _one(self, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None: ...

    @abstractmethod
    def lock(self, prefix: str) -> None: ...

    def _added_here(self, origin: str | None) -> bool:
        """Whether the store `origin` names is this one (an item with none is nobody's)."""
        return bool(self._origin) and origin == self._origin

    def _seen(self, item: Item, origin: str | None) -> None:
        """`item`, found or inserted, added by the store `origin` names."""
        known = (self._added_here(origin), item.path)
        self.origins[item.id] = self.origins[item.path] = known

    def _known(self, key: QueueKey) -> tuple[bool, str] | None:
        return self.origins.get(key) or self._batch_origins.get(key)

    def watch(self, key: QueueKey, now: int) -> None:
        if self._channel is None:
            return  # nobody else listens
        known = self._known(key)
        if known is not None and known[0]:
            return  # this store added it: its own ACKs announce it where watched
        if isinstance(key, int):
            if known is None:
                # Unlocked, as `find` reads a prefix: items never change prefix or path.
                row = self._one("SELECT prefix, key, origin FROM items WHERE id = %s", (key,))
                if row is None:
                    return  # done already (the look finds its result), or never queued
                if self._added_here(row[2]):
                    return
                known = (False, f"{row[0]}:{row[1]}")
            self.lock(known[1].rpartition(":")[0])
            path = known[1]
        else:
            path = key
            prefix, _, name = key.rpartition(":")
            self.lock(prefix)
            if known is None:
                row = self._one(
                    "SELECT origin FROM items WHERE prefix = %s AND key = %s", (prefix, name)
                )
                if row is not None and self._added_here(row[0]):
                    return
        self._write(WATCH, (path, now + WATCH_MS))

    def _notify_condition(self, item_id: int, path: str) -> tuple[str, tuple[str, ...]]:
        """What an ACK's NOTIFY of `item_id` is sent under: a condition (with its
        parameters) when this store added the item, none otherwise."""
        known = self._known(item_id)
        if known is not None and known[0]:
            return f" WHERE {WATCHED}", (path,)
        return "", ()
