"""The results table as one command of the PostgreSQL store reads and writes it: a base of
`PostgresTransaction`, which gives it its statements and what its batch read ahead."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from queryqueue.driver_postgres.batch import AddReads
from queryqueue.driver_postgres.lean import Rows
from queryqueue.driver_postgres.statements import (
    INSERT_RESULT,
    LATEST_RESULT_BY_PATH,
    RESULT_EXPIRE,
)
from queryqueue.engine.records import RESULT_COLUMNS, StoredResult, result_from_row
from queryqueue.engine.responses import QueueId


class ResultRows(ABC):
    # Where an ACK's NOTIFY goes (None: no other host listens), the items whose NOTIFY
    # went with their result's INSERT, and the batch's reads sent ahead, with the time
    # the result read ahead was read for.
    _channel: str | None
    _notified: set[int]
    _batch_ahead: dict[str, AddReads]
    _result_since: int | None

    @abstractmethod
    def _write(self, query: str, params: tuple[Any, ...] = ()) -> Rows: ...

    @abstractmethod
    def _one(self, query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None: ...

    @abstractmethod
    def _read_ahead(self, *asked: Any) -> tuple[bool, tuple[Any, ...] | None]: ...

    @abstractmethod
    def _note(self, id: QueueId, path: str, null: bool, external_id: str | None) -> str: ...

    @abstractmethod
    def _notify_condition(self, item_id: int, path: str) -> tuple[str, tuple[str, ...]]: ...

    def insert_result(self, result: StoredResult) -> None:
        # A result is only ever inserted as its item is completed (an ACK, or a CANCEL
        # with a result), which then notifies the other hosts listening (`acked`): the
        # NOTIFY rides on this INSERT, one statement (a round of psycopg and a backend
        # wake-up) fewer; with none listening, there is none (watches.py: whom it tells).
        values = (
            result.id,
            result.path,
            result.value,
            result.deleted,
            result.expire,
            result.external_id,
            result.consumed_by,
        )
        if self._channel is None:
            self._write(INSERT_RESULT, values)
            return
        self._notified.add(result.id)
        condition, params = self._notify_condition(result.id, result.path)
        self._write(
            f"WITH stored AS ({INSERT_RESULT}) SELECT pg_notify(%s, %s){condition}",
            (
                *values,
                self._channel,
                self._note(result.id, result.path, False, result.external_id),
                *params,
            ),
        )

    def result_by_id(self, id: QueueId, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE id = %s AND expire > %s"
                " AND NOT taken FOR UPDATE",
                (id, now),
            )
        )

    def latest_result_by_path(self, path: str, now: int) -> StoredResult | None:
        since, sent, row = self._result_since, False, None
        if since is not None:
            sent, row = self._read_ahead("result", path)
            # Read ahead as of `since` (the batch's start, at most now): the path's latest
            # result unexpired then is its latest now too if it still is, and none then is
            # none now. One that expired between is read again, and so are the next ADDs'
            # reads: the id read ahead with it may not be the one this ADD needs (it may
            # insert in its turn, after the ids the next ones took: they leave theirs
            # unused).
            if sent and (since > now or (row is not None and row[RESULT_EXPIRE] <= now)):
                self._batch_ahead.clear()
                sent = False
        if not sent:
            row = self._one(LATEST_RESULT_BY_PATH, (path, now))
        return result_from_row(row)

    def latest_result_by_external_id(self, external_id: str, now: int) -> StoredResult | None:
        return result_from_row(
            self._one(
                f"SELECT {RESULT_COLUMNS} FROM results WHERE external_id = %s AND expire > %s"
                " AND NOT taken ORDER BY id DESC LIMIT 1 FOR UPDATE",
                (external_id, now),
            )
        )

    def mark_result_consumed(self, id: QueueId, consumer: str | None = None) -> None:
        self._write(
            "UPDATE results SET deleted = true, consumed_by = %s WHERE id = %s AND NOT deleted",
            (consumer, id),
        )

    def delete_result(self, id: QueueId) -> None:
        # Taken rather than deleted: gone for every read, but the waiters of other hosts,
        # woken by the same ACK, can still fetch it (see `fetch_acked`) until it expires.
        self._write("UPDATE results SET deleted = true, taken = true WHERE id = %s", (id,))

    def fetch_acked(self, id: QueueId, now: int) -> str | None:
        row = self._one("SELECT value FROM results WHERE id = %s AND expire > %s", (id, now))
        return None if row is None else str(row[0])

    def purge_expired_results(self, now: int, limit: int) -> int:
        # A bounded batch, skipping rows another host is purging: never a long lock.
        # Counted by the statement: a pipelined write has no row count to read yet.
        # Expired watches (watches.py) go with them, in the same statement.
        row = self._write(
            "WITH gone AS (DELETE FROM results WHERE id IN (SELECT id FROM results"
            " WHERE expire <= %s LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING 1),"
            " unwatched AS (DELETE FROM watches WHERE path IN (SELECT path FROM watches"
            " WHERE expire <= %s LIMIT %s FOR UPDATE SKIP LOCKED))"
            " SELECT count(*) FROM gone",
            (now, limit, now, limit),
        ).fetchone()
        return 0 if row is None else int(row[0])
