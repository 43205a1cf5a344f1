"""The `queryqueue` command: demo, supervisor, status, sql, cancel."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from queryqueue.driver_socket.paths import SOCKET_ENV, default_socket_path
from queryqueue.engine.errors import QueueError
from queryqueue.engine.version import package_version
from queryqueue.supervisor import guard, logs
from queryqueue.supervisor.linger import POLL_S, WORKER_POLL_S
from queryqueue.supervisor.logs import FORMAT_ENV, LEVEL_ENV, LEVELS
from queryqueue.supervisor.loops import CHOICES, LoopUnavailableError, loop_factory
from queryqueue.supervisor.tables import table

MiB = 1024 * 1024
DB_ENV = "QUERYQUEUE_DB"
APP_ENV = "QUERYQUEUE_APP"
WORKERS_ENV = "QUERYQUEUE_WORKERS"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"queryqueue: ${name} must be a whole number, got {value!r}") from None


def _socket_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"supervisor socket (default: ${SOCKET_ENV}, else {default_socket_path({})})",
    )


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, skipping the ones that have none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="queryqueue", description="Query execution queue", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"queryqueue {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="run the demo workload on a temporary SQLite queue", formatter_class=_Help
    )
    demo.add_argument("--requests", type=int, default=400, help="queries to submit")
    demo.add_argument("--workers", type=int, default=2, help="worker processes")
    demo.add_argument("--rows", type=int, default=1_000_000, help="rows in the warehouse")
    demo.add_argument("--clients", type=int, default=4, help="request processes")
    demo.add_argument("--users", type=int, default=8, help="concurrent users per process")

    sup = commands.add_parser(
        "supervisor", help="host the queue store and serve it on a socket", formatter_class=_Help
    )
    where = sup.add_mutually_exclusive_group()
    where.add_argument(
        "--db",
        type=Path,
        default=os.environ.get(DB_ENV) or None,
        help=f"SQLite queue database (one host); ${DB_ENV}",
    )
    where.add_argument(
        "--store",
        metavar="URL",
        help="postgresql://... : a queue shared by the supervisors of several hosts",
    )
    sup.add_argument(
        "--schema", default="queryqueue", help="PostgreSQL schema of the queue (with --store)"
    )
    sup.add_argument(
        "--pg-statement-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="PostgreSQL: a statement running longer fails with a StoreError naming it",
    )
    sup.add_argument(
        "--pg-lock-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="PostgreSQL: a lock (another client's, another host's) waited for longer fails",
    )
    sup.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="serve /metrics (Prometheus), /api/status and a live status page here"
        " (loopback; the token of --auth-token-file; needs the http extra)",
    )
    sup.add_argument(
        "--http-public",
        action="store_true",
        help="let --http listen on a non-loopback address (still behind the token)",
    )
    sup.add_argument(
        "--log-level",
        choices=LEVELS,
        default=None,
        help=f"records of the supervisor and its workers at this level and above"
        f" (${LEVEL_ENV}, default warning; debug shows every queue event)",
    )
    sup.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help=f"text, or json: one object per line with the event's fields (${FORMAT_ENV})",
    )
    sup.add_argument(
        "--pg-network-timeout",
        type=float,
        default=None,
        metavar="S",
        help="PostgreSQL: a command with no answer from the server this long (a partition)"
        " has its connection closed and fails (default: statement timeout + 5 s)",
    )
    sup.add_argument(
        "--pg-connections",
        type=int,
        default=4,
        metavar="N",
        help="PostgreSQL: connections serving commands; a prefix waiting on a lock holds one",
    )
    _socket_option(sup)
    sup.add_argument(
        "--synchronous",
        choices=["NORMAL", "FULL"],
        default="NORMAL",
        help="SQLite durability: FULL also survives power loss (answers wait for the WAL's fsync, "
        "made once for many commits off the loop)",
    )
    sup.add_argument(
        "--poll-us",
        "--ack-poll-us",
        dest="poll_us",
        type=int,
        default=round(POLL_S * 1e6),
        metavar="US",
        help="when a worker's ACK or a caller's next command usually comes within this many"
        " microseconds, the supervisor polls for it instead of sleeping (0: never; SQLite)",
    )
    sup.add_argument(
        "--worker-poll-us",
        type=int,
        default=round(WORKER_POLL_S * 1e6),
        metavar="US",
        help="when a worker's next query usually comes within this many microseconds of its"
        " last ACK, the worker polls for it instead of sleeping (0: never)",
    )
    sup.add_argument(
        "--tcp-port",
        type=int,
        default=None,
        help="also listen on 127.0.0.1:PORT (0: any free port); clients must send the token",
    )
    sup.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="the TCP listener's secret (a 0600 file, made when missing; default: the "
        "socket's path + .token)",
    )
    sup.add_argument(
        "--app",
        default=os.environ.get(APP_ENV) or None,
        help=f"pkg.module:app, the QueueApp whose handlers workers run (from the current "
        f"directory first); ${APP_ENV}",
    )
    sup.add_argument(
        "--workers",
        type=int,
        default=_int_env(WORKERS_ENV),
        help=f"worker processes (with --app; 2 when --app is given alone); ${WORKERS_ENV}",
    )
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
        "--max-worker-deaths",
        type=int,
        default=3,
        help="a query that kills its worker this many times fails for its waiters",
    )
    sup.add_argument(
        "--max-memory-per-worker",
        type=int,
        default=None,
        metavar="MB",
        help="recycle a worker whose RSS is above MB after a query",
    )
    sup.add_argument(
        "--loop",
        choices=CHOICES,
        default="auto",
        help="the supervisor's and workers' event loop (auto: uvloop where installed)",
    )
    sup.add_argument(
        "--shm-threshold",
        type=int,
        default=1024,
        metavar="KB",
        help="results of at least KB kilobytes travel through shared memory (0: never)",
    )

    limits = sup.add_argument_group("what one connection may cost")
    limits.add_argument(
        "--sql-result-limit",
        type=int,
        default=64,
        metavar="MB",
        help="a SQL-text (Cube) RESULT of a result in shared memory or binary is answered "
        "as JSON up to MB megabytes, else refused naming this limit",
    )
    limits.add_argument(
        "--connection-high-water",
        type=int,
        default=8,
        metavar="MB",
        help="unsent answers past which a connection is not read until its client catches up",
    )
    limits.add_argument(
        "--connection-hard-limit",
        type=int,
        default=512,
        metavar="MB",
        help="unsent answers past which a connection is closed",
    )
    limits.add_argument(
        "--max-long-polls", type=int, default=1024, help="long polls one connection may park"
    )
    limits.add_argument(
        "--shm-max-total",
        type=int,
        default=4096,
        metavar="MB",
        help="shared memory for results, in all (past it, results go through the socket)",
    )
    limits.add_argument(
        "--shm-max-per-connection",
        type=int,
        default=1024,
        metavar="MB",
        help="shared memory one connection may hold (writing or reading)",
    )

    status = commands.add_parser(
        "status",
        help="per prefix: pending, active, oldest age; workers and what they run; commands/s",
        formatter_class=_Help,
    )
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument(
        "--watch", type=float, default=None, metavar="S", help="show it again every S seconds"
    )
    status.add_argument("--count", type=int, default=None, help="with --watch: stop after N times")
    _socket_option(status)

    sql = commands.add_parser(
        "sql", help="run one QUEUE command given as Cube Store SQL text", formatter_class=_Help
    )
    sql.add_argument("text", help="e.g. \"QUEUE LIST 'prefix'\"")
    _socket_option(sql)

    cancel = commands.add_parser(
        "cancel",
        help="cancel a queued or running query: its callers get QueryCancelledError",
        formatter_class=_Help,
    )
    cancel.add_argument(
        "key",
        nargs="?",
        help="a queue id, a path (prefix:hash), or with --prefix a query key hash or the "
        "query key as JSON",
    )
    cancel.add_argument("--prefix", help="the queue's prefix (all prefixes with --request-id)")
    cancel.add_argument("--request-id", help="cancel every query of this request id instead")
    _socket_option(cancel)

    inspect = commands.add_parser(
        "inspect",
        help="read a queue database with no supervisor running (read-only): items, results",
        formatter_class=_Help,
    )
    inspect.add_argument(
        "--db",
        type=Path,
        default=os.environ.get(DB_ENV) or None,
        help=f"the SQLite queue database; ${DB_ENV}",
    )
    inspect.add_argument("--prefix", help="only this queue prefix")
    inspect.add_argument(
        "--results", action="store_true", help="the results held, instead of the items"
    )
    inspect.add_argument(
        "--format", choices=["table", "json", "csv"], default="table", help="how to print them"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the supervisor stopped its workers already; no traceback
    except BrokenPipeError:
        # `queryqueue status | head`: the reader left. Python would print a traceback
        # when it flushes stdout at exit; point stdout at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    socket_path: Path = getattr(args, "socket", None) or default_socket_path()
    try:
        if args.command == "supervisor":
            return _supervisor(parser, args, socket_path)
        if args.command == "status":
            return asyncio.run(_status(socket_path, args.json, args.watch, args.count))
        if args.command == "sql":
            return asyncio.run(_sql(socket_path, args.text))
        if args.command == "inspect":
            return _inspect(parser, args)
        if args.command == "cancel":
            if (args.key is None) == (args.request_id is None):
                parser.error("cancel takes a KEY or --request-id ID")
            return asyncio.run(_cancel(socket_path, args.key, args.prefix, args.request_id))
    except QueueError as exc:
        print(f"queryqueue: {exc}", file=sys.stderr)
        return 1
    from queryqueue.demo import run_demo

    return run_demo(
        requests=args.requests,
        workers=args.workers,
        rows=args.rows,
        clients=args.clients,
        users=args.users,
    )


def _inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from queryqueue.supervisor import inspect_db

    if args.db is None:
        parser.error(f"inspect needs --db FILE (or ${DB_ENV})")
    database = inspect_db.open_read_only(args.db)
    try:
        found = inspect_db.rows(database, "results" if args.results else "items", args.prefix)
        if args.format == "table" and not args.results:
            counts = inspect_db.summary(database)
            if args.prefix is not None:
                counts = [c for c in counts if c["prefix"] == args.prefix]
            print(inspect_db.render(counts, "table") or "no queued items")
            print()
        print(inspect_db.render(found, args.format) or "nothing")
    finally:
        database.conn.close()
    return 0


def _supervisor(
    parser: argparse.ArgumentParser, args: argparse.Namespace, socket_path: Path
) -> int:
    from queryqueue.app import AppNotFoundError, load_app
    from queryqueue.supervisor.process import run
    from queryqueue.supervisor.server import Limits

    if args.db is None and args.store is None:
        parser.error(f"the supervisor needs --db FILE or --store URL (or ${DB_ENV})")
    try:
        logs.configure(args.log_level, args.log_format, role="supervisor")
        http = (
            None if args.http is None else guard.parse_address(args.http, public=args.http_public)
        )
    except ValueError as exc:  # a bad $QUERYQUEUE_LOG_LEVEL, --http address
        parser.error(str(exc))
    workers = args.workers if args.workers is not None else (2 if args.app else 0)
    if (args.app is None) != (workers == 0):
        parser.error("--app and --workers go together")
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store takes a postgresql:// URL")
    for option, value in (("--poll-us", args.poll_us), ("--worker-poll-us", args.worker_poll_us)):
        if value < 0:
            parser.error(f"{option} takes 0 (never poll) or more microseconds")
    if args.app is not None:
        try:  # here, so a typo is one line and not a worker's traceback
            load_app(args.app)
        except AppNotFoundError as exc:
            print(f"queryqueue: {exc}", file=sys.stderr)
            return 2
    try:
        loop_factory(args.loop)
    except LoopUnavailableError as exc:
        parser.error(str(exc))
    return run(
        args.store or args.db,
        socket_path,
        event_loop=args.loop,
        poll_s=args.poll_us / 1e6,
        schema=args.schema,
        synchronous=args.synchronous,
        tcp_port=args.tcp_port,
        auth_token_file=args.auth_token_file,
        http=http,
        postgres_options={
            "statement_timeout": args.pg_statement_timeout,
            "lock_timeout": args.pg_lock_timeout,
            "network_timeout": args.pg_network_timeout,
            "connections": args.pg_connections,
        },
        limits=Limits(
            high_water=args.connection_high_water * MiB,
            hard_limit=args.connection_hard_limit * MiB,
            max_parked=args.max_long_polls,
            max_sql_result=args.sql_result_limit * MiB,
        ),
        shm_caps=(args.shm_max_total * MiB, args.shm_max_per_connection * MiB),
        app=args.app,
        workers=workers,
        cancel_grace=args.cancel_grace,
        worker_poll_s=args.worker_poll_us / 1e6,
        max_tasks_per_worker=args.max_tasks_per_worker,
        max_worker_deaths=args.max_worker_deaths,
        max_memory_per_worker=(
            args.max_memory_per_worker * 1024 * 1024 if args.max_memory_per_worker else None
        ),
        shm_threshold=args.shm_threshold * 1024 if args.shm_threshold > 0 else None,
    )


async def _status(socket_path: Path, as_json: bool, watch: float | None, count: int | None) -> int:
    from queryqueue.driver_socket.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path, reconnect_timeout=1.0)
    shown = 0
    try:
        while True:
            stats = await driver.stats()
            if as_json:
                print(orjson.dumps(stats).decode(), flush=True)
            else:
                _print_status(stats)
            shown += 1
            if watch is None or (count is not None and shown >= count):
                return 0
            await asyncio.sleep(watch)
    finally:
        await driver.close()


def _print_status(stats: dict[str, Any]) -> None:
    print(
        f"supervisor pid {stats['pid']}, up {stats['uptime_s']:.0f} s, "
        f"{stats['commands_per_s']} commands/s, {stats['connections']} connections, "
        f"{stats['results_held']} results held, {stats['waiters']} waiting"
    )
    pool = stats.get("pool")
    if pool is not None:
        short = "" if pool["alive"] >= pool["size"] else " (SHORT"
        if short and pool.get("spawn_error"):
            short += f": spawning fails: {pool['spawn_error']}"
        print(
            f"pool: {pool['alive']} of {pool['size']} workers{short}{')' if short else ''}, "
            f"{pool['replaced']} replaced, {pool['terminated']} terminated"
        )
        workers = [
            [
                w["pid"],
                w["state"],
                "-" if w["rss"] is None else f"{w['rss'] / 1e6:.0f} MB",
                w["executed"],
                (w["running"] or {}).get("path", "-"),
                _age(None if not w["running"] else _ms(w["running"]["running_s"])),
            ]
            for w in pool["workers"]
        ]
        print(table(["worker", "state", "rss", "ran", "running", "for"], workers))
    rows = [
        [p["prefix"], p["pending"], p["active"], _age(p["oldest_age_ms"])]
        for p in stats["prefixes"]
    ]
    print(table(["prefix", "pending", "active", "oldest"], rows))
    kinds = [
        [name, k["count"], k["errors"], k["p50_ms"], k["p99_ms"]]
        for name, k in stats["commands"].items()
    ]
    print(table(["command", "count", "errors", "p50 ms", "p99 ms"], kinds), flush=True)


async def _cancel(
    socket_path: Path, key: str | None, prefix: str | None, request_id: str | None
) -> int:
    from queryqueue.driver_socket.client import SocketQueueDriver
    from queryqueue.engine.hashing import hash_query_key
    from queryqueue.engine.outcome import encode_cancelled
    from queryqueue.engine.queue import QueryQueue

    driver = SocketQueueDriver(socket_path, reconnect_timeout=1.0)

    async def nobody(*_: object) -> None:
        """The worker running it hears of the cancel from the supervisor, not from here."""

    try:
        if request_id is not None:
            prefixes = (
                [prefix] if prefix else [p["prefix"] for p in (await driver.stats())["prefixes"]]
            )
            cancelled = []
            for name in prefixes:
                queue = QueryQueue(
                    name, query_handlers={}, driver=driver, send_cancel_message_fn=nobody
                )
                cancelled += [
                    f"{name}:{entry['queryKeyHash']}"
                    for entry in await queue.cancel_query_by_request_id(request_id)
                ]
            for path in cancelled:
                print(f"cancelled {path}")
            if not cancelled:
                print(
                    f"queryqueue: no queued or running query has request id {request_id!r}",
                    file=sys.stderr,
                )
            return 0 if cancelled else 1
        assert key is not None
        target: int | str
        if key.isdigit():
            target = int(key)
        elif prefix is None:
            target = key  # a path: prefix:hash
        else:
            try:
                query_key = orjson.loads(key)
            except orjson.JSONDecodeError:
                query_key = None
            hashed = key if query_key is None else hash_query_key(query_key)
            target = f"{prefix}:{hashed}"
        removed = await driver.cancel(target, result=encode_cancelled())
    finally:
        await driver.close()
    if removed is None:
        print(f"queryqueue: nothing queued or running as {target!r}", file=sys.stderr)
        return 1
    print(f"cancelled {target}")
    return 0


async def _sql(socket_path: Path, text: str) -> int:
    from queryqueue.driver_socket.client import SocketQueueDriver

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


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
