"""A watch on every PostgreSQL command: a server that stops answering (a partition, a
proxy that stops forwarding) sends no error and no timeout, and TCP keepalives are
answered by whatever middlebox holds the connection. So each command registers a
deadline; past it, the connection's socket is shut under the thread waiting on it,
whose psycopg call then fails at once."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


class Watchdog:
    """Closes the socket of a connection that has waited for an answer longer than
    `timeout`: the call blocked on it then fails (psycopg sees the connection lost) and
    `abandoned` says why. It also knows every open connection, to close them all."""

    def __init__(self, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"network_timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._open: set[psycopg.Connection[Any]] = set()
        self._deadlines: dict[psycopg.Connection[Any], float] = {}
        self._abandoned: set[psycopg.Connection[Any]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._open.add(conn)

    def forget(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._open.discard(conn)
            self._deadlines.pop(conn, None)
            self._abandoned.discard(conn)

    def abandoned(self, conn: psycopg.Connection[Any]) -> bool:
        with self._lock:
            return conn in self._abandoned

    @contextmanager
    def watching(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        with self._lock:
            self._deadlines[conn] = time.monotonic() + self.timeout
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="queryqueue-pg-watchdog", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(conn, None)

    def _run(self) -> None:
        while not self._stop.wait(min(0.25, self.timeout / 4)):
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline <= now]
                for conn in late:
                    del self._deadlines[conn]
                    self._abandoned.add(conn)
            for conn in late:
                _cut(conn)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()


def _cut(conn: psycopg.Connection[Any]) -> None:
    """Shut the connection's socket down under the thread waiting on it (closing the
    connection from here would race that thread's use of it)."""
    with (
        contextlib.suppress(OSError, psycopg.Error),
        socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock,
    ):
        sock.shutdown(socket.SHUT_RDWR)
