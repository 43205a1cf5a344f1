"""The `queryqueue` command: demo, supervisor, status, health, reload, sql, cancel,
inspect."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from queryqueue import cli_options
from queryqueue.cli_options import DB_ENV
from queryqueue.driver_socket.paths import default_socket_path
from queryqueue.engine.errors import QueueError
from queryqueue.engine.queue import DEFAULT_CONCURRENCY
from queryqueue.supervisor import guard, logs
from queryqueue.supervisor.loops import LoopUnavailableError, loop_factory
from queryqueue.supervisor.tables import table

MiB = 1024 * 1024


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
    parser = cli_options.parser()
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
        if args.command == "health":
            return asyncio.run(_health(socket_path, args.within))
        if args.command == "reload":
            return asyncio.run(_reload(socket_path))
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
    from queryqueue.supervisor.process import run
    from queryqueue.supervisor.server import Limits

    http, _ = _checked(parser, args)
    shared = args.store is not None  # PostgreSQL: hosts share the budget by their workers
    sizes = [
        _pool_size(app, args.workers, args.worker_concurrency, shared=shared)
        for app in args.app or []
    ]
    if 0 in sizes:
        return 2
    return run(
        args.store or args.db,
        socket_path,
        event_loop=args.loop,
        schema=args.schema,
        synchronous=args.synchronous,
        tcp_port=args.tcp_port,
        auth_token_file=args.auth_token_file,
        http=http,
        postgres_options={
            "statement_timeout": args.pg_statement_timeout,
            "lock_timeout": args.pg_lock_timeout,
            "network_timeout": args.pg_network_timeout,
            "host_timeout": args.pg_host_timeout,
            "connections": args.pg_connections,
        },
        limits=Limits(
            high_water=args.connection_high_water * MiB,
            hard_limit=args.connection_hard_limit * MiB,
            max_parked=args.max_long_polls,
            max_sql_result=args.sql_result_limit * MiB,
            max_shared_result=args.max_shared_result * MiB,
        ),
        shm_caps=(args.shm_max_total * MiB, args.shm_max_per_connection * MiB),
        app=args.app or None,
        workers=sizes,
        worker_concurrency=args.worker_concurrency,
        cancel_grace=args.cancel_grace,
        stop_grace=args.stop_grace,
        max_tasks_per_worker=args.max_tasks_per_worker,
        max_worker_deaths=args.max_worker_deaths,
        max_memory_per_worker=(
            args.max_memory_per_worker * 1024 * 1024 if args.max_memory_per_worker else None
        ),
        shm_threshold=args.shm_threshold * 1024 if args.shm_threshold > 0 else None,
    )


def _checked(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[tuple[str, int] | None, int]:
    """The supervisor's options, checked together: its --http address and its workers."""
    if args.db is None and args.store is None and args.store_url_file is None:
        parser.error(f"the supervisor needs --db FILE or --store URL (or ${DB_ENV})")
    try:
        logs.configure(args.log_level, args.log_format, role="supervisor")
        http = (
            None if args.http is None else guard.parse_address(args.http, public=args.http_public)
        )
    except ValueError as exc:  # a bad $QUERYQUEUE_LOG_LEVEL, --http address
        parser.error(str(exc))
    if args.app is None and os.environ.get(cli_options.APP_ENV):
        args.app = [os.environ[cli_options.APP_ENV]]
    workers = args.workers if args.workers is not None else (1 if args.app else 0)
    if (args.app is None) != (workers == 0):
        parser.error("--app and --workers go together")
    if args.app is not None and len(args.app) > 1 and args.workers is not None:
        parser.error(
            "--workers sizes one pool: with several --app, each pool runs its queue's concurrency"
        )
    args.store = _store_url(parser, args)
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("--store takes a postgresql:// URL")
    if args.store is not None:
        from queryqueue.driver_postgres.schema import check_schema  # psycopg: PostgreSQL's

        try:
            check_schema(args.schema)
        except ValueError as exc:
            parser.error(f"--schema: {exc}")
    try:
        loop_factory(args.loop)
    except LoopUnavailableError as exc:
        parser.error(str(exc))
    return http, workers


