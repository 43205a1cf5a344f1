"""The queue store in SQLite (WAL): durable across crashes, one atomic transaction per command.

All SQL lives in this module and its transaction (`transaction.py`): one connection with `isolation_level=None`, one `_atomic()`
(BEGIN IMMEDIATE, ROLLBACK that keeps the original error), prepared statements reused
through the connection's statement cache, counters instead of `count(*)`, kept in memory
(`SqliteQueueStore._stored`). The WAL is checkpointed by `checkpoints.Checkpointer`, on a
thread and a connection of its own.

Durability: `synchronous=NORMAL` (default) survives a `kill -9` of any process — a commit
is in the WAL before the command answers — and can lose the last transactions only on
power loss or an OS crash. `synchronous=FULL` fsyncs every commit and survives those too:
inside its COMMIT, or, with `sync_in_background` (the supervisor's), on a thread that syncs
for many commits at once while the writer goes on (`syncer.WalSyncer`): who answers from a
commit then waits for it to be synced (`unsynced_commit`, `when_synced`).

One process writes a database: the supervisor, or a single process in development.
RESULT_BLOCKING is woken in-process by ACK, so waiters must share the store object with
the process that acks (other processes go through the supervisor).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any, Literal, TypeVar

from queryqueue.driver_sqlite.checkpoints import Checkpointer
from queryqueue.driver_sqlite.ids import IdBlock
from queryqueue.driver_sqlite.schema import COUNT_BY_PREFIX, migrate
from queryqueue.driver_sqlite.syncer import Synced, WalSyncer
from queryqueue.driver_sqlite.transaction import (
    Redo,
    Savepoint,
    SqliteTransaction,
    database_error,
)
from queryqueue.engine.clock import Clock
from queryqueue.engine.counts import RESULTS, CountChanges
from queryqueue.engine.errors import StoreError
from queryqueue.engine.group_commit import call_before_commit
from queryqueue.engine.store import DEFAULT_RESULT_TTL_MS, QueueStore

Synchronous = Literal["NORMAL", "FULL"]

T = TypeVar("T")

# A new database's page size. Every commit writes each b-tree page it changed to the WAL
# (about seven a batch: items and its three indexes, results and two of its own), and a
# frame costs more the larger it is (its checksum, its copy, ext4's pages): in raw SQLite
# on the benchmark machine a commit of one small insert and one delete took 21 us at
# 2 KiB against 30 at 4 KiB; under the throughput load the supervisor took 1-3 % less CPU
# a query (`python -m benchmarks.ab`). 1 KiB gained no more there, and stores
# a large result in four times the overflow pages.
# An existing database keeps the page size it was made with (changing it takes a VACUUM).
PAGE_SIZE = 2048


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


class _InBatch:
    """One command inside a batch: undone alone if it fails, the batch goes on. A class,
    not a generator's context manager: five of them a query, each ~1 us cheaper so."""

    __slots__ = ("_savepoint", "_store")

    def __init__(self, store: SqliteQueueStore) -> None:
        self._store = store
        self._savepoint: Savepoint | None = None

    def __enter__(self) -> SqliteTransaction:
        store = self._store
        store._lock.acquire()
        try:
            savepoint = self._savepoint = Savepoint(
                store.connection, store.path, store._counts, store._ids, guarded=store._guarded
            )
            return SqliteTransaction(
                store.connection, store._counts, store._stored, store._ids, savepoint
            )
        except BaseException:
            store._lock.release()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        store, savepoint = self._store, self._savepoint
        assert savepoint is not None
        try:
            if exc is None:
                savepoint.release()
            elif not isinstance(exc, Redo):
                savepoint.undo()
                if isinstance(exc, sqlite3.Error):
                    raise database_error(store.path, exc) from exc
        finally:
            store._lock.release()


