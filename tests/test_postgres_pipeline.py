"""The PostgreSQL store's pipeline: its statements read as psycopg would, prepared again
after a failure, the commit and the early hand-off of a fast-tracked query; and the
settings refused before anything is written (a folded schema name, a password in argv)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from queryqueue import StoreError
from tests.pool_util import pool_server
from tests.postgres_hosts_util import HEAD_READ, pipelined_statements
from tests.postgres_util import URL


def test_a_pipelined_batchs_statements_read_as_psycopgs_cursors_would() -> None:
    """A pipelined batch sends its statements through its Lean (lean.py): each prepared
    once per connection, its parameters as text, its answer read as a cursor's (rows one
    by one, the rest, the row count); a parameter of another type (a list) runs through
    psycopg's own `execute`; `%(name)s` used twice is one parameter."""
    import psycopg

    from queryqueue.driver_postgres.lean import Answer, numbered
    from tests.postgres_util import postgres_store

    assert numbered("a = %(x)s AND b = %(y)s OR c = %(x)s") == (
        b"a = $1 AND b = $2 OR c = $1",
        ("x", "y"),
    )
    assert numbered("VALUES (%s, %s)") == (b"VALUES ($1, $2)", 2)
    assert numbered("SELECT %s %% 7") == (b"SELECT $1 % 7", 1)
    with pytest.raises(ValueError, match="mixes"):
        numbered("%s and %(x)s")
    store = postgres_store()
    try:

        def work() -> list[Any]:
            lean = store._local.batch.lean
            assert lean is not None
            rows = lean.execute(
                "SELECT g, %s::text, %s::boolean, %s::bigint FROM generate_series(1, 3) g",
                (None, True, 2**40),
            )
            named = lean.execute("SELECT %(a)s::int + %(a)s::int, %(b)s::text", {"a": 2, "b": "é"})
            listed = lean.execute("SELECT %s::text[]", (["x", "y,z"],))
            assert isinstance(rows, Answer) and not isinstance(listed, Answer)
            # A NUL would cut a text parameter short in libpq: psycopg refuses it, as ever.
            with pytest.raises(psycopg.DataError, match="NUL"):
                lean.execute("SELECT %s::text", ("a\x00b",))
            return [
                rows.fetchone(),
                rows.fetchone(),
                rows.fetchall(),
                rows.fetchone(),
                rows.rowcount,
                named.fetchone(),
                listed.fetchone(),
            ]

        assert store.batched(work, lambda _: None) == [
            (1, None, True, 2**40),
            (2, None, True, 2**40),
            [(3, None, True, 2**40)],
            None,
            3,
            (4, "é"),
            (["x", "y,z"],),
        ]
    finally:
        store.close()


