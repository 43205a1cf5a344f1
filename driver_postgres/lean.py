"""A pipelined batch's statements, handed to libpq without a psycopg cursor each.

Under the throughput load a batch runs ~10 statements, and psycopg spent more of the
supervisor's CPU on each `execute` than the database did: a cursor, its adapters map and
transformer, the query's conversion, the prepared-statement bookkeeping, ~30 Python calls
before libpq saw the statement. Here a statement is converted once (`%s` and `%(name)s`
numbered as PostgreSQL's `$n`), prepared once per connection under a name of our own,
its parameters sent as text (PostgreSQL infers their types from the statement, as it does
for psycopg's), and its answer is an `Answer`: a row source with the cursor's `fetchone`,
`fetchall`, `rowcount` and `pgresult`, loaded by psycopg's own (C) loaders.

It rides on psycopg's pipeline, not beside it: each statement is queued as psycopg queues
its own (its command, then its answer in the result queue), so psycopg matches results,
raises errors (the same exceptions, from the same results), flushes, syncs and ends the
pipeline as it always does. Relies on the pipeline's internals, as `_flush_when_read`
does; a parameter of another type than None, bool, int or str (or a str holding a NUL,
which libpq would cut short silently) has the statement run by psycopg's `execute`.
"""

from __future__ import annotations

import functools
import itertools
import re
import weakref
from typing import Any, Protocol

import psycopg
from psycopg import errors as e
from psycopg.adapt import Transformer
from psycopg.pq import ExecStatus

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")
_OK = (ExecStatus.TUPLES_OK, ExecStatus.COMMAND_OK)


class Rows(Protocol):
    """What the store reads a statement's answer through: a psycopg cursor or an Answer."""

    @property
    def pgresult(self) -> Any: ...

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Executor(Protocol):
    def execute(self, query: Any, params: Any = ...) -> Rows: ...


@functools.lru_cache(maxsize=256)
def numbered(query: str) -> tuple[bytes, tuple[str, ...] | int]:
    """`query` with PostgreSQL's placeholders, and what fills them: the names of
    `%(name)s` (a name used twice is one parameter) or the count of `%s`; `%%` is `%`,
    as psycopg reads it."""
    names: list[str] = []
    count = 0

    def number(match: re.Match[str]) -> str:
        nonlocal count
        if match.group(0) == "%%":  # psycopg's escaped percent sign
            return "%"
        name = match.group(1)
        if name is None:
            count += 1
            return f"${count}"
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    text = _PLACEHOLDER.sub(number, query)
    if names and count:
        raise ValueError(f"a query mixes %s and %(name)s placeholders: {query!r}")
    return text.encode(), tuple(names) if names else count


class _Unsupported(Exception):
    pass


def _text(value: Any) -> bytes | None:
    if value is None:
        return None
    kind = type(value)
    if kind is str:
        if "\x00" in value:  # libpq would cut a text parameter there: psycopg refuses it
            raise _Unsupported
        return value.encode()  # type: ignore[no-any-return]
    if kind is bool:
        return b"t" if value else b"f"
    if kind is int:
        return str(value).encode()
    raise _Unsupported


class _Prepared:
    """A connection's statements prepared under our names (confirmed by the server)."""

    __slots__ = ("names", "numbers")

    def __init__(self) -> None:
        self.names: dict[str, bytes] = {}
        self.numbers = itertools.count()


class Lean:
    """One pipelined batch's way to send statements on `conn` (in pipeline mode)."""

    def __init__(self, conn: psycopg.Connection[Any], prepared: _Prepared) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._pipeline: Any = conn._pipeline
        self._prepared = prepared
        # Prepared in this pipeline, not yet confirmed: used by its later statements.
        self._sent: dict[str, bytes] = {}
        self.loader = Transformer.from_context(conn)

    def execute(self, query: Any, params: Any = ()) -> Any:
        if type(query) is not str:
            return self._conn.execute(query, params)
        text, names = numbered(query)
        try:
            if type(names) is int:
                values = [_text(value) for value in params]
            else:
                values = [_text(params[name]) for name in names]  # type: ignore[union-attr]
        except _Unsupported:
            return self._conn.execute(query, params)
        pipeline, pgconn = self._pipeline, self._pgconn
        name = self._prepared.names.get(query) or self._sent.get(query)
        answer = Answer(self)
        with self._conn.lock:
            if pipeline.command_queue:  # psycopg's own commands first, in their order
                self._conn.wait(pipeline._communicate_gen())
            # Into libpq's buffer, as the pipeline's commands go (`_flush_when_read`): the
            # statement leaves when an answer is read or the pipeline ends. Straight to
            # libpq, not through a queued command and a generator `Connection.wait`
            # drives (3.7 -> 2.5 us an `execute` on the benchmark machine).
            if name is None:
                name = self._sent[query] = f"qq_{next(self._prepared.numbers)}".encode()
                pgconn.send_prepare(name, text)
                pipeline.result_queue.append((_Preparing(self._prepared, query, name), None))
            pgconn.send_query_prepared(name, values)
            pipeline.result_queue.append((answer, None))
        return answer


