"""Queue ids taken outside the transactions that use them.

A batch's hand-offs leave for the workers before its COMMIT (`before_commit`), so that a
query runs while SQLite writes its WAL. AUTOINCREMENT's counter is in the transaction: a
batch that then failed to commit, or a supervisor killed before it did, would give the same
ids again to the next items, and the ACK of a query handed over under one could complete
another. So the ids come from a block whose end is committed in `sqlite_sequence` before
any of them is used (as a PostgreSQL sequence caches values ahead): an id handed out is
never handed out again, by this connection or by the next supervisor on the file, which
starts after the block. A crash skips what was left of it (a gap, never a repeat); a
close gives it back."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

# Ids a block holds: one small transaction of its own per this many items.
BLOCK = 4096


@dataclass(slots=True)
class IdBlock:
    """The ids `next`..`end` are this connection's to give (`end` committed in
    `sqlite_sequence`); `next` > `end`: none left, the next transaction reserves more."""

    size: int = BLOCK
    next: int = 1
    end: int = 0
    # The current transaction's: `next` as it began, and whether it took an id outside
    # the block (AUTOINCREMENT's, known to no one until it commits).
    began_at: int = 1
    outside: bool = False

    def begin(self) -> None:
        self.began_at, self.outside = self.next, False

    def rolled_back(self) -> None:
        """The transaction's ids, never handed to anyone (its `before_commit` had not
        run), are given again: a batch run again, or undone, leaves no gap."""
        self.next = self.began_at

    def low(self) -> bool:
        """Fewer than half a block left: reserve before the next transaction (a batch,
        even of a server's 512 commands, then never runs out in the middle of one)."""
        return self.end - self.next < self.size // 2

    def reserve(self, conn: sqlite3.Connection) -> None:
        """A block after every id given so far, by anyone: committed on its own before
        any of it is used. Raises sqlite3.Error (the ids in hand stay as they were)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
            start = max(0 if row is None else int(row[0]), self.next - 1)
            end = start + self.size
            if row is None:
                conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('items', ?)", (end,))
            else:
                conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'items'", (end,))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.next, self.end = start + 1, end

    def give_back(self, conn: sqlite3.Connection) -> None:
        """Closing: what is left of the block goes back (unless another connection has
        reserved after it), so a graceful restart goes on where this one stopped. Every
        id handed out is below `next`."""
        if self.next <= self.end:
            conn.execute(
                "UPDATE sqlite_sequence SET seq = ? WHERE name = 'items' AND seq = ?",
                (self.next - 1, self.end),
            )
            self.end = self.next - 1

    def take(self) -> int | None:
        """The next id of the block; None: none left (the item takes AUTOINCREMENT's,
        which is in its transaction: `used`)."""
        if self.next > self.end:
            return None
        id, self.next = self.next, self.next + 1
        return id

    def used(self, id: int) -> None:
        """An id AUTOINCREMENT gave outside the block: the block is spent past it."""
        self.next = max(self.next, id + 1)
        self.end = min(self.end, self.next - 1)
        self.outside = True