def test_a_rollback_on_the_stores_connection_keeps_its_prepared_statements() -> None:
    """psycopg prepares a statement that a connection runs often, and on a ROLLBACK
    (or a DROP) drops every prepared statement of the session (DEALLOCATE ALL), the
    store's own with its: the store's connections leave preparing to the store."""
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        # A batch: its statements are prepared by the store (lean.py).
        assert store.batched(lambda: store.add("p:a", "{}"), lambda _: None).id is not None
        conn = store.connection()
        for _ in range(10):
            conn.execute("SELECT 1").fetchone()
        conn.rollback()
        held = {row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")}
        conn.rollback()  # left idle, as a batch leaves it
        believed = store._statements._by_conn[conn].names
        assert believed and {name.decode() for name in believed.values()} <= held
        assert store.batched(lambda: store.add("p:b", "{}"), lambda _: None).id is not None
    finally:
        store.close()


def test_a_statement_prepared_in_a_pipeline_that_failed_is_prepared_again() -> None:
    """A statement is the connection's, under its name, once the server answered its
    PREPARE: one whose PREPARE the pipeline skipped (an earlier statement failed) is
    prepared again by the next batch that runs it, and every name the store counts on
    is one the server holds."""
    from tests.postgres_util import postgres_store

    store = postgres_store()
    try:
        sent: list[Any] = []

        def failing() -> None:
            lean = store._local.batch.lean
            sent.append(lean.execute("SELECT %s::int", (1,)))
            sent.append(lean.execute("SELECT 1 / %s::int", (0,)))
            sent.append(lean.execute("SELECT %s::text", ("skipped",)))
            sent[-1].fetchone()

        with pytest.raises(StoreError, match="division by zero"):
            store.batched(failing, lambda _: None)
        conn = store.connection()
        believed = store._statements._by_conn[conn].names
        assert "SELECT %s::int" in believed and "SELECT %s::text" not in believed
        held = {row[0] for row in conn.execute("SELECT name FROM pg_prepared_statements")}
        conn.rollback()  # left idle, as a batch leaves it
        assert {name.decode() for name in believed.values()} <= held

        def again() -> Any:
            return store._local.batch.lean.execute("SELECT %s::text", ("again",)).fetchone()

        assert store.batched(again, lambda _: None) == ("again",)
        assert "SELECT %s::text" in believed
    finally:
        store.close()


def test_what_a_batch_hands_its_workers_waits_for_its_commit() -> None:
    """On PostgreSQL nothing is handed over as a batch's COMMIT leaves (`before_commit`
    is never called): a COMMIT lost with a host's connection leaves its items pending
    for the other hosts, and a worker given one meanwhile would run it beside theirs.
    The batch's writes are all there once it is answered."""
    import psycopg
    from psycopg import sql

    from tests.postgres_util import postgres_store

    store = postgres_store()
    seen: list[str] = []
    try:
        with psycopg.connect(URL, autocommit=True) as other:
            count = sql.SQL("SELECT count(*) FROM {}.items WHERE key = 'a'").format(
                sql.Identifier(store.schema)
            )

            def work() -> Any:
                store.before_commit(lambda: seen.append("as the COMMIT left"))
                return store.add("p:a", "{}")

            added = store.batched(work, lambda _: None)
            assert added.added
            assert seen == []
            row = other.execute(count).fetchone()
            assert row is not None and row[0] == 1
    finally:
        store.close()


async def test_a_fast_tracked_querys_batch_reads_no_pending_head_for_the_pool(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADD_AND_RETRIEVE retrieves what it adds while the prefix has room, so its batch
    sends no read of PENDING's head for the pool ahead (an idle query's batch read it for
    nothing); nor does the ACK's, which frees a slot, as that batch left nothing pending
    (`nothing_pending_seen`)."""
    from tests.postgres_util import postgres_store

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    async with pool_server(postgres_store(), workdir) as (_, _pool, queue):
        await queue.driver.call("ping")
        statements = pipelined_statements(monkeypatch)
        answer = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0}, priority=10
        )
        monkeypatch.undo()
    assert answer["key"] == "urgent"
    transactions: list[list[str]] = []
    current: list[str] = []
    for statement in statements:
        current.append(statement)
        if statement == "COMMIT":
            transactions.append(current)
            current = []
    head = HEAD_READ
    added = [t for t in transactions if any(s.startswith("INSERT INTO items") for s in t)]
    acked = [t for t in transactions if any(s.startswith("DELETE FROM items") for s in t)]
    assert len(added) == 1 and len(acked) == 1, transactions
    assert not [s for s in added[0] if head in s], added[0]
    assert not [s for s in acked[0] if head in s], acked[0]


def test_a_schema_name_postgresql_would_fold_is_refused_before_anything_is_written(
    workdir: Path,
) -> None:
    """Migrations quote a schema's name and sessions do not: "MixedCase" would be created
    as itself and used as "mixedcase", writing into another queue's tables. Only
    lower-case identifiers are taken, by the store and by the command line."""
    import subprocess
    import sys

    from queryqueue.driver_postgres import store as pg

    for name in ("MixedCase", "1st", "a-b", "x" * 64):
        with pytest.raises(ValueError, match="lower-case identifier"):
            pg.PostgresQueueStore("postgresql://nowhere.invalid/none", schema=name)
    refused = subprocess.run(
        [
            sys.executable, "-m", "queryqueue", "supervisor", "--store", URL,
            "--schema", "MixedCase", "--socket", str(workdir / "s.sock"),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--schema: a queue schema is a lower-case" in refused.stderr


def test_a_password_never_comes_from_the_command_line(workdir: Path) -> None:
    """Every local user reads the process list: a URL with a password is refused on the
    command line (without echoing it), and taken from --store-url-file or
    $QUERYQUEUE_STORE. (A bad --schema stops each run right after the URL is read.)"""
    import subprocess
    import sys

    secret = "postgresql://queue:hunter2@127.0.0.1:5432/queue"

    def supervisor(*options: str, env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            [sys.executable, "-m", "queryqueue", "supervisor", "--socket",
             str(workdir / "s.sock"), "--schema", "Bad", *options],
            capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
        )  # fmt: skip

    refused = supervisor("--store", secret)
    assert refused.returncode == 2 and "holds a password" in refused.stderr
    assert "hunter2" not in refused.stderr
    url_file = workdir / "store.url"
    url_file.write_text(secret + "\n")
    url_file.chmod(0o600)
    for taken in (supervisor("--store-url-file", str(url_file)),
                  supervisor(env={"QUERYQUEUE_STORE": secret})):  # fmt: skip
        assert taken.returncode == 2 and "--schema: a queue schema" in taken.stderr
    missing = supervisor("--store-url-file", str(workdir / "nothing"))
    assert missing.returncode == 2 and "--store-url-file:" in missing.stderr
