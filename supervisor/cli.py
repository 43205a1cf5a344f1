"""The `queryqueue` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queryqueue", description="Query execution queue")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the demo workload on a temporary SQLite queue")
    demo.add_argument("--requests", type=int, default=200, help="queries to submit")
    demo.add_argument("--concurrency", type=int, default=4, help="queries run at once")
    demo.add_argument("--db", default=None, help="queue database (default: a temp file)")
    args = parser.parse_args(argv)
    from supervisor.demo import run_demo

    return run_demo(requests=args.requests, concurrency=args.concurrency, db=args.db)


if __name__ == "__main__":
    sys.exit(main())
