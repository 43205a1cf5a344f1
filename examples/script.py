"""A plain script: ask, wait, print. Run it beside a supervisor of queries.py:

python script.py 'SELECT 6 * 7'
"""

from __future__ import annotations

import sys

from queries import app, run_sql

from queryqueue import QueryError


def main(sql: str) -> int:
    try:
        rows = run_sql.run_sync({"sql": sql})
    except QueryError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    finally:
        app.close()
    for row in rows:
        print(*row, sep="\t")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "SELECT 6 * 7"))
