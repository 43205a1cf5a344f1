"""A transaction's view of the per-prefix counters (pending, active) of a SQL store.

No command counts a backlog: PostgreSQL keeps the counters in a `prefix_counts` table
(several hosts write it), SQLite in its one writer's memory (counted as it opens, and
again after another connection wrote). Both apply a transaction's changes once per
prefix as it commits, not once per item changed. What they share is this bookkeeping.
"""

from __future__ import annotations

from typing import Any

# The counter of results held (its first number), kept with the prefixes' where a store
# counts them: not a prefix, since no prefix may hold a NUL.
RESULTS = "\x00results"


class CountChanges:
    """`counts`: a prefix's counters as the table held them when first read in this
    transaction, with every change since. `deltas`: the changes not yet written."""

    __slots__ = ("counts", "deltas")

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int]] = {}
        self.deltas: dict[str, tuple[int, int]] = {}

    def count(self, prefix: str, pending: int, active: int) -> None:
        was = self.deltas.get(prefix, (0, 0))
        self.deltas[prefix] = (was[0] + pending, was[1] + active)
        known = self.counts.get(prefix)
        if known is not None:
            self.counts[prefix] = (known[0] + pending, known[1] + active)

    def stored(self, prefix: str, row: tuple[Any, ...] | None) -> tuple[int, int]:
        """`prefix`'s counters as read from the table (`row`: pending, active, or None),
        with what this transaction has yet to write to it."""
        pending, active = (0, 0) if row is None else (int(row[0]), int(row[1]))
        delta = self.deltas.get(prefix, (0, 0))
        self.counts[prefix] = counts = (pending + delta[0], active + delta[1])
        return counts

    def take_changes(self) -> list[tuple[str, int, int]]:
        """The changes to write, (prefix, pending, active) each; from now on not pending."""
        changed = [(prefix, p, a) for prefix, (p, a) in self.deltas.items() if p or a]
        self.deltas = {}
        return changed

    def keep(self) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        """What `restore` goes back to (a command's savepoint, as it opens)."""
        return dict(self.counts), dict(self.deltas)

    def restore(self, kept: tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]) -> None:
        self.counts, self.deltas = kept

    def forget(self) -> None:
        """The table was emptied in this transaction: nothing read or changed stands."""
        self.counts.clear()
        self.deltas.clear()
