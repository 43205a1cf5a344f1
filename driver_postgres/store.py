"""The queue store on PostgreSQL: one queue shared by supervisors on several hosts.

The rules are the base class's, as for every store; this module runs the connections,
batches and commits, and the SQL is its statements' (`statements.py`) and its
transaction's (`transaction.py`, inside a batch: `batch.py`). What each guarantee rests on:

* every command is one transaction (READ COMMITTED), or, in the supervisor, a savepoint
  of its batch's: what arrived for one prefix while its last batch ran commits together,
  one COMMIT (one WAL flush) for all of it (`batch`);
* decisions that depend on a prefix's counts (RETRIEVE, ADD_AND_RETRIEVE, and ADD, which
  changes them) hold a transaction-scoped advisory lock on the prefix, taken before any
  row lock, so the concurrency budget holds across hosts and transactions never wait on
  each other in a cycle;
* dedup on path is the UNIQUE (prefix, key) constraint; an external id is unique by a
  unique index (a conflict is ExternalIdConflictError, never a second item);
* RESULT_BLOCKING waiters of every host are woken by a NOTIFY that the ACK sends in its
  own transaction (delivered at commit), while another host listens (this host's own
  waiters are woken in-process; `others_listen`); a notification missed (a listener
  reconnecting, a host that has just started) costs at most `recheck_ms`, the bounded
  re-check of the store;
* a command (or a batch, whole) whose connection broke before its COMMIT was sent is
  re-run on a fresh connection (it had no effect); one that broke during COMMIT is looked
  up by its transaction id (`txid_status`): committed, its answers stand; aborted, it is
  re-run;
* in-process wake-ups run after the COMMIT, never before (`_after_commit`);
* a server that stops answering is noticed by the watchdog (watchdog.py), not waited for.

Each lane of the store (a thread: engine/lanes.py) has a connection of its own, as has
any other thread that calls a command; one more connection listens.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

from queryqueue.driver_postgres.batch import (
    Batch,
    Disconnected,
    Ending,
    Known,
    Redo,
)
from queryqueue.driver_postgres.hosts import lease_of
from queryqueue.driver_postgres.lean import Statements
from queryqueue.driver_postgres.pipelined import RECONNECT_BACKOFF, PipelinedBatches
from queryqueue.driver_postgres.schema import check_schema, migrate
from queryqueue.driver_postgres.statements import (
    NEXT_SAVEPOINT,
    SAVEPOINT,
    UNDO_SAVEPOINT,
    answered_xid,
)
from queryqueue.driver_postgres.transaction import PostgresTransaction
from queryqueue.driver_postgres.watchdog import Watchdog
from queryqueue.engine.clock import Clock
from queryqueue.engine.errors import StoreError
from queryqueue.engine.store import DEFAULT_RESULT_TTL_MS

T = TypeVar("T")
_log = logging.getLogger(__name__)
RECONNECT_ATTEMPTS = 4
_IDLE, _INTRANS = psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS


class PostgresQueueStore(PipelinedBatches):
    """`statement_timeout`, `lock_timeout` and `idle_in_transaction_timeout` (seconds) are
    set on every session, with TCP keepalives: a command that waits longer (a lock held
    by another client, a database that stopped answering) fails with a StoreError naming
    the timeout, on the store's own thread; the supervisor's loop never waits for it."""

    blocking = True
    shared = True

    def __init__(
        self,
        url: str,
        *,
        schema: str = "queryqueue",
        clock: Clock | None = None,
        result_ttl_ms: int = DEFAULT_RESULT_TTL_MS,
        recheck_ms: int = 1_000,
        safety_recheck_ms: int = 30_000,
        connect_timeout: float = 10.0,
        statement_timeout: float = 30.0,
        lock_timeout: float = 10.0,
        idle_in_transaction_timeout: float = 60.0,
        network_timeout: float | None = None,
        lanes: int = 4,
        host_timeout: float | None = None,
    ) -> None:
        super().__init__(clock=clock, result_ttl_ms=result_ttl_ms)
        self.lanes = lanes
        # A server that stops answering (a partition, a proxy that stops forwarding) sends
        # no timeout error either: a command with no answer after this long has its
        # connection closed under it and fails with a StoreError naming the wait.
        self.network_timeout = (
            statement_timeout + 5.0 if network_timeout is None else network_timeout
        )
        self.session_options = (
            f"-c statement_timeout={round(statement_timeout * 1000)}"
            f" -c lock_timeout={round(lock_timeout * 1000)}"
            f" -c idle_in_transaction_session_timeout={round(idle_in_transaction_timeout * 1000)}"
        )
        self.url = url
        self.schema = check_schema(schema)
        self.recheck_ms = recheck_ms
        self.safety_recheck_ms = safety_recheck_ms
        self.connect_timeout = connect_timeout
        self._prepare_listening(schema)
        # A supervisor's store holds a lease on the items it activates (hosts.py).
        self.host_timeout = host_timeout
        self.lease = lease_of(self.origin, host_timeout)
        self.reconnects = 0
        # A connection per thread: each lane (and a caller's own thread) has its own.
        self._local = threading.local()
        self._inside = threading.local()
        self._refreshed_at = float("-inf")
        # Prefixes the last batch committed on them left with nothing pending (`batch`).
        self._none_pending: set[str] = set()
        self._closed = False
        self._watchdog = Watchdog(self.network_timeout)
        # The statements each connection has prepared for pipelined batches (lean.py).
        self._statements = Statements()
        conn = self._connect()
        try:
            migrate(conn, schema)
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"cannot migrate the queue schema {schema!r}: {exc}") from exc
        self._local.conn = conn
        self._start_listening(connect_timeout)

    # -- connections ----------------------------------------------------------------------

    def _connect(
        self, *, autocommit: bool = False, application_name: str | None = None
    ) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError("the queue store is closed")
        try:
            conn = psycopg.connect(
                self.url,
                autocommit=autocommit,
                # A server that accepts but never answers is given no longer than one
                # that answers late.
                connect_timeout=max(1, int(min(self.connect_timeout, self.network_timeout))),
                options=f"-c search_path={self.schema} {self.session_options}",
                # A peer that stops answering is noticed in about 20 s, not hours later.
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=2,
                # Says whose connection this is in pg_stat_activity.
                application_name=application_name or f"queryqueue:{self.schema}",
            )
            # psycopg prepares what a connection runs often, and drops every prepared
            # statement of the session on a ROLLBACK (DEALLOCATE ALL), the batches' own
            # (lean.py) with its: preparing is left to them.
            conn.prepare_threshold = None
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the queue database: {exc}") from exc
        self._watchdog.track(conn)
        return conn

    def connection(self) -> psycopg.Connection[Any]:
        """This thread's connection (a lane's, or the caller's), opened or reopened as needed."""
        if self._closed:
            raise StoreError("the queue store is closed")
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self._watchdog.forget(conn)
                with contextlib.suppress(psycopg.Error):
                    conn.close()
                self.reconnects += 1
            fresh = self._connect()
            self._local.conn = fresh
            if conn is not None:
                self._after_outage(fresh)
            return fresh
        return conn

    def _after_outage(self, conn: psycopg.Connection[Any]) -> None:
        """Back after a broken connection: as at a supervisor's start, active items get a
        fresh heartbeat, since nobody could beat them meanwhile; a live one is not reaped
        for the outage, a dead one still is a heartbeat timeout later. Once per second at
        most: the lanes reconnecting after one outage need it only once, and a flapping
        connection should not pay a transaction per reconnect."""
        now = time.monotonic()
        if now - self._refreshed_at < 1.0:
            return
        try:
            with self._watchdog.watching(conn), conn.transaction():
                PostgresTransaction(
                    conn, self._notifying(), self.schema, origin=self.origin, lease=self.lease
                ).refresh_active_heartbeats(self.clock.now_ms())
            self._refreshed_at = now
        except psycopg.Error:
            pass  # the command that reconnected reports what is wrong

    @contextmanager
    def batch(self, prefix: str | None = None) -> Iterator[None]:
        """Group commit: the commands run inside (on this thread) share one transaction
        and one COMMIT; each is a savepoint of it, undone alone if it fails, but for the
        first, which opens the transaction (a failing first command rolls it back: it held
        nothing else). Lost with its connection, the whole batch is re-run (`batched`).
        `prefix`: its lock is taken first (by the command that opens the transaction), so
        that commands by queue id about its items find them in one statement (`find`)."""
        if getattr(self._local, "batch", None) is not None:
            yield
            return
        conn = self.connection()
        batch = Batch(conn, prefix, pipelined=not getattr(self._local, "guarded", True))
        effects: list[Callable[[], object]] = []
        self._local.batch, self._local.effects = batch, effects
        ending = Ending()
        try:
            with self._ended(conn, ending):
                with self._pipelined(batch):
                    yield  # each command is watched on its own (`_command_in`)
                    if batch.failure is not None:
                        raise batch.failure
                    batch.xid_cursors.append(batch.known.flush(batch.lean or conn))
                    if batch.pipelined:
                        self._commit_in_pipeline(batch, ending)
                if conn.info.transaction_status not in (_IDLE, _INTRANS):
                    # A command's undo failed: COMMIT would only roll back, silently.
                    raise StoreError("queue database: the batch's transaction was aborted")
                if conn.info.transaction_status == _INTRANS:
                    with self._watchdog.watching(conn):
                        ending.commit_next(conn, batch.wrote, batch.answered_xid())
                        conn.commit()
            self._saw_pending(batch.known)
        finally:
            self._local.batch = self._local.effects = None
            if not conn.broken and conn.info.transaction_status != _IDLE:  # it did not commit
                with contextlib.suppress(psycopg.Error):
                    conn.rollback()
            self._leave_clean(conn, batch)
        deferred: list[Callable[[], object]] | None = getattr(self._local, "deferred", None)
        if deferred is not None:  # done by whoever defers them (`deferring_effects`)
            deferred.extend(effects)
            return
        for effect in effects:  # decide, then act: only what has committed is told
            effect()

    def _saw_pending(self, known: Known) -> None:
        """A committed batch's counts: whether each prefix it read has anything pending."""
        for prefix, (pending, _) in known.counts.items():
            if pending == 0:
                self._none_pending.add(prefix)
            else:
                self._none_pending.discard(prefix)

    def nothing_pending_seen(self, prefix: str) -> bool:
        return prefix in self._none_pending

    # No `before_commit`: what a batch gives the workers waits for its COMMIT's answer.
    # A COMMIT lost with its connection (a host cut off) leaves the items pending for
    # every host: a worker given one as the COMMIT left would run it beside another
    # host's run of it.

    @contextmanager
    def deferring_effects(self) -> Iterator[list[Callable[[], object]]]:
        effects: list[Callable[[], object]] = []
        self._local.deferred = effects
        try:
            yield effects
        finally:
            self._local.deferred = None

    @contextmanager
    def _command_in(self, batch: Batch) -> Iterator[PostgresTransaction]:
        """One command of a batch. Its effects join the batch's once it has succeeded."""
        if batch.failure is not None:
            raise batch.failure
        conn, outer = batch.conn, self._local.effects
        # The first opens the transaction: failing, it is rolled back (it held nothing
        # else), which spares the one-command batch a savepoint's two round trips.
        pipelined = batch.pipelined
        first = not pipelined and conn.info.transaction_status == _IDLE
        effects: list[Callable[[], object]] = []
        self._local.effects = effects
        tx = PostgresTransaction(
            conn,
            self._notifying(),
            self.schema,
            batch.locked,
            batch.known,
            self.origin,
            pipelined=pipelined,
            foreseen=batch.foreseen,
            head=batch.head,
            executor=batch.lean,
            batch_ahead=batch.ahead,
            lease=self.lease,
            origins=batch.origins,
        )
        try:
            with self._watchdog.watching(conn):
                try:
                    if not (first or pipelined):
                        # The last command's savepoint released and this one's taken in
                        # one round trip (psycopg's own savepoint blocks take two).
                        conn.execute(NEXT_SAVEPOINT if batch.savepoint else SAVEPOINT)
                        batch.savepoint = True
                    elif batch.prefix is not None:
                        tx.lock(batch.prefix)  # the batch's prefix, before any row
                        self._send_expected(batch)
                        tx._head = batch.head
                    yield tx
                except BaseException as exc:
                    if isinstance(exc, Redo):
                        raise
                    failure = self._command_failure(batch, tx, exc, first=first)
                    if failure is exc:
                        raise
                    raise failure from exc
        finally:
            self._local.effects = outer
        batch.kept = True
        batch.xid = batch.xid if batch.xid is not None else tx.xid
        batch.xid_cursors += tx.xid_cursors
        batch.locked |= tx._locked
        batch.known = tx.known
        batch.origins.update(tx.origins)
        batch.wrote = batch.wrote or tx.wrote
        outer.extend(effects)

    def _command_failure(
        self, batch: Batch, tx: PostgresTransaction, exc: BaseException, *, first: bool
    ) -> BaseException:
        """What a failed command of `batch` raises (`exc` itself, or the error that says
        what it did to the batch), its writes undone: the first command's by rolling the
        transaction back, any other's by its savepoint."""
        if batch.pipelined:
            return self._pipelined_failure(batch, tx, exc)
        conn = batch.conn
        with contextlib.suppress(psycopg.Error):
            if first:
                conn.rollback()
                batch.savepoint = False
            elif not conn.broken:
                conn.execute(UNDO_SAVEPOINT)
        if isinstance(exc, psycopg.OperationalError):
            return self._broken(batch, exc)
        if isinstance(exc, psycopg.Error):
            return StoreError(f"queue database: {exc}")
        return exc

    @contextmanager
    def _atomic(self) -> Iterator[PostgresTransaction]:
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is not None:
            with self._command_in(batch) as tx:
                yield tx
            return
        conn = self.connection()
        effects: list[Callable[[], object]] = []
        self._local.effects = effects
        ending = Ending()
        try:
            with self._watchdog.watching(conn), self._ended(conn, ending), conn.transaction():
                tx = PostgresTransaction(
                    conn, self._notifying(), self.schema, origin=self.origin, lease=self.lease
                )
                yield tx
                # Leaving the block sends COMMIT.
                ending.commit_next(conn, tx.wrote, answered_xid(tx.known.flush(conn)))
        finally:
            self._local.effects = None
        for effect in effects:  # decide, then act: only what has committed is told
            effect()

    @contextmanager
    def _ended(self, conn: psycopg.Connection[Any], ending: Ending) -> Iterator[None]:
        """psycopg's errors as the store reports them; a connection lost during COMMIT is
        looked up by the transaction's id, and one that committed after all stands."""
        try:
            yield
        except psycopg.OperationalError as exc:
            if not self._committed_after_all(conn, exc, ending.xid, ending.committing):
                raise
        except psycopg.Error as exc:
            raise StoreError(f"queue database: {exc}") from exc

    def _after_commit(self, effect: Callable[[], object]) -> None:
        effects: list[Callable[[], object]] | None = getattr(self._local, "effects", None)
        if effects is None:
            effect()
        else:
            effects.append(effect)

    def _run_command(self, run: Callable[[], T]) -> T:
        # The one hook: every command (the command table's decorator) runs through here.
        # A command inside another (STALLED calls TO_CANCEL) is retried by the outer one.
        if getattr(self._inside, "command", False) or getattr(self._local, "batch", None):
            return run()
        self._inside.command = True
        try:
            return self._again_if_disconnected(run)
        finally:
            self._inside.command = False

    def _again_if_disconnected(self, command: Callable[[], T]) -> T:
        """Run `command` again on a fresh connection while its connection broke before
        COMMIT (no attempt changed anything), a bounded number of times with backoff;
        then a StoreError says so."""
        delay = RECONNECT_BACKOFF
        for attempt in range(RECONNECT_ATTEMPTS):
            try:
                return command()
            except Disconnected as exc:
                last = exc
                if attempt:  # the first retry at once: one broken connection is common
                    time.sleep(delay)
                    delay *= 2
        raise StoreError(
            f"the queue database connection broke {RECONNECT_ATTEMPTS} times in a row: {last}"
        ) from last

    def batched(
        self, work: Callable[[], T], undo: Callable[[T], object], prefix: str | None = None
    ) -> T:
        """Run first without savepoints; a command that failed after writing (or that the
        database refused) has the batch rolled back and run again with them (`Redo`):
        `work` undoes its own (its waiters) as it unwinds. A batch whose connection broke
        before its COMMIT changed nothing: it runs again whole."""
        once = super().batched

        def attempt() -> T:
            self._local.guarded = False
            try:
                return once(work, undo, prefix)
            except Redo:
                pass
            finally:
                self._local.guarded = True
            return once(work, undo, prefix)

        return self._again_if_disconnected(attempt)

    def beat_host(self) -> int:
        """Renew this host's lease (hosts.py) in a transaction of its own, not a batch's
        (a prefix's lock never holds it up); a failed one is a StoreError. The other
        hosts whose leases hold."""
        if self.lease is None:
            return 0
        with self._unbatched() as conn:
            return self.lease.beat(conn, self.clock.now_ms())

    def close(self) -> None:
        if self.lease is not None and not self._closed:
            with contextlib.suppress(StoreError), self._unbatched() as conn:
                self.lease.leave(conn)
        self._closed = True
        self._stop_thread()
        self._watchdog.close()  # every connection of every thread
        # The listener notices within its poll period and ends by itself (a daemon thread).
        self._listener.join(timeout=0.01)
