"""Ask the DuckDB queue for a million rows as Arrow, then use them with pandas and Polars.
Run it beside a supervisor of duckdb_app.py (see there).

python duckdb_caller.py 1000000
"""

from __future__ import annotations

import sys

import polars as pl
from duckdb_app import app, run_scalar, run_sql

SQL = "SELECT i AS id, i * 0.5 AS value, 'row ' || i AS name FROM range(?) t(i)"


def main(rows: int) -> int:
    try:
        table = run_sql.run_sync({"sql": SQL, "params": [rows]})
        frame = table.to_pandas()  # pandas, from the Arrow table
        print("pandas", len(frame), frame["value"].sum())
        polars = pl.from_arrow(table)  # Polars, sharing its buffers
        assert isinstance(polars, pl.DataFrame)
        print("polars", polars.height, polars["id"].max())
        one = run_scalar.run_sync(
            {
                "sql": "SELECT 12.50::DECIMAL(10,2) AS price, DATE '2026-12-01' AS day, "
                "TIMESTAMPTZ '2026-12-01 09:30:00+00' AS at"
            },
        )
        print("typed", *(f"{k}={type(v).__name__}:{v}" for k, v in one.items()))
    finally:
        app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000))
