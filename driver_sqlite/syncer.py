"""Group commit for `synchronous="FULL"` in a server: the WAL's fsync off the writer's path.

With FULL, SQLite fsyncs the WAL inside every COMMIT: the supervisor's loop, which runs
the transactions, waited for the disk once a query and did nothing else meanwhile (FULL
ran at about two thirds of NORMAL's rate on the benchmark machine). Here the writer
commits as NORMAL does (its frames reach the WAL, not the disk) and counts its commits;
this thread fdatasyncs the WAL for every commit made since its last sync at once (what
PostgreSQL calls group commit). What a commit made durable is what its answers may
promise: who answers from it waits until `synced` reaches it (`when_synced`; the
supervisor holds its answers). A commit that was never synced survives the `kill -9` of
any process, as NORMAL's do; only power loss or an OS crash could take it, and nobody was
told of it.

A failed fsync cannot be retried (the kernel may have dropped the pages it failed to
write, and the next fsync would succeed without them): the store stops committing
(`failure`), and the answers waiting for it are told so. The frames of the WAL are the
store's only copy of what they hold until a checkpoint, which syncs the WAL first itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger("queryqueue.sqlite")

Synced = Callable[[BaseException | None], object]


class WalSyncer:
    def __init__(self, wal: Path, *, sync: Callable[[int], None] = os.fdatasync) -> None:
        """`wal`: the database's `-wal` file, which exists while the writer's connection
        is open. `sync`: what makes an fd's written data durable (injected in tests)."""
        self.wal = wal
        self._sync = sync
        # Opened once and closed after the database: closing any fd of a file drops the
        # process's POSIX locks on it (SQLite locks the database and -shm, not the WAL).
        self._fd = os.open(wal, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.committed = 0  # commits made by the writer (`commit`)
        self.synced = 0  # of those, the ones known durable
        self.syncs = 0
        self.failure: BaseException | None = None
        self._waiting: list[tuple[int, Synced]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"queryqueue-wal-sync {wal.name}", daemon=True
        )
        self._thread.start()

    def commit(self) -> None:
        """The writer committed a transaction (after its COMMIT returned)."""
        self.committed += 1

    def unsynced(self) -> int | None:
        """The last commit, while it is not known durable (None: every commit is)."""
        committed = self.committed
        return committed if committed > self.synced or self.failure is not None else None

    def when_synced(self, commit: int, callback: Synced) -> None:
        """`callback(None)` on this class's thread once commit number `commit` is durable
        (at once, here, if it is), or `callback(error)` once it cannot be."""
        with self._cond:
            failure = self.failure
            if failure is None and commit > self.synced:
                self._waiting.append((commit, callback))
                self._cond.notify()
                return
        callback(failure)

    def sync_now(self) -> None:
        """Make every commit so far durable, here (graceful shutdown)."""
        with self._cond:
            if self.failure is None and self.committed > self.synced:
                self._sync_once(self.committed)
            self._answer()

    def _run(self) -> None:
        with self._cond:
            while True:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                # Every commit made by now is in the WAL file: this one sync covers them all.
                target = self.committed
                self._cond.release()
                try:
                    self._sync_once(target)
                finally:
                    self._cond.acquire()
                self._answer()

    def _sync_once(self, target: int) -> None:
        if self.failure is not None:
            return
        try:
            self._sync(self._fd)
        except OSError as exc:
            self.failure = exc
            _log.critical(
                "fsync of %s failed: %s; the store commits nothing more (restart the "
                "supervisor: what was not synced may be lost)",
                self.wal,
                exc,
            )
            return
        self.syncs += 1
        self.synced = max(self.synced, target)

    def _answer(self) -> None:
        """Tell the waiters whose commit is durable (or never will be); the lock is held."""
        synced, failure = self.synced, self.failure
        if failure is None:
            ready = [callback for commit, callback in self._waiting if commit <= synced]
            self._waiting = [(c, callback) for c, callback in self._waiting if c > synced]
        else:
            ready, self._waiting = [callback for _, callback in self._waiting], []
        for callback in ready:
            try:
                callback(failure)
            except Exception:  # one waiter's bug must not stop the syncs of the others
                _log.exception("a callback waiting for a WAL sync failed")

    def describe(self) -> dict[str, int | str | None]:
        return {
            "wal_syncs": self.syncs,
            "commits_unsynced": self.committed - self.synced,
            "sync_failure": None if self.failure is None else str(self.failure),
        }

    def close(self) -> None:
        """Stop the thread; who still waits is told the store closed. The fd stays open
        until `close_fd`, after the database's connections."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)
        with self._cond:
            waiting, self._waiting = self._waiting, []
        for _, callback in waiting:
            callback(OSError("the queue store closed before this commit was synced"))

    def close_fd(self) -> None:
        if not self._thread.is_alive():  # else a hung sync still uses it: left open
            os.close(self._fd)
