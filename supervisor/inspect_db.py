"""`queryqueue inspect --db queue.db`: the queue as its SQLite file holds it, for when no
supervisor runs (it crashed, it was `kill -9`ed, it is somewhere else). Read-only: the
file is opened `mode=ro`, so nothing here can change what a supervisor will find (a WAL
left by a killed one is read, not checkpointed). Built on sqlite-utils (the `inspect`
extra), the library the project names for its SQLite work.
"""

from __future__ import annotations

import csv
import io
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from queryqueue.driver_sqlite.schema import COUNT_BY_PREFIX
from queryqueue.supervisor import guard
from queryqueue.supervisor.tables import table

_STATUS = {0: "pending", 1: "active"}
_HELD = (
    "queryqueue: {db} is held by a running supervisor; ask it instead "
    "(queryqueue status, or its --http page)"
)


def open_read_only(db: Path) -> Any:
    try:
        import sqlite_utils
    except ImportError as exc:
        raise SystemExit(
            f"queryqueue: inspect needs the inspect extra (pip install 'queryqueue[inspect]'): {exc}"
        ) from None
    if not db.is_file():
        raise SystemExit(f"queryqueue: no database file at {db}")
    if guard.held(guard.lock_path(db)):
        # It writes on: a snapshot taken under it would be stale as soon as it is shown.
        raise SystemExit(_HELD.format(db=db))
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.5)
    database = sqlite_utils.Database(conn)
    try:
        tables = set(database.table_names())
    except sqlite3.OperationalError as exc:
        conn.close()
        if "locked" not in str(exc):
            raise SystemExit(f"queryqueue: cannot read {db}: {exc}") from None
        raise SystemExit(_HELD.format(db=db)) from None  # a writer in exclusive locking mode
    missing = {"items", "results"} - tables
    if missing:
        conn.close()
        raise SystemExit(f"queryqueue: {db} is not a queue database (no {', '.join(missing)})")
    return database


def rows(
    database: Any, what: str, prefix: str | None, now_ms: int | None = None
) -> list[dict[str, Any]]:
    """`items` or `results`, oldest first, optionally of one prefix, as plain dicts."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    if what == "items":
        where, args = ("prefix = ?", [prefix]) if prefix is not None else (None, [])
        found = []
        for row in database["items"].rows_where(where, args, order_by="id"):
            query = _decoded(row["payload"])
            found.append(
                {
                    "queue_id": row["id"],
                    "prefix": row["prefix"],
                    "key": row["key"],
                    "status": _STATUS.get(row["status"], str(row["status"])),
                    "priority": row["priority"],
                    "age_s": round((now - row["created"]) / 1000, 3),
                    "heartbeat_age_s": None
                    if row["heartbeat"] is None
                    else round((now - row["heartbeat"]) / 1000, 3),
                    "handler": query.get("queryHandler") if isinstance(query, dict) else None,
                    "query_key": query.get("queryKey") if isinstance(query, dict) else None,
                    "external_id": row["external_id"],
                    "process_id": row["process_id"],
                }
            )
        return found
    like = [f"{prefix}:%"] if prefix is not None else []
    found = []
    for row in database["results"].rows_where(
        "path LIKE ?" if prefix is not None else None, like, order_by="id"
    ):
        found.append(
            {
                "queue_id": row["id"],
                "path": row["path"],
                "read": bool(row["deleted"]),
                "expires_in_s": round((row["expire"] - now) / 1000, 3),
                "bytes": len(row["value"]),
                "external_id": row["external_id"],
                "value": row["value"] if len(row["value"]) <= 200 else row["value"][:200] + "…",
            }
        )
    return found


def summary(database: Any) -> list[dict[str, Any]]:
    # Counted from the items: the supervisor keeps its counters in memory.
    return [
        {"prefix": prefix, "pending": pending, "active": active}
        for prefix, pending, active in sorted(database.execute(COUNT_BY_PREFIX).fetchall())
    ]


def render(found: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "json":
        return orjson.dumps(found, option=orjson.OPT_INDENT_2, default=str).decode()
    if not found:
        return ""
    out = io.StringIO()
    if fmt == "csv":
        writer = csv.DictWriter(out, fieldnames=list(found[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(found)
        return out.getvalue().rstrip("\n")
    columns = list(found[0])
    return table(columns, [[row[c] for c in columns] for row in found])


def _decoded(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
