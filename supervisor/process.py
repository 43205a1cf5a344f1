"""Running the supervisor: the store, the server, the worker pool, signals, a clean exit."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from queryqueue.driver_sqlite.store import SqliteQueueStore, Synchronous
from queryqueue.engine.errors import StoreError
from queryqueue.engine.store import QueueStore
from queryqueue.supervisor import guard, loops
from queryqueue.supervisor.loops import LoopChoice
from queryqueue.supervisor.pool import WorkerPool
from queryqueue.supervisor.server import Limits, QueueServer
from queryqueue.supervisor.settings import DEFAULT_STOP_GRACE, Settings

_log = logging.getLogger("queryqueue.supervisor")


def open_store(
    db: str | Path,
    *,
    synchronous: Synchronous,
    schema: str,
    postgres_options: dict[str, float | None] | None = None,
) -> QueueStore:
    """A SQLite file, or a postgresql:// URL (a queue several hosts share)."""
    if _is_url(db):
        from queryqueue.driver_postgres.hosts import HOST_TIMEOUT_S
        from queryqueue.driver_postgres.store import PostgresQueueStore

        options = postgres_options or {}
        return PostgresQueueStore(
            db,
            schema=schema,
            statement_timeout=options.get("statement_timeout") or 30.0,
            lock_timeout=options.get("lock_timeout") or 10.0,
            network_timeout=options.get("network_timeout"),
            lanes=int(options.get("connections") or 4),
            host_timeout=options.get("host_timeout") or HOST_TIMEOUT_S,
        )
    # The server holds every answer until its commit is synced (synced.py): FULL's
    # fsyncs leave the loop, and serve many commits at once.
    return SqliteQueueStore(db, synchronous=synchronous, sync_in_background=True)


