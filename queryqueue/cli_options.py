"""The `queryqueue` command's arguments: one function a subcommand, the supervisor's
options by what they are about (the store, listening, the pool, observing, limits)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from queryqueue.driver_socket.paths import SOCKET_ENV, default_socket_path
from queryqueue.engine.version import package_version
from queryqueue.supervisor.logs import FORMAT_ENV, LEVEL_ENV, LEVELS
from queryqueue.supervisor.loops import CHOICES
from queryqueue.supervisor.settings import DEFAULT_STOP_GRACE

DB_ENV = "QUERYQUEUE_DB"
APP_ENV = "QUERYQUEUE_APP"
WORKERS_ENV = "QUERYQUEUE_WORKERS"
WORKER_CONCURRENCY_ENV = "QUERYQUEUE_WORKER_CONCURRENCY"
STORE_ENV = "QUERYQUEUE_STORE"


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


def parser() -> argparse.ArgumentParser:
    """Every subcommand of `queryqueue` and its options."""
    parser = argparse.ArgumentParser(
        prog="queryqueue", description="Query execution queue", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"queryqueue {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    for add in (
        _demo_command,
        _supervisor_command,
        _status_command,
        _health_command,
        _reload_command,
        _sql_command,
        _cancel_command,
        _inspect_command,
    ):
        add(commands)
    return parser


def _demo_command(commands: Any) -> None:
    demo = commands.add_parser(
        "demo", help="run the demo workload on a temporary SQLite queue", formatter_class=_Help
    )
    demo.add_argument("--requests", type=int, default=400, help="queries to submit")
    demo.add_argument("--workers", type=int, default=2, help="worker processes")
    demo.add_argument("--rows", type=int, default=1_000_000, help="rows in the warehouse")
    demo.add_argument("--clients", type=int, default=4, help="request processes")
    demo.add_argument("--users", type=int, default=8, help="concurrent users per process")


def _supervisor_command(commands: Any) -> None:
    sup = commands.add_parser(
        "supervisor", help="host the queue store and serve it on a socket", formatter_class=_Help
    )
    for add in (
        _store_options,
        _postgres_options,
        _listening_options,
        _pool_options,
        _worker_limit_options,
        _observing_options,
        _limit_options,
    ):
        add(sup)


def _store_options(sup: argparse.ArgumentParser) -> None:
    """Where the queue lives: a SQLite file, or PostgreSQL shared by several hosts."""
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
        default=os.environ.get(STORE_ENV) or None,
        help="postgresql://... : a queue shared by the supervisors of several hosts; its"
        f" password from PGPASSWORD, ~/.pgpass or a service file, never here; ${STORE_ENV}",
    )
    where.add_argument(
        "--store-url-file",
        type=Path,
        metavar="FILE",
        help="read the postgresql:// URL from FILE (one that may hold a password: the"
        " process list shows every argument to every local user)",
    )
    sup.add_argument(
        "--synchronous",
        choices=["NORMAL", "FULL"],
        default="NORMAL",
        help="SQLite durability: FULL also survives power loss (answers wait for the WAL's fsync, "
        "made once for many commits off the loop)",
    )


def _positive_seconds(text: str) -> float:
    """An option's seconds: a number above 0 (argparse names the option when it fails)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def _postgres_options(sup: argparse.ArgumentParser) -> None:
    """A queue on PostgreSQL: its schema, its sessions' timeouts, its connections."""
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
        "--pg-network-timeout",
        type=float,
        default=None,
        metavar="S",
        help="PostgreSQL: a command with no answer from the server this long (a partition)"
        " has its connection closed and fails (default: statement timeout + 5 s)",
    )
    sup.add_argument(
        "--pg-host-timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="S",
        help="PostgreSQL: a host unseen this long (dead, or cut off from the database) has"
        " its running queries reaped by the other hosts, to run again; a host cut off for"
        " half of it stops them itself first",
    )
    sup.add_argument(
        "--pg-connections",
        type=int,
        default=4,
        metavar="N",
        help="PostgreSQL: connections serving commands; a prefix waiting on a lock holds one",
    )


def _observing_options(sup: argparse.ArgumentParser) -> None:
    """What an operator sees: the status page and metrics, the logs."""
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


def _listening_options(sup: argparse.ArgumentParser) -> None:
    """Where callers reach the supervisor, and how it waits for them."""
    _socket_option(sup)
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


def _pool_options(sup: argparse.ArgumentParser) -> None:
    """The worker pool: whose handlers it runs, its processes, their limits."""
    sup.add_argument(
        "--app",
        action="append",
        help=f"pkg.module:app, the QueueApp whose handlers workers run (from the current "
        f"directory first); again for another queue, each with a pool of its own; ${APP_ENV}",
    )
    sup.add_argument(
        "--workers",
        type=int,
        default=_int_env(WORKERS_ENV),
        help=f"worker processes (with --app; by default enough for its queue's concurrency)"
        f"; ${WORKERS_ENV}",
    )
    sup.add_argument(
        "--worker-concurrency",
        type=int,
        default=_int_env(WORKER_CONCURRENCY_ENV),
        metavar="N",
        help="queries each worker runs at once: async handlers as tasks, sync ones on threads"
        f" (default: the app's worker_concurrency, 1 unless set); ${WORKER_CONCURRENCY_ENV}",
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


def _worker_limit_options(sup: argparse.ArgumentParser) -> None:
    """How long a worker's query may run on when it should stop, and when a worker goes."""
    sup.add_argument(
        "--cancel-grace",
        type=float,
        default=10.0,
        help="seconds a worker may keep running a cancelled query before it is terminated",
    )
    sup.add_argument(
        "--stop-grace",
        type=float,
        default=DEFAULT_STOP_GRACE,
        metavar="S",
        help="on SIGTERM, seconds running queries may take to finish; the rest are ended and"
        " pending again, for the next supervisor",
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


def _limit_options(sup: argparse.ArgumentParser) -> None:
    """What one connection may cost."""
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
        "--max-shared-result",
        type=int,
        default=64,
        metavar="MB",
        help="on PostgreSQL (a store several hosts share): a larger result fails its query"
        " with an error naming this limit",
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


def _status_command(commands: Any) -> None:
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


def _health_command(commands: Any) -> None:
    health = commands.add_parser(
        "health",
        help="exit 0 if the supervisor answers (store and loop) and its pool has its workers,"
        " else 1: for systemd and container health checks",
        formatter_class=_Help,
    )
    health.add_argument(
        "--within", type=float, default=5.0, metavar="S", help="how long to wait for an answer"
    )
    _socket_option(health)


def _reload_command(commands: Any) -> None:
    reload = commands.add_parser(
        "reload",
        help="roll out new handler code: workers finish what they hold and are replaced by"
        " ones that import it (refused, old workers kept, if it does not import)",
        formatter_class=_Help,
    )
    _socket_option(reload)


def _sql_command(commands: Any) -> None:
    sql = commands.add_parser(
        "sql", help="run one QUEUE command given as Cube Store SQL text", formatter_class=_Help
    )
    sql.add_argument("text", help="e.g. \"QUEUE LIST 'prefix'\"")
    _socket_option(sql)


def _cancel_command(commands: Any) -> None:
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


def _inspect_command(commands: Any) -> None:
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
