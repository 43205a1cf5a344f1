"""PENDING's head as a host's pool takes it, on a queue that several hosts share.

Every item names the store that added it (`items.origin`). Within one priority, a pool
takes the queries its own host's callers added ahead of those added through another host
less than `LOCAL_FIRST_MS` earlier. Their results are then stored by the host whose callers
wait for them, which answers them as the ACK commits. A result stored by another host
reaches its waiter through a NOTIFY and a transaction of the waiter's own: a round trip
and a commit more for each result.

The preference stays within PENDING's head read in queue order (priority, then id; the
window `Head` keeps): the backlog behind it is never read, priorities are never
crossed, and a query that no pool of its own host takes waits at most `LOCAL_FIRST_MS`
longer than its place in the queue.
"""

from __future__ import annotations

from collections.abc import Container

from queryqueue.driver_postgres.batch import Head
from queryqueue.driver_postgres.lean import Executor
from queryqueue.driver_postgres.schema import PENDING
from queryqueue.engine.records import ITEM_COLUMNS, Item

LOCAL_FIRST_MS = 100
# The rows a head is read with beyond what is asked: the batch's own activations and
# deletions take some away (`Head`), and the pool chooses its own host's among them.
HEAD_SPARE = 8
# PENDING's head in queue order, with whether this store added each row (NULL: an item
# added before items had an origin, nobody's own).
HEAD_WINDOW = (
    f"SELECT {ITEM_COLUMNS}, payload, origin = %s FROM items"
    " WHERE prefix = %s AND status = %s AND (NOT exclusive OR process_id IS NOT DISTINCT FROM %s)"
    " ORDER BY priority DESC, id LIMIT %s"
)


def local_first(rows: list[Item], local: Container[int], limit: int) -> list[Item]:
    """The first `limit` of `rows` (in queue order) as the pool takes them: within one
    priority, those in `local` (ids this host added) `LOCAL_FIRST_MS` ahead of the rest.
    Rows all of one kind keep their queue order."""
    kinds = {row.id in local for row in rows}
    if len(kinds) < 2:
        return rows[:limit]

    def order(row: Item) -> tuple[int, int, int]:
        head_start = LOCAL_FIRST_MS if row.id in local else 0
        return (-row.priority, row.created - head_start, row.id)

    return sorted(rows, key=order)[:limit]


class PoolHeads:
    """`pool_head` for a command of the PostgreSQL store: a base of `PostgresTransaction`,
    which gives it its statements, its origin and its batch's head."""

    _c: Executor
    _origin: str
    _head: Head | None

    def pool_head(self, prefix: str, process_id: str, limit: int) -> list[Item]:
        head = self._head
        window = None if head is None else head.window(prefix, process_id, limit)
        if head is None or window is None:  # read now, as a batch reads it ahead
            cursor = self._c.execute(
                HEAD_WINDOW, (self._origin, prefix, PENDING, process_id, limit + HEAD_SPARE)
            )
            head = Head(prefix, process_id, limit + HEAD_SPARE, cursor)
            window = head.window(prefix, process_id, limit) or []
        return local_first(window, head.local, limit)