def _store_url(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The PostgreSQL URL: from --store-url-file, $QUERYQUEUE_STORE or --store. One given on
    the command line must not hold a password: every local user can read it there."""
    from urllib.parse import urlsplit

    if args.store_url_file is not None:
        try:
            return str(args.store_url_file.read_text().strip())
        except OSError as exc:
            parser.error(f"--store-url-file: {exc}")
    url: str | None = args.store
    from_argv = url is not None and url != os.environ.get(cli_options.STORE_ENV)
    if from_argv and url is not None and urlsplit(url).password:
        parser.error(
            "--store: the URL holds a password, which the process list shows to every local"
            " user: put it in PGPASSWORD, ~/.pgpass or a service file, or give the URL in"
            f" --store-url-file or ${cli_options.STORE_ENV}"
        )
    return url


def _pool_size(
    app_ref: str, workers: int | None, worker_concurrency: int | None, *, shared: bool = False
) -> int:
    """The pool's workers: enough for its queue's budget unless told (0: refused, said
    why). The app is loaded here, so that a typo is one line and not a worker's
    traceback; a budget the workers cannot run is refused, with the arithmetic, unless
    the queue is `shared` by several hosts, each running the part its workers can."""
    from queryqueue.app import AppNotFoundError, load_app

    try:
        app = load_app(app_ref)
    except AppNotFoundError as exc:
        print(f"queryqueue: {exc}", file=sys.stderr)
        return 0
    if worker_concurrency is not None and worker_concurrency < 1:
        print(
            f"queryqueue: --worker-concurrency must be 1 or more, not {worker_concurrency}",
            file=sys.stderr,
        )
        return 0
    each = worker_concurrency or app.worker_concurrency
    budget = int(app.queue_options.get("concurrency", DEFAULT_CONCURRENCY))
    needed = -(-budget // each)
    if workers is None:
        return needed
    if workers * each < budget and not shared:
        print(
            f"queryqueue: queue {app.prefix!r} may run {budget} queries at once"
            f" (concurrency={budget}), but --workers {workers} runs {workers} x {each} ="
            f" {workers * each}: start it with --workers {needed} (or leave --workers out),"
            " raise --worker-concurrency, or lower the app's concurrency",
            file=sys.stderr,
        )
        return 0
    return workers


def _worker_rows(worker: dict[str, Any]) -> list[list[Any]]:
    """A worker's rows in `status`: the first with the worker, one for each query it runs."""
    queries = worker.get("queries") or [worker["running"] or {}]
    rss = "-" if worker["rss"] is None else f"{worker['rss'] / 1e6:.0f} MB"
    shown = [worker["pid"], worker["state"], rss, worker["executed"]]
    rows = []
    for query in queries:
        running_s = query.get("running_s")
        rows.append(
            [*shown, query.get("path", "-"), _age(None if running_s is None else _ms(running_s))]
        )
        shown = ["", "", "", ""]
    return rows


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
        workers = [row for w in pool["workers"] for row in _worker_rows(w)]
        print(table(["worker", "state", "rss", "ran", "running", "for"], workers))
    budget = (pool or {}).get("budget", {})  # the queue its pool runs: the supervisor's
    prefixes = [*stats["prefixes"], *({"prefix": p} for p in budget if p not in _names(stats))]
    rows = [
        [
            p["prefix"],
            p.get("pending", 0),
            p.get("active", 0),
            budget.get(p["prefix"], "-"),
            _age(p.get("oldest_age_ms")),
        ]
        for p in prefixes
    ]
    print(table(["prefix", "pending", "active", "budget", "oldest"], rows))
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


async def _health(socket_path: Path, within: float) -> int:
    """Exit 0 when the supervisor answers its status within `within` seconds (its loop
    and its store are there) and its pool has all its workers; else 1, saying why."""
    from queryqueue.driver_socket.client import SocketQueueDriver
    from queryqueue.supervisor.health import problems

    driver = SocketQueueDriver(socket_path, reconnect_timeout=within, request_timeout=within)
    try:
        found = problems(await driver.stats())
    except QueueError as exc:
        found = [str(exc)]
    finally:
        await driver.close()
    if found:
        print(f"unhealthy: {'; '.join(found)}", file=sys.stderr)
        return 1
    print("healthy")
    return 0


async def _reload(socket_path: Path) -> int:
    """SIGHUP to the supervisor serving `socket_path` (its pid from its own status)."""
    import signal

    from queryqueue.driver_socket.client import SocketQueueDriver

    driver = SocketQueueDriver(socket_path, reconnect_timeout=1.0)
    try:
        pid = int((await driver.stats())["pid"])
    finally:
        await driver.close()
    os.kill(pid, signal.SIGHUP)
    print(f"asked the supervisor (pid {pid}) to reload its app: its log says how it went")
    return 0


def _names(stats: dict[str, Any]) -> set[str]:
    return {p["prefix"] for p in stats["prefixes"]}


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _age(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
