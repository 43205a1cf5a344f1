"""What a store does for the supervisor that hosts it besides the QUEUE commands, declared
on the store rather than probed for: each does nothing, or tells nothing, unless a store
has it (SQLite has all three)."""

from __future__ import annotations

from typing import Any


class Upkeep:
    def checkpoint(self) -> None:
        """Fold what the store keeps beside its main file back into it, at a graceful stop."""

    def files(self) -> dict[str, int | None]:
        """The sizes of the files the store keeps on this host, for `queryqueue status`."""
        return {}

    def wal_state(self) -> dict[str, Any] | None:
        """Its write-ahead log's checkpoints and syncs, for `queryqueue status` (None: it
        keeps none of its own)."""
        return None
