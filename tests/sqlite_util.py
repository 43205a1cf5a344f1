"""Looking at a SQLite queue database from outside its store."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path


def committed(db: Path, queue_id: int) -> bool:
    """Whether another connection sees the item: its transaction committed."""
    with contextlib.closing(sqlite3.connect(db)) as other:
        return other.execute("SELECT 1 FROM items WHERE id = ?", (queue_id,)).fetchone() is not None
