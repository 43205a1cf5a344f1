"""WAL checkpoints off the writer's path.

A checkpoint folds the WAL back into the database file, and pays the fsyncs
`synchronous=NORMAL` saves its commits: on the writer's connection (SQLite's
autocheckpoint) it ran inside the COMMIT that crossed the threshold, and stalled the
supervisor's loop for tens of milliseconds every second or so under load (60 % of the
time spent in COMMIT, on this project's benchmark machine). Here a thread of its own, on
a connection of its own, runs PASSIVE checkpoints, which never block the writer.

A PASSIVE checkpoint cannot restart the WAL while the writer keeps appending: the WAL
restarts from its start only when a write transaction begins with every frame folded
back. When it has grown past `cap_frames` regardless (a writer that never pauses), the
writer folds the few frames written since the last background round itself, between two
transactions (`fold_due`): small, as the background round made the rest durable already.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

_log = logging.getLogger("queryqueue.sqlite")


class Checkpointer:
    def __init__(
        self,
        path: Path,
        *,
        synchronous: str,
        every_s: float | None = 1.0,
        cap_frames: int = 16_384,
        busy_timeout_ms: int = 5_000,
    ) -> None:
        self.path = path
        self.every_s = every_s  # None: no thread, `step()` runs a round
        self.cap_frames = cap_frames
        # Set by the writer after each commit, cleared by a round: an idle store is left be.
        self.dirty = False
        # Set by a round that found the WAL past its cap; the writer folds it (`folded`).
        self.fold_due = False
        self.rounds = 0
        self.folds = 0
        self.failures = 0
        self.wal_frames = 0  # the WAL's length at the last round
        self.connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self.connection.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            # Its fsyncs are the ones that make the folded frames safe to overwrite from.
            self.connection.execute(f"PRAGMA synchronous = {synchronous}")
        except BaseException:
            self.connection.close()
            raise
        self._lock = threading.Lock()  # one round at a time: the thread's, or a caller's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.every_s is None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"queryqueue-checkpoint {self.path.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        assert self.every_s is not None
        while not self._stop.wait(self.every_s):
            if self.dirty:
                self.step()

    def step(self) -> tuple[int, int]:
        """One round: a PASSIVE checkpoint. Returns (frames in the WAL, frames folded)."""
        with self._lock:
            self.dirty = False
            try:
                row = self.connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:
                self.failures += 1
                _log.warning("checkpoint of %s failed (the next round retries): %s", self.path, exc)
                return self.wal_frames, 0
            _, frames, folded = row
            self.rounds += 1
            self.wal_frames = max(0, int(frames))
            if self.wal_frames >= self.cap_frames:
                self.fold_due = True
            return self.wal_frames, int(folded)

    def fold(self, writer: sqlite3.Connection) -> None:
        """On the writer's connection, between two transactions: fold what the rounds have
        not, so that its next write starts the WAL over."""
        try:
            writer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            _log.warning("folding the WAL of %s failed: %s", self.path, exc)
        self.fold_due = False
        self.folds += 1

    def describe(self) -> dict[str, Any]:
        return {
            "checkpoints": self.rounds,
            "writer_folds": self.folds,
            "checkpoint_failures": self.failures,
            "wal_frames": self.wal_frames,
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self.connection.close()
