"""A DuckDB queue whose handler answers with Arrow: the table is written once into shared
memory by the worker and read by the caller without JSON.

    cd examples
    queryqueue supervisor --db duck.db --app duckdb_app:app --workers 2
    python duckdb_caller.py

Needs `pip install 'queryqueue[arrow]' duckdb` (pandas and Polars for the caller's
conversions).
"""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa

from queryqueue import QueueApp, SetCancelHandler

app = QueueApp("duckdb", concurrency=2)


@app.handler("sql")
def run_sql(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> pa.Table:
    """Runs `query["sql"]` in a private in-memory DuckDB; its rows as an Arrow table."""
    connection = duckdb.connect(":memory:")
    set_cancel_handler("duckdb")  # a real app would keep the connection to interrupt()
    try:
        return connection.sql(query["sql"], params=query.get("params") or None).to_arrow_table()
    finally:
        connection.close()


@app.handler("scalar")
def run_scalar(query: dict[str, Any], set_cancel_handler: SetCancelHandler) -> Any:
    """One row as JSON: DuckDB's DECIMAL, DATE and TIMESTAMPTZ come back as Decimal, date
    and an aware datetime (the result codec), not as strings."""
    connection = duckdb.connect(":memory:")
    try:
        connection.execute("SET TimeZone = 'UTC'")  # aware datetimes in UTC, wherever we run
        columns = connection.execute(query["sql"])
        names = [d[0] for d in columns.description]
        row = columns.fetchone()
        return None if row is None else dict(zip(names, row, strict=True))
    finally:
        connection.close()