def _connect(
    path: Path, *, synchronous: str, busy_timeout_ms: int, wal_cap_pages: int
) -> sqlite3.Connection:
    """The store's connection to `path`: WAL, its pragmas, the schema migrated."""
    try:
        connection = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, cached_statements=256
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open the queue database {path}: {exc}") from exc
    try:
        connection.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # before the first write
        connection.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        (mode,) = connection.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode.lower() != "wal":
            raise StoreError(f"{path} cannot be put in WAL mode (got {mode})")
        connection.execute(f"PRAGMA synchronous = {synchronous}")
        # No checkpoint inside a COMMIT: the checkpoint thread folds the WAL (normal
        # locking, so that its connection may); a restarted WAL is cut back to the cap.
        connection.execute("PRAGMA wal_autocheckpoint = 0")
        (page_size,) = connection.execute("PRAGMA page_size").fetchone()
        connection.execute(f"PRAGMA journal_size_limit = {int(wal_cap_pages) * page_size}")
        connection.execute("PRAGMA cache_size = -32768")  # 32 MiB
        connection.execute("PRAGMA temp_store = MEMORY")
        migrate(connection)
    except BaseException as exc:
        connection.close()
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"cannot open the queue database {path}: {exc}") from exc
        raise
    return connection


class SqliteQueueStore(QueueStore):
    def __init__(
        self,
        path: str | Path,
        *,
        clock: Clock | None = None,
        result_ttl_ms: int = DEFAULT_RESULT_TTL_MS,
        synchronous: Synchronous = "NORMAL",
        busy_timeout_ms: int = 5_000,
        checkpoint_every_s: float | None = 1.0,
        wal_cap_pages: int = 16_384,
        sync_in_background: bool = False,
        wal_sync: Callable[[int], None] | None = None,
    ) -> None:
        """`checkpoint_every_s`: how often the checkpoint thread looks at the WAL (None:
        no thread; `checkpointer.step()` runs a round). `wal_cap_pages`: past this, the
        writer folds the WAL's rest itself so that it restarts (32 MiB at 2 KiB pages).
        `sync_in_background` (FULL only): commits are made durable by a thread of the
        store's, many at once, not inside each COMMIT; for a caller that holds every answer
        until `when_synced` says its commit is durable (the supervisor does). `wal_sync`:
        what syncs the WAL's fd there (os.fdatasync; injected in tests)."""
        super().__init__(clock=clock, result_ttl_ms=result_ttl_ms)
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = Path(path)
        self.synchronous = synchronous
        self._lock = threading.RLock()
        self._in_batch = False
        # The current batch's work went to the workers (`before_commit`, `hands_off_early`):
        # its ids are never given again, whatever becomes of it.
        self._handed = False
        # Each command of a batch in a savepoint of its own: all but `batched`'s first run.
        self._guarded = True
        self._deferred: list[Callable[[], object]] = []
        self._committing: list[Callable[[], object]] = []  # `before_commit`'s, this batch's
        self._ids = IdBlock()
        self._counts = CountChanges()  # the current transaction's (`_begin`)
        # Each prefix's counters (pending, active) as last committed: counted once, then
        # kept as each transaction commits (a table of them cost a statement and a WAL
        # frame a transaction). Counted again when another connection wrote (`_begin`).
        self._stored: dict[str, tuple[int, int]] = {}
        self._data_version: int | None = None
        self.recounts = 0
        self.syncer: WalSyncer | None = None
        self._changes_seen = 0  # the connection's total_changes at the last commit synced
        background = sync_in_background and synchronous == "FULL"
        # In the background, the WAL is synced by the syncer, not by COMMIT. The connection
        # is there to inspect (PRAGMAs, trace and progress handlers); writes go through
        # the store's commands, which keep its counters.
        self.connection = _connect(
            self.path,
            synchronous="NORMAL" if background else synchronous,
            busy_timeout_ms=busy_timeout_ms,
            wal_cap_pages=wal_cap_pages,
        )
        self._start_threads(
            checkpoint_every_s, wal_cap_pages, busy_timeout_ms, wal_sync if background else False
        )

    def _start_threads(
        self,
        every_s: float | None,
        wal_cap_pages: int,
        busy_timeout_ms: int,
        wal_sync: Callable[[int], None] | Literal[False] | None,
    ) -> None:
        """The store's threads: its checkpointer, and its WAL syncer unless `wal_sync` is
        False (commits synced by COMMIT). Neither started: the connection is closed."""
        try:
            self.checkpointer = Checkpointer(
                self.path,
                synchronous=self.synchronous,
                every_s=every_s,
                cap_frames=wal_cap_pages,
                busy_timeout_ms=busy_timeout_ms,
            )
            if wal_sync is not False:
                # The WAL exists from the connection's first transaction (the migration's).
                self._changes_seen = self.connection.total_changes
                self.syncer = WalSyncer(
                    Path(f"{self.path}-wal"), **({} if wal_sync is None else {"sync": wal_sync})
                )
        except BaseException as exc:
            checkpointer = getattr(self, "checkpointer", None)
            if checkpointer is not None:
                checkpointer.close()
            self.connection.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open the queue database {self.path}: {exc}") from exc
            raise
        self.checkpointer.start()

    def _begin(self) -> None:
        if self.syncer is not None and self.syncer.failure is not None:
            raise StoreError(
                f"the WAL of {self.path} could not be synced ({self.syncer.failure}): "
                "nothing more is committed; restart the supervisor"
            )
        if self.checkpointer.fold_due:
            # A writer that never pauses outruns the rounds: the WAL would never restart.
            self.checkpointer.fold(self.connection)
        try:
            if self._ids.low():
                self._ids.reserve(self.connection)
            self.connection.execute("BEGIN IMMEDIATE")
            # Changed only by another connection's commit (this one's own do not change it).
            (version,) = self.connection.execute("PRAGMA data_version").fetchone()
            if version != self._data_version:
                self._stored = self._count_items()
                self._data_version = version
        except sqlite3.Error as exc:
            with suppress(sqlite3.Error):
                if self.connection.in_transaction:
                    self.connection.execute("ROLLBACK")
            raise StoreError(f"cannot begin a transaction on {self.path}: {exc}") from exc
        self._counts = CountChanges()
        self._ids.begin()

    def _count_items(self) -> dict[str, tuple[int, int]]:
        """Each prefix's counters, counted (at open, and after another connection wrote:
        the one place a backlog is counted)."""
        self.recounts += 1
        rows = self.connection.execute(COUNT_BY_PREFIX)
        counted = {prefix: (int(pending), int(active)) for prefix, pending, active in rows}
        (results,) = self.connection.execute("SELECT count(*) FROM results").fetchone()
        return {**counted, RESULTS: (int(results), 0)} if results else counted

    def _commit(self) -> None:
        changed = self._counts.take_changes()
        # Kept once COMMIT succeeded: one SQLite rolled back itself (a full disk) fails.
        self.connection.execute("COMMIT")
        self.checkpointer.dirty = True
        if self.syncer is not None and self.connection.total_changes != self._changes_seen:
            # Only a transaction that wrote has anything to sync (reads commit too).
            self._changes_seen = self.connection.total_changes
            self.syncer.commit()
        stored = self._stored
        for prefix, pending, active in changed:
            was = stored.get(prefix, (0, 0))
            now = (was[0] + pending, was[1] + active)
            if now == (0, 0):
                stored.pop(prefix, None)
            else:
                stored[prefix] = now

    def _atomic(self) -> AbstractContextManager[SqliteTransaction]:
        if self._in_batch:
            return _InBatch(self)
        return self._transaction()

    @contextmanager
    def _transaction(self) -> Iterator[SqliteTransaction]:
        """A command outside a batch: a transaction of its own."""
        with self._lock:
            self._begin()
            try:
                yield SqliteTransaction(self.connection, self._counts, self._stored, self._ids)
            except BaseException as exc:
                with suppress(sqlite3.Error):  # the original error is the one worth reporting
                    self.connection.execute("ROLLBACK")
                self._ids.rolled_back()
                if isinstance(exc, sqlite3.Error):
                    raise database_error(self.path, exc) from exc
                raise
            try:
                self._commit()
            except sqlite3.Error as exc:
                with suppress(sqlite3.Error):
                    self.connection.execute("ROLLBACK")
                self._ids.rolled_back()  # handed to no one outside a batch
                raise StoreError(f"cannot commit to {self.path}: {exc}") from exc

    @contextmanager
    def batch(self, prefix: str | None = None) -> Iterator[None]:
        """Group commit: one transaction (one WAL commit, one fsync with FULL) for every
        command run inside; each command is a savepoint of its own. Its `before_commit`
        callbacks run as its COMMIT starts (ids.py: its ids are never given again, even
        should the COMMIT fail, nor once `hands_off_early` said yes); after it, if an item
        took an id outside the block."""
        with self._lock:
            if self._in_batch:
                yield
                return
            self._begin()
            self._in_batch = True
            self._deferred = []
            self._committing = []
            self._handed = False
            try:
                yield
                before = not self._ids.outside
                if before:
                    self._handed = True
                    self._before_commit()
                self._commit()
                if not before:
                    self._before_commit()
            except BaseException as exc:
                with suppress(sqlite3.Error):
                    self.connection.execute("ROLLBACK")
                if not self._handed:
                    self._ids.rolled_back()
                self._deferred = []
                self._committing = []
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"cannot commit to {self.path}: {exc}") from exc
                raise
            finally:
                self._in_batch = False
            effects, self._deferred = self._deferred, []
        for effect in effects:
            effect()

    def batched(
        self, work: Callable[[], T], undo: Callable[[T], object], prefix: str | None = None
    ) -> T:
        """Run first without savepoints; a command that failed after writing has the batch
        rolled back and run again with them (`Redo`): what `work` does before that is
        undone with the transaction, and `work` must undo its own (its waiters) as it
        unwinds."""
        with self._lock:
            self._guarded = False
            try:
                return super().batched(work, undo, prefix)
            except Redo:
                pass
            finally:
                self._guarded = True
            return super().batched(work, undo, prefix)

    def hands_off_early(self) -> bool:
        if not self._in_batch or self._ids.outside:
            return False
        self._handed = True
        return True

    def before_commit(self, callback: Callable[[], object]) -> None:
        if self._in_batch:
            self._committing.append(callback)

    def _before_commit(self) -> None:
        callbacks, self._committing = self._committing, []
        call_before_commit(callbacks)

    def _after_commit(self, effect: Callable[[], object]) -> None:
        if self._in_batch:
            self._deferred.append(effect)
        else:
            effect()

    def checkpoint(self) -> None:
        """Fold the WAL back into the database file (graceful shutdown)."""
        with self._lock:
            try:
                self.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                raise StoreError(f"checkpoint of {self.path} failed: {exc}") from exc

    def files(self) -> dict[str, int | None]:
        if str(self.path) == ":memory:":
            return {}
        return {"db_bytes": _size(self.path), "wal_bytes": _size(Path(f"{self.path}-wal"))}

    def wal_state(self) -> dict[str, Any] | None:
        return {**self.checkpointer.describe(), **(self.syncer.describe() if self.syncer else {})}

    @property
    def background_sync(self) -> bool:  # type: ignore[override]
        return self.syncer is not None

    def unsynced_commit(self) -> int | None:
        return None if self.syncer is None else self.syncer.unsynced()

    def when_synced(self, commit: int, callback: Synced) -> None:
        if self.syncer is None:
            callback(None)
        else:
            self.syncer.when_synced(commit, callback)

    def sync_now(self) -> None:
        if self.syncer is not None:
            self.syncer.sync_now()

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
        self.checkpointer.close()
        with self._lock:
            with suppress(sqlite3.Error):  # a database that cannot take it keeps the gap
                self._ids.give_back(self.connection)
            self.connection.close()
        if self.syncer is not None:
            self.syncer.close_fd()