async def serve(
    db: str | Path,
    socket_path: str | Path,
    *,
    synchronous: Synchronous = "NORMAL",
    schema: str = "queryqueue",
    tcp_port: int | None = None,
    auth_token_file: str | Path | None = None,
    http: tuple[str, int] | None = None,
    postgres_options: dict[str, float | None] | None = None,
    limits: Limits | None = None,
    shm_caps: tuple[int, int] | None = None,
    app: str | Sequence[str] | None = None,
    workers: int | Sequence[int] = 0,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    settings: Settings | None = None,
    stop_grace: float = DEFAULT_STOP_GRACE,
    **pool_options: Any,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then shut down gracefully: running
    queries get `stop_grace` seconds to finish, and what does not is pending again.

    `pool_options` go to `WorkerPool` (event_loop, cancel_grace, max_tasks_per_worker,
    max_memory_per_worker, shm_threshold); `settings`, the
    supervisor's timings."""
    socket_path = Path(socket_path)
    guard.private_directory(socket_path.parent)
    token = None
    token_file = Path(auth_token_file) if auth_token_file else guard.token_path(socket_path)
    if tcp_port is not None or http is not None:
        # One secret for every listener that is not the owner-only socket.
        token = guard.load_or_create_token(token_file)
    # One supervisor per database (the socket is locked by the server): a second one
    # would run every query twice and race the first for its budget.
    db_lock = None if _is_url(db) else guard.Lock(guard.lock_path(Path(db)), f"database {db}")
    try:
        await _serve_store(
            open_store(
                db, synchronous=synchronous, schema=schema, postgres_options=postgres_options
            ),
            socket_path,
            tcp_port=tcp_port,
            token=token,
            http=http,
            token_file=token_file,
            limits=limits,
            shm_caps=shm_caps,
            app=app,
            workers=workers,
            ready=ready,
            stop=stop,
            settings=settings or Settings(),
            stop_grace=stop_grace,
            **pool_options,
        )
    finally:
        if db_lock is not None:
            db_lock.release()
        _log.info("stopped")


def _is_url(db: str | Path) -> TypeGuard[str]:
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


async def _serve_store(
    store: QueueStore,
    socket_path: Path,
    *,
    tcp_port: int | None,
    token: str | None,
    http: tuple[str, int] | None,
    token_file: Path,
    limits: Limits | None,
    shm_caps: tuple[int, int] | None,
    app: str | Sequence[str] | None,
    workers: int | Sequence[int],
    ready: asyncio.Event | None,
    stop: asyncio.Event | None,
    settings: Settings,
    stop_grace: float,
    **pool_options: Any,
) -> None:
    server, pools = _server_and_pools(
        store, socket_path, tcp_port=tcp_port, token=token, limits=limits, settings=settings,
        shm_caps=shm_caps, app=app, workers=workers, pool_options=pool_options,
    )  # fmt: skip
    stop = stop or asyncio.Event()
    unhandle = _handle_signals(stop, pools)
    started = False
    site = None
    try:
        await server.start()  # refuses an unsafe socket directory, a second supervisor
        started = True
        for pool in pools:
            await pool.start()
        _log.info("listening on %s", server.socket_path)
        if server.tcp_address is not None:
            _log.info("listening on tcp %s", server.tcp_address)
        if http is not None and token is not None:
            site = await _start_site(server, http, token, token_file)
        if ready is not None:
            ready.set()
        await _until_stopped(stop, server)
    finally:
        unhandle()
        if site is not None:
            await site.stop()
        await asyncio.gather(*(pool.stop(stop_grace) for pool in pools))
        if started:
            await server.stop()
        for pool in pools:
            await pool.give_back()  # what it could not finish is pending again
        store.close()
    if server.failure is not None:
        raise StoreError(f"the queue store failed: {server.failure}")


def _server_and_pools(
    store: QueueStore,
    socket_path: Path,
    *,
    tcp_port: int | None,
    token: str | None,
    limits: Limits | None,
    settings: Settings,
    shm_caps: tuple[int, int] | None,
    app: str | Sequence[str] | None,
    workers: int | Sequence[int],
    pool_options: dict[str, Any],
) -> tuple[QueueServer, list[WorkerPool]]:
    """The server, and a pool for each app (of its `workers`, one figure for all or one
    each)."""
    apps = [app] if isinstance(app, str) else list(app or [])
    sizes = [workers] * len(apps) if isinstance(workers, int) else list(workers)
    if len(sizes) != len(apps):
        raise ValueError(f"{len(apps)} apps but {len(sizes)} pool sizes")
    pools = [
        WorkerPool(
            ref, socket_path, store, workers=size, worker_poll_s=settings.worker_poll_s,
            **pool_options,
        )
        for ref, size in zip(apps, sizes, strict=True)
        if size > 0
    ]  # fmt: skip
    server = QueueServer(
        store,
        socket_path,
        tcp_host="127.0.0.1" if tcp_port is not None else None,
        tcp_port=tcp_port,
        tcp_token=token if tcp_port is not None else None,
        pools=pools,
        limits=limits,
        settings=settings,
    )
    if shm_caps is not None:
        server.segments.max_total_bytes, server.segments.max_connection_bytes = shm_caps
    return server, pools


async def _until_stopped(stop: asyncio.Event, server: QueueServer) -> None:
    """Until `stop` is set (a signal) or the server's store fails for good."""
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.failed.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def _handle_signals(stop: asyncio.Event, pools: list[WorkerPool]) -> Callable[[], None]:
    """SIGTERM and SIGINT stop the supervisor gracefully (the handler only sets `stop`);
    SIGHUP reloads the pools' apps (`WorkerPool.reload`), or is logged where there is no
    pool. Returns what removes the handlers."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task[bool]] = set()

    def hang_up() -> None:
        if not pools:
            _log.warning("SIGHUP: no pool to reload; the supervisor goes on serving")
        for pool in pools:
            task = asyncio.ensure_future(pool.reload())
            reloads.add(task)
            task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, hang_up)

    def unhandle() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)

    return unhandle


async def _start_site(
    server: QueueServer, address: tuple[str, int], token: str, token_file: Path
) -> Any:
    """`--http`: metrics and the status page (the `http` extra)."""
    try:
        from queryqueue.supervisor.metrics import Metrics
        from queryqueue.supervisor.web import StatusSite
    except ImportError as exc:
        raise SystemExit(
            f"queryqueue: --http needs the http extra (pip install 'queryqueue[http]'): {exc}"
        ) from None
    metrics = Metrics()
    server.metrics = metrics
    site = StatusSite(server, metrics, token)
    await site.start(*address)
    assert site.address is not None
    host, port = site.address
    shown = f"[{host}]" if ":" in host else host
    # The token stays in its owner-only file, never in a log.
    print(
        f"queryqueue status page on http://{shown}:{port}/?token=… (the token is in"
        f" {token_file}); metrics on /metrics with Authorization: Bearer <token>",
        flush=True,
    )
    return site


def run(
    db: str | Path, socket_path: str | Path, *, event_loop: LoopChoice = "auto", **options: Any
) -> int:
    """Serve on the chosen event loop; the pool's workers run on the same kind."""
    loops.settle_collector()  # this process is the supervisor: it owns its collector
    try:
        loops.run(serve(db, socket_path, event_loop=event_loop, **options), event_loop)
    except StoreError as exc:
        print(f"queryqueue: {exc}", file=sys.stderr)
        return 1
    return 0
