"""The `queryqueue` command: demo, supervisor, status, sql."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from queryqueue.engine.errors import QueueError
from queryqueue.supervisor.paths import SOCKET_ENV, default_socket_path
from queryqueue.supervisor.tables import table


def _socket_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"supervisor socket (default: ${SOCKET_ENV}, else {default_socket_path({})})",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queryqueue", description="Query execution queue")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the demo workload on a temporary SQLite queue")
    demo.add_argument("--requests", type=int, default=400, help="queries to submit")
    demo.add_argument("--workers", type=int, default=2, help="worker processes")
    demo.add_argument("--rows", type=int, default=1_000_000, help="rows in the warehouse")
    demo.add_argument("--clients", type=int, default=4, help="request processes")
    demo.add_argument("--users", type=int, default=8, help="concurrent users per process")

    sup = commands.add_parser("supervisor", help="host the queue store and serve it on a socket")
    where = sup.add_mutually_exclusive_group(required=True)
    where.add_argument("--db", type=Path, help="SQLite queue database (one host)")
    where.add_argument(
        "--store",
        metavar="URL",
        help="postgresql://... : a queue shared by the supervisors of several hosts",
    )
    sup.add_argument(
        "--schema", default="queryqueue", help="PostgreSQL schema of the queue (with --store)"
    )
    _socket_option(sup)
    sup.add_argument("--synchronous", choices=["NORMAL", "FULL"], default="NORMAL")
    sup.add_argument("--tcp-port", type=int, default=None, help="also listen on 127.0.0.1:PORT")
    sup.add_argument(
        "--app", default=None, help="pkg.module:app, the QueueApp whose handlers workers run"
    )
    sup.add_argument("--workers", type=int, default=0, help="worker processes (with --app)")
    sup.add_argument(
        "--cancel-grace",
        type=float,
        default=10.0,
        help="seconds a worker may keep running a cancelled query before it is terminated",
    )
    sup.add_argument(
        "--max-tasks-per-worker", type=int, default=None, help="recycle a worker after N queries"
    )
    sup.add_argument(
        "--max-memory-per-worker",
        type=int,
        default=None,
        metavar="MB",
        help="recycle a worker whose RSS is above MB after a query",
    )
    sup.add_argument(
        "--shm-threshold",
        type=int,
        default=1024,
        metavar="KB",
        help="results of at least KB kilobytes travel through shared memory (0: never)",
    )

    status = commands.add_parser(
        "status", help="per prefix: pending, active, oldest age; commands/s"
    )
    _socket_option(status)

    sql = commands.add_parser("sql", help="run one QUEUE command given as Cube Store SQL text")
    sql.add_argument("text", help="e.g. \"QUEUE LIST 'prefix'\"")
    _socket_option(sql)

    args = parser.parse_args(argv)
    socket_path: Path = getattr(args, "socket", None) or default_socket_path()
    try:
        if args.command == "supervisor":
            from queryqueue.supervisor.process import run

            if (args.app is None) != (args.workers == 0):
                parser.error("--app and --workers go together")
            if args.store is not None and not args.store.startswith(
                ("postgresql://", "postgres://")
            ):
                parser.error("--store takes a postgresql:// URL")
            return run(
                args.store or args.db,
                socket_path,
                schema=args.schema,
                synchronous=args.synchronous,
                tcp_port=args.tcp_port,
                app=args.app,
                workers=args.workers,
                cancel_grace=args.cancel_grace,
                max_tasks_per_worker=args.max_tasks_per_worker,
                max_memory_per_worker=(
                    args.max_memory_per_worker * 1024 * 1024 if args.max_memory_per_worker else None
                ),
                shm_threshold=args.shm_threshold * 1024 if args.shm_threshold > 0 else None,
            )
        if args.command == "status":
            return asyncio.run(_status(socket_path))
        if args.command == "sql":
            return asyncio.run(_sql(socket_path, args.text))
    except QueueError as exc:
        print(f"queryqueue: {exc}", file=sys.stderr)
        return 1
    from queryqueue.supervisor.demo import run_demo

    return run_demo(
        requests=args.requests,
        workers=args.workers,
        rows=args.rows,
        clients=args.clients,
        users=args.users,
    )


async def _status(socket_path: Path) -> int:
    from queryqueue.supervisor.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path, reconnect_timeout=1.0)
    try:
        stats = await driver.stats()
    finally:
        await driver.close()
    print(
        f"supervisor pid {stats['pid']}, up {stats['uptime_s']:.0f} s, "
        f"{stats['commands_per_s']} commands/s, {stats['connections']} connections, "
        f"{stats['results_held']} results held, {stats['waiters']} waiting"
    )
    rows = [
        [p["prefix"], p["pending"], p["active"], _age(p["oldest_age_ms"])]
        for p in stats["prefixes"]
    ]
    print(table(["prefix", "pending", "active", "oldest"], rows))
    kinds = [
        [name, k["count"], k["errors"], k["p50_ms"], k["p99_ms"]]
        for name, k in stats["commands"].items()
    ]
    print(table(["command", "count", "errors", "p50 ms", "p99 ms"], kinds))
    return 0


async def _sql(socket_path: Path, text: str) -> int:
    from queryqueue.supervisor.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path, reconnect_timeout=1.0)
    try:
        rows = await driver.sql(text)
    finally:
        await driver.close()
    if rows:
        columns = list(rows[0])
        print(table(columns, [[row.get(c) for c in columns] for row in rows]))
    print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return 0


def _age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
