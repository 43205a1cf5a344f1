"""A PostgreSQL batch on the wire: sent as a pipeline, and its COMMIT's outcome looked up
when the answer is lost.

Its statements leave without waiting for the answers it does not read, what it will
read is sent with its first statements, and its COMMIT goes with the pipeline's end
where it can. A connection lost during COMMIT is asked about on a fresh one
(`txid_status`): committed, the batch's answers stand; aborted, it runs again.

A batch's first run is pipelined (`batched`); a statement refused there has the batch
run again, guarded and unpipelined (`Redo`), where it is its own command's error. A base
of `PostgresQueueStore`, whose connections and watchdog it uses.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from queryqueue.driver_postgres.ahead import adds_read_ahead
from queryqueue.driver_postgres.batch import Batch, Disconnected, Ending, Head, Redo, send_add_reads
from queryqueue.driver_postgres.lean import Statements
from queryqueue.driver_postgres.listening import AckListening
from queryqueue.driver_postgres.pool_head import HEAD_SPARE, HEAD_WINDOW
from queryqueue.driver_postgres.schema import PENDING
from queryqueue.driver_postgres.statements import (
    FIND_BY_ID_IN_PREFIX,
    flush_when_read,
    gone,
    scalar,
)
from queryqueue.driver_postgres.transaction import PostgresTransaction
from queryqueue.engine.add_rules import reuse_of
from queryqueue.engine.errors import StoreError

RECONNECT_BACKOFF = 0.05  # then doubled: the attempts span about a third of a second
_IDLE = psycopg.pq.TransactionStatus.IDLE


class PipelinedBatches(AckListening):
    _local: threading.local
    _statements: Statements
    network_timeout: float
    connect_timeout: float
    result_ttl_ms: int

    @abstractmethod
    def connection(self) -> psycopg.Connection[Any]: ...

    @contextmanager
    def _unbatched(self) -> Iterator[psycopg.Connection[Any]]:
        """This thread's connection in a transaction of its own, watched for the network
        timeout; a database error is a StoreError (the next call reconnects)."""
        conn = self.connection()
        try:
            with self._watchdog.watching(conn), conn.transaction():
                yield conn
        except psycopg.Error as exc:
            raise StoreError(f"the queue database failed: {exc}") from exc

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
            cursor = execute(HEAD_WINDOW, (self.origin, prefix, PENDING, process_id, window))
            batch.head = Head(prefix, process_id, window, cursor)
        adds, batch.adds = batch.adds, []
        if adds:
            now = self.clock.now_ms()
            for add in adds:
                reuse = reuse_of(now, add.if_no_result, add.max_age_ms, self.result_ttl_ms)
                batch.ahead[add.path] = send_add_reads(
                    execute, add.prefix, add.key, add.external_id, reuse
                )

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
                status = scalar(self.connection(), "SELECT txid_status(%s)", (xid,))
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
