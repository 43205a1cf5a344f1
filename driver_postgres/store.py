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
  waiters are woken in-process; `_others_listen`); a notification missed (a listener
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

import asyncio
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import sql

from queryqueue.driver_postgres.ahead import adds_read_ahead
from queryqueue.driver_postgres.batch import (
    Batch,
    Disconnected,
    Ending,
    Head,
    Known,
    Redo,
    send_add_reads,
)
from queryqueue.driver_postgres.lean import Statements
from queryqueue.driver_postgres.schema import PENDING, migrate
from queryqueue.driver_postgres.statements import (
    FIND_BY_ID_IN_PREFIX,
    NEXT_SAVEPOINT,
    SAVEPOINT,
    UNDO_SAVEPOINT,
    answered_xid,
    flush_when_read,
    gone,
    scalar,
)
from queryqueue.driver_postgres.transaction import PostgresTransaction
from queryqueue.driver_postgres.watchdog import Watchdog
from queryqueue.engine import validation as v
from queryqueue.engine.aio import wait_within
from queryqueue.engine.clock import Clock
from queryqueue.engine.errors import StoreError
from queryqueue.engine.group_commit import call_before_commit
from queryqueue.engine.records import (
    ITEM_COLUMNS,
)
from queryqueue.engine.responses import QueueKey, ResultResponse, ResultStatus
from queryqueue.engine.result_rules import blocking_lookup
from queryqueue.engine.store import DEFAULT_RESULT_TTL_MS, QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter

# An ACK from another host: the waiter reads the result itself (NOTIFY carries no payload).
_FETCH = "\x00fetch"

T = TypeVar("T")
_log = logging.getLogger(__name__)
RECONNECT_ATTEMPTS = 4
RECONNECT_BACKOFF = 0.05  # then doubled: the attempts span about a third of a second
LISTEN_CHECK_S = 5.0
# By this long after a listener starts, the hosts that listened alone (and sent no
# NOTIFY) have heard its hello: its waiters then look once more for what they ACKed.
LISTEN_GRACE_S = 1.0
CLAIMED_WAIT_S = 5.0
# The rows a pool's PENDING head is read ahead with beyond what it asks for (`Head`).
HEAD_SPARE = 8
_IDLE, _INTRANS = psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS


def _answered_by_the_ack(key: QueueKey, event: AckEvent) -> ResultResponse | None:
    """The answer a long poll woken by `event` gives without the database: an ACK with
    NULL (no payload), or a result the ACK's own transaction took for a waiter by id
    (a local ACK). None: the result is read, or consumed, in a transaction of its own.
    Decided on the loop, so such a poll costs no hop to a lane and back."""
    if event.result is None or (event.taken and isinstance(key, int)):
        return ResultResponse(
            payload=event.result,
            type=ResultStatus.SUCCESS,
            id=event.id,
            external_id=event.external_id,
        )
    return None


class PostgresQueueStore(QueueStore):
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
        if not schema.replace("_", "").isalnum():
            raise ValueError(f"schema must be letters, digits and _, got {schema!r}")
        self.url = url
        self.schema = schema
        self.recheck_ms = recheck_ms
        self.safety_recheck_ms = safety_recheck_ms
        # LISTEN's state: while it is up no ACK is missed, so parked long polls read the
        # table again only every `safety_recheck_ms`; each reconnect is a new epoch, after
        # which they read it at once (a NOTIFY may have come while it was down).
        self._listen_healthy = False
        self._listen_epoch = 0
        self.connect_timeout = connect_timeout
        self.channel = f"queryqueue_ack_{schema}"
        # Whether another host (a store on this schema elsewhere) listens on the channel:
        # counted by the listener, True until it knows (`_listen`).
        self._others_listen = True
        # Signs this store's NOTIFYs: its own waiters were woken by the ACK as it committed,
        # with the result; its NOTIFY, often first on the listener's thread, would wake
        # them with none, to read it back in a transaction of their own.
        self.origin = uuid.uuid4().hex
        self._hello = orjson.dumps({"hello": True, "from": self.origin}).decode()
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
        self._listening = threading.Event()
        self._listener = threading.Thread(
            target=self._listen, name=f"queryqueue-listen-{schema}", daemon=True
        )
        self._listener.start()
        self._listening.wait(connect_timeout)

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
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the queue database: {exc}") from exc
        self._watchdog.track(conn)
        return conn

    def _connection(self) -> psycopg.Connection[Any]:
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
                    conn, self._notifying(), self.schema, origin=self.origin
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
        conn = self._connection()
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
                    self._committing(batch)
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

    def before_commit(self, callback: Callable[[], object]) -> None:
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is not None:
            batch.committing.append(callback)

    @staticmethod
    def _committing(batch: Batch) -> None:
        """`before_commit`'s callbacks. In a pipelined batch its writes' answers are not
        in yet either: one refused there has the batch run again (`Redo`), which calls
        its own; what they started for nothing finds its item gone (an ACK of nothing)."""
        callbacks, batch.committing = batch.committing, []
        call_before_commit(callbacks)

    @contextmanager
    def deferring_effects(self) -> Iterator[list[Callable[[], object]]]:
        effects: list[Callable[[], object]] = []
        self._local.deferred = effects
        try:
            yield effects
        finally:
            self._local.deferred = None

    @staticmethod
    def _leave_clean(conn: psycopg.Connection[Any], batch: Batch) -> None:
        """A connection the batch could not leave idle and out of autocommit (a pipeline
        cut short by a dying server may be left in any state) is closed, not reused: the
        next command gets a fresh one."""
        try:
            if batch.pipelined and not conn.closed:
                conn.autocommit = False
            if conn.closed or conn.info.transaction_status == _IDLE:
                return
        except psycopg.Error:
            pass
        with contextlib.suppress(psycopg.Error):
            conn.close()

    @contextmanager
    def _pipelined(self, batch: Batch) -> Iterator[None]:
        """A batch's first run (`batched`) sends its statements without waiting for those
        whose answer it does not read (its writes, and its BEGIN): a read waits for all
        before it, the pipeline's end (one round trip, before COMMIT) for what is left.
        Refused there, a statement has the batch run again, guarded and unpipelined
        (`Redo`), where it is its own command's error. The BEGIN is the batch's own
        (psycopg's would wait for its answer): in autocommit mode until it ends."""
        if not batch.pipelined:
            yield
            return
        conn = batch.conn
        conn.autocommit = True
        pipeline = conn.pipeline()
        with self._watchdog.watching(conn):
            pipeline.__enter__()
            flush_when_read(conn)
            batch.lean = self._statements.lean(conn)
            try:
                # Through the lean path where it can: psycopg's cursor for a BEGIN and a
                # COMMIT was ~13 % of its lane's CPU at idle (yappi, 2,000 queries).
                (batch.lean or conn).execute("BEGIN")
            except BaseException as exc:
                with contextlib.suppress(psycopg.Error):
                    pipeline.__exit__(type(exc), exc, exc.__traceback__)
                raise
        try:
            yield
        except BaseException as exc:
            with self._watchdog.watching(conn), contextlib.suppress(psycopg.Error):
                pipeline.__exit__(type(exc), exc, exc.__traceback__)
            raise
        try:
            with self._watchdog.watching(conn):
                pipeline.__exit__(None, None, None)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise  # the batch changed nothing: it runs again whole (`_ended`)
            raise Redo from exc

    @staticmethod
    def _commit_in_pipeline(batch: Batch, ending: Ending) -> None:
        """COMMIT with the pipeline's end, one round trip for both, when the transaction's
        id is known already or it wrote nothing (else COMMIT follows: the id, looked up
        should COMMIT's answer be lost, comes with the pipeline's end)."""
        xid = batch.answered_xid()
        if batch.wrote and xid is None:
            return
        ending.xid, ending.committing = xid, True
        (batch.lean or batch.conn).execute("COMMIT")

    def _pipelined_failure(
        self, batch: Batch, tx: PostgresTransaction, exc: BaseException
    ) -> BaseException:
        """What a command of a pipelined batch that failed raises. One that wrote, or
        that the database refused, has the batch run again, guarded (`Redo`): it cannot
        be undone alone, and the refusal may be an earlier command's. But when nothing of
        the batch is kept yet, a refusal (a lock timeout) is rolled back and the batch
        begins again, as a guarded batch's first command would: run again, it would only
        wait out the same lock."""
        conn = batch.conn
        if isinstance(exc, psycopg.OperationalError) and (
            self._watchdog.abandoned(conn) or gone(conn, exc)
        ):
            return self._broken(batch, exc)
        if not isinstance(exc, psycopg.Error):
            return Redo() if tx.wrote else exc
        if batch.kept or tx.wrote:
            return Redo()
        batch.foreseen.clear()  # read under the lock the rollback lets go
        batch.ahead.clear()
        if batch.head is not None:
            batch.head.drop()
        try:
            with self._watchdog.watching(conn):
                conn.rollback()
                conn.execute("BEGIN")
        except psycopg.Error as undo:
            # Not begun again: nothing more of this batch may run (each statement
            # would commit on its own).
            batch.failure = StoreError(f"queue database: cannot begin again: {undo}")
        if isinstance(exc, psycopg.OperationalError):
            return self._broken(batch, exc)
        return StoreError(f"queue database: {exc}")

    def expect(self, commands: Iterable[Sequence[Any]]) -> None:
        """The ACKs by queue id of a pipelined batch with a prefix (its workers' ACKs, in
        the transaction of the ADDs and the retrieval they free a slot for), and the ADDs
        that come before anything that could change what they read (ahead.py): their
        items, and the ADDs' reads, go with the batch's first statements, so the batch
        waits for all of them at once, not once per ACK or ADD."""
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is None or not batch.pipelined or batch.prefix is None:
            return
        commands = list(commands)
        batch.expected = [
            command[1][0]
            for command in commands
            if command[0] == "ack" and command[1] and type(command[1][0]) is int
        ]
        batch.adds = adds_read_ahead(commands, batch.prefix)

    def expect_retrieval(self, prefix: str, process_id: str | None, limit: int) -> None:
        """The pool's retrieval this pipelined batch of `prefix` will likely make (its
        slot freed or work added): the head of PENDING is read with its first statements
        (`Head`), not after its commands, where it cost a round trip of its own."""
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is not None and batch.pipelined and batch.prefix == prefix:
            batch.retrieval = (prefix, process_id, limit)

    def _send_expected(self, batch: Batch) -> None:
        """`expect`'s reads, after the batch's prefix lock (rows are locked after it, as
        every transaction does, or two could wait on each other)."""
        expected, batch.expected = batch.expected, []
        execute = (batch.lean or batch.conn).execute
        for id in expected:
            if id not in batch.foreseen:
                batch.foreseen[id] = execute(FIND_BY_ID_IN_PREFIX, (id, batch.prefix))
        retrieval, batch.retrieval = batch.retrieval, None
        if retrieval is not None and batch.head is None:
            prefix, process_id, limit = retrieval
            # Rows to spare: the batch's own activations and deletions take some away.
            window = limit + HEAD_SPARE
            cursor = execute(
                f"SELECT {ITEM_COLUMNS}, payload FROM items WHERE prefix = %s AND status = %s"
                " AND (NOT exclusive OR process_id IS NOT DISTINCT FROM %s)"
                " ORDER BY priority DESC, id LIMIT %s",
                (prefix, PENDING, process_id, window),
            )
            batch.head = Head(prefix, process_id, window, cursor)
        adds, batch.adds = batch.adds, []
        if adds:
            now = self.clock.now_ms()
            for add in adds:
                batch.ahead[add.path] = send_add_reads(
                    execute, add.prefix, add.key, add.external_id, now if add.if_no_result else None
                )

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
                    if pipelined:
                        failure = self._pipelined_failure(batch, tx, exc)
                        if failure is exc:
                            raise
                        raise failure from exc
                    with contextlib.suppress(psycopg.Error):
                        if first:
                            conn.rollback()
                            batch.savepoint = False
                        elif not conn.broken:
                            conn.execute(UNDO_SAVEPOINT)
                    if isinstance(exc, psycopg.OperationalError):
                        raise self._broken(batch, exc) from exc
                    if isinstance(exc, psycopg.Error):
                        raise StoreError(f"queue database: {exc}") from exc
                    raise
        finally:
            self._local.effects = outer
        batch.kept = True
        batch.xid = batch.xid if batch.xid is not None else tx.xid
        batch.xid_cursors += tx.xid_cursors
        batch.locked |= tx._locked
        batch.known = tx.known
        batch.wrote = batch.wrote or tx.wrote
        outer.extend(effects)

    def _broken(self, batch: Batch, exc: psycopg.OperationalError) -> StoreError:
        """The error a batch's command reports: its own (a lock or statement timeout), or,
        when its connection broke, what broke the batch (it is re-run whole)."""
        conn = batch.conn
        if self._watchdog.abandoned(conn):
            batch.failure = StoreError(
                f"the queue database did not answer within the network timeout"
                f" ({self.network_timeout:g} s): its connection was closed"
            )
        elif gone(conn, exc):
            batch.failure = Disconnected(f"the queue database went away: {exc}")
        else:
            return StoreError(f"queue database: {exc}")
        return batch.failure

    @contextmanager
    def _atomic(self) -> Iterator[PostgresTransaction]:
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is not None:
            with self._command_in(batch) as tx:
                yield tx
            return
        conn = self._connection()
        effects: list[Callable[[], object]] = []
        self._local.effects = effects
        ending = Ending()
        try:
            with self._watchdog.watching(conn), self._ended(conn, ending), conn.transaction():
                tx = PostgresTransaction(conn, self._notifying(), self.schema, origin=self.origin)
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

    def _committed_after_all(
        self, conn: psycopg.Connection[Any], exc: Exception, xid: int | None, committing: bool
    ) -> bool:
        """The connection failed under a command: True if its COMMIT took effect anyway,
        else the StoreError that says what happened is raised (a `Disconnected` when
        nothing did, so that the command runs again)."""
        if self._watchdog.abandoned(conn) and not committing:
            raise StoreError(
                f"the queue database did not answer within the network timeout"
                f" ({self.network_timeout:g} s): its connection was closed"
            ) from exc
        if not gone(conn, exc):
            raise StoreError(f"queue database: {exc}") from exc
        if not committing:
            raise Disconnected(f"the queue database went away: {exc}") from exc
        if xid is None:  # it wrote nothing: running it again changes nothing either
            raise Disconnected(f"the queue database went away: {exc}") from exc
        status = self._transaction_status(xid)
        if status == "committed":
            return True
        if status == "aborted":
            raise Disconnected(f"the queue database went away before COMMIT: {exc}") from exc
        raise StoreError(
            f"the queue database went away during COMMIT and the outcome is unknown: {exc}"
        ) from exc

    def _transaction_status(self, xid: int) -> str | None:
        """`txid_status` of a transaction whose COMMIT got no answer, asked on a fresh
        connection until the database answers it (a restart takes seconds), within
        `connect_timeout`; None if it never did."""
        deadline = time.monotonic() + self.connect_timeout
        delay = RECONNECT_BACKOFF
        while True:
            try:
                status = scalar(self._connection(), "SELECT txid_status(%s)", (xid,))
                with contextlib.suppress(psycopg.Error):
                    self._local.conn.rollback()
                if status != "in progress":  # its backend may still be finishing it
                    return None if status is None else str(status)
            except (StoreError, psycopg.Error):
                pass
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            # Its lane's other commands (heartbeats among them) queue behind this wait:
            # asked at least every quarter second, it ends soon after the database is back.
            delay = min(delay * 2, 0.25)

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

    def close(self) -> None:
        self._closed = True
        self._stop_thread()
        self._watchdog.close()  # every connection of every thread
        # The listener notices within its poll period and ends by itself (a daemon thread).
        self._listener.join(timeout=0.01)

    # -- LISTEN ----------------------------------------------------------------------------

    def _listen(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                conn = self._connect(autocommit=True, application_name=self._listener_name())
            except StoreError:
                self._listening.set()  # do not hold up the constructor: re-checks cover
                threading.Event().wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                # The hosts that listened alone notify from now on (`_publish`).
                conn.execute("SELECT pg_notify(%s, %s)", (self.channel, self._hello))
                self._count_listeners(conn)
                self._listen_epoch += 1
                self._listen_healthy = True
                self._listening.set()
                delay = 0.05
                checked = time.monotonic()
                heard_at: float | None = checked + LISTEN_GRACE_S
                while not self._closed:
                    for note in conn.notifies(timeout=0.5):
                        self._publish(note.payload)
                    now = time.monotonic()
                    if heard_at is not None and now >= heard_at:
                        # What another host ACKed unannounced before it heard the hello
                        # is found by one more look of each waiter (a new epoch).
                        self._listen_epoch += 1
                        heard_at = None
                    if now - checked >= LISTEN_CHECK_S:
                        # A silent connection is no proof of a live one (a partition
                        # delivers nothing either): one that stops answering is replaced.
                        with self._watchdog.watching(conn):
                            self._count_listeners(conn)
                        checked = time.monotonic()
            except psycopg.Error:
                pass  # reconnect; what was missed meanwhile, re-checks find
            finally:
                self._listen_healthy = False
                self._others_listen = True  # not known while not listening
                with contextlib.suppress(psycopg.Error):
                    conn.close()

    def _listener_name(self) -> str:
        # As pg_stat_activity keeps it (NAMEDATALEN - 1 bytes; a schema name is ASCII).
        return f"queryqueue-listen:{self.schema}"[:63]

    def _count_listeners(self, conn: psycopg.Connection[Any]) -> None:
        """Whether another listener of this schema's channel is connected: ACKs notify
        while one is. One connecting later says so itself (its hello, `_publish`)."""
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (self._listener_name(),),
        ).fetchone()
        self._others_listen = row is not None and int(row[0]) > 0

    def _notifying(self) -> str | None:
        """The channel an ACK's NOTIFY goes to, or None while no other host listens."""
        return self.channel if self._others_listen else None

    def _publish(self, payload: str) -> None:
        try:
            note = orjson.loads(payload)
            if note.get("from") == self.origin:
                return
            if "hello" in note:  # another host has started listening
                self._others_listen = True
                return
            event = AckEvent(
                int(note["id"]), str(note["path"]), None if note["null"] else _FETCH, note["ext"]
            )
        except (ValueError, KeyError, TypeError):
            return
        self.waiters.publish(event)

    # -- RESULT_BLOCKING across hosts -------------------------------------------------------

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        """As in every store, but the ACK may come from any host: woken by its NOTIFY; the
        table is read again only when a notification may have been missed."""
        v.check_key(key)
        v.check_non_negative_ms("timeout", timeout_ms)
        return await self._blocking_until(key, self._deadline(timeout_ms), None)

    async def result_blocking_wait(
        self, key: QueueKey, timeout_ms: int, waiter: Waiter
    ) -> ResultResponse | None:
        return await self._blocking_until(key, self._deadline(timeout_ms), waiter)

    @staticmethod
    def _deadline(timeout_ms: int) -> float:
        return asyncio.get_running_loop().time() + timeout_ms / 1000

    async def _blocking_until(
        self, key: QueueKey, deadline: float, waiter: Waiter | None
    ) -> ResultResponse | None:
        """Until `deadline` (loop time): subscribe, look, wait for the ACK; looked again
        whenever a notification may have been missed. `waiter`: subscribed, and its first
        look done already (in a server's batch)."""
        loop = asyncio.get_running_loop()
        while True:
            if waiter is None:
                waiter = self.waiters.subscribe(key)
                try:
                    found: ResultResponse | None = await self.run_off_loop(
                        self._again_if_disconnected, functools.partial(self._lookup, key)
                    )
                except BaseException:
                    self.waiters.unsubscribe(waiter)
                    raise
                if found is not None:
                    self.waiters.unsubscribe(waiter)
                    return found
            try:
                event = await self._await_ack(waiter, deadline)
                if event is None and waiter.claimed:
                    event = await self._claimed_event(waiter)
            finally:
                self.waiters.unsubscribe(waiter)
            if event is not None:
                answered = _answered_by_the_ack(key, event)
                if answered is not None:  # on the loop: nothing to read or write
                    return answered
                taken: ResultResponse | None = await self.run_off_loop(
                    self._again_if_disconnected, functools.partial(self._take, key, event)
                )
                return taken
            if loop.time() >= deadline:
                return None
            waiter = None  # a notification may have been missed: subscribe, read again

    @staticmethod
    async def _claimed_event(waiter: Waiter) -> AckEvent | None:
        """An ACK on a lane took the result for this waiter, which timed out before it
        committed: its event comes as the ACK commits (within CLAIMED_WAIT_S, or it did
        not commit: nothing was taken)."""
        try:
            return await wait_within(waiter.future, CLAIMED_WAIT_S)
        except TimeoutError:
            return None

    async def _await_ack(self, waiter: Waiter, deadline: float) -> AckEvent | None:
        """The ACK's event; None at the deadline, or when a re-check is due: the listener
        is down or came back (a new epoch), or `safety_recheck_ms` passed."""
        loop = asyncio.get_running_loop()
        epoch, since = self._listen_epoch, loop.time()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                return await wait_within(waiter.future, min(remaining, self.recheck_ms / 1000))
            except TimeoutError:
                if (
                    not self._listen_healthy
                    or self._listen_epoch != epoch
                    or loop.time() - since >= self.safety_recheck_ms / 1000
                ):
                    return None

    def _lookup(self, key: QueueKey) -> ResultResponse | None:
        with self._atomic() as tx:
            return blocking_lookup(tx, key, self.clock.now_ms())

    def _take(self, key: QueueKey, event: AckEvent) -> ResultResponse | None:
        """The result `event` announced, read or consumed (`_answered_by_the_ack` was not
        enough)."""
        with self._atomic() as tx:
            value: str | None = event.result
            if value == _FETCH:
                value = tx.fetch_acked(event.id, self.clock.now_ms())
                if value is None:
                    return None  # expired meanwhile
            # As in every store: a waiter by path takes the row, a waiter by id leaves it.
            if isinstance(key, int):
                tx.mark_result_consumed(event.id)
            else:
                tx.delete_result(event.id)
        return ResultResponse(
            payload=value, type=ResultStatus.SUCCESS, id=event.id, external_id=event.external_id
        )