def _check(results: list[Any], encoding: str) -> None:
    """As psycopg's cursor checks a statement's results."""
    if not results:
        raise e.InternalError("got no result from the query")
    for result in results:
        if result.status not in _OK:
            if result.status == ExecStatus.FATAL_ERROR:
                raise e.error_from_result(result, encoding=encoding)
            if result.status == ExecStatus.PIPELINE_ABORTED:
                raise e.PipelineAborted("pipeline aborted")
            raise e.InternalError(f"unexpected result status: {ExecStatus(result.status).name}")


class _Preparing:
    """A PREPARE in the pipeline: its name is the connection's once the server took it."""

    __slots__ = ("name", "prepared", "query")

    def __init__(self, prepared: _Prepared, query: str, name: bytes) -> None:
        self.prepared, self.query, self.name = prepared, query, name

    def _check_results(self, results: list[Any]) -> None:
        _check(results, "utf-8")

    def _set_results(self, results: list[Any]) -> None:
        self.prepared.names[self.query] = self.name


class Answer:
    """A statement's answer, read as a cursor's: its result arrives with the next read
    that waits (psycopg's pipeline sets it), or is waited for here."""

    __slots__ = ("_lean", "_next", "pgresult")

    def __init__(self, lean: Lean) -> None:
        self._lean = lean
        self._next = 0
        self.pgresult: Any = None

    def _check_results(self, results: list[Any]) -> None:
        _check(results, self._lean.loader.encoding)

    def _set_results(self, results: list[Any]) -> None:
        self.pgresult = results[-1]

    def _result(self) -> Any:
        if self.pgresult is None:
            conn = self._lean._conn
            with conn.lock:
                conn.wait(self._lean._pipeline._fetch_gen(flush=True))
        if self.pgresult is None:
            raise e.InternalError("the pipeline returned no result for the statement")
        return self.pgresult

    @property
    def rowcount(self) -> int:
        tuples = self._result().command_tuples
        return -1 if tuples is None else int(tuples)

    def fetchone(self) -> Any:
        result = self._result()
        if self._next >= result.ntuples:
            return None
        loader = self._lean.loader
        loader.set_pgresult(result)
        self._next += 1
        return loader.load_row(self._next - 1, tuple)

    def fetchall(self) -> list[Any]:
        result = self._result()
        first, self._next = self._next, result.ntuples
        if first >= result.ntuples:
            return []
        loader = self._lean.loader
        loader.set_pgresult(result)
        rows: list[Any] = loader.load_rows(first, result.ntuples, tuple)
        return rows


class Statements:
    """The statements each connection has prepared, kept as long as the connection."""

    def __init__(self) -> None:
        self._by_conn: weakref.WeakKeyDictionary[psycopg.Connection[Any], _Prepared] = (
            weakref.WeakKeyDictionary()
        )

    def lean(self, conn: psycopg.Connection[Any]) -> Lean | None:
        """A Lean for `conn`'s pipeline, or None where it cannot be used (no pipeline
        internals as expected, or a client encoding other than UTF-8)."""
        pipeline = conn._pipeline
        if (
            pipeline is None
            or not hasattr(pipeline, "command_queue")
            or not hasattr(pipeline, "result_queue")
            or conn.info.encoding != "utf-8"
        ):
            return None
        prepared = self._by_conn.get(conn)
        if prepared is None:
            prepared = self._by_conn[conn] = _Prepared()
        return Lean(conn, prepared)
