"""The server's own commands, beside the QUEUE commands its batches run: a TCP client's
`auth`, `hello`, `ping`, `stats`, the shared-memory segments' `shm_*`, a client's
`dispatch` of an item it retrieved, and `watch` for a prefix's freed slots. Each is
answered at once, none in a batch.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from queryqueue.driver_socket.protocol import error_payload
from queryqueue.engine.connection import decode_def
from queryqueue.engine.errors import AuthenticationError, InvalidCommandError, QueueError
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.validation import check_key, check_prefix, check_process_id
from queryqueue.supervisor.connection import Connection

if TYPE_CHECKING:
    from queryqueue.supervisor.server import QueueServer


class OwnCommands:
    def __init__(self, server: QueueServer) -> None:
        self.server = server
        self._commands: dict[str, Callable[[Connection, Any, list[Any], dict[str, Any]], None]]
        self._commands = {
            "hello": self._hello,
            "ping": self._ping,
            "stats": self._stats,
            "shm_alloc": self._shm_alloc,
            "shm_release": self._shm_release,
            "shm_view": self._shm_view,
            "dispatch": self._dispatch_soon,
            "watch": self._watch,
        }

    def authenticate(
        self, connection: Connection, message: dict[str, Any], request_id: Any
    ) -> None:
        """A TCP connection's first frame must be `{"cmd": "auth", "args": [token]}`;
        anything else is answered with an error and the connection closed."""
        args = message.get("args")
        token = (
            args[0] if message.get("cmd") == "auth" and isinstance(args, list) and args else None
        )
        if (
            isinstance(token, str)
            and self.server.tcp_token is not None
            and hmac.compare_digest(token.encode(), self.server.tcp_token.encode())
        ):
            connection.authenticated = True
            connection.send({"id": request_id, "ok": True}, after_sync=False)
            return
        error = AuthenticationError(
            "authenticate first: send {'cmd': 'auth', 'args': [token]} with the token "
            "from the supervisor's --auth-token-file"
            if message.get("cmd") != "auth"
            else "auth: wrong token"
        )
        connection.send({"id": request_id, "error": error_payload(error)})
        connection.hang_up = True

    def serve(
        self,
        connection: Connection,
        request_id: Any,
        method: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> None:
        """The server's own commands, not the queue's: answered at once, none in a batch."""
        command = self._commands.get(method)
        if command is None:
            raise InvalidCommandError(f"unknown command {method!r}")
        command(connection, request_id, args, kwargs)

    def _hello(
        self, connection: Connection, request_id: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> None:
        if kwargs.get("process_id") is not None:
            try:  # the store's own rule for process ids
                connection.process_id = check_process_id(kwargs["process_id"])
            except InvalidCommandError:
                raise InvalidCommandError(
                    "hello: process_id must be a string of 1 to 96 characters"
                ) from None
        # The prefixes whose queries this supervisor's pools run: a client hands those
        # off instead of running them itself.
        served = [pool.prefix for pool in self.server.pools if pool.prefix]
        # Nothing committed is in it: it need not wait for a sync (synced.py).
        # How many long polls it parks for one connection: a client holds the rest.
        hello = {"pid": os.getpid(), "pool": served, "max_long_polls": connection.limits.max_parked}
        connection.send({"id": request_id, "ok": hello}, after_sync=False)

    def _ping(self, connection: Connection, request_id: Any, *_: Any) -> None:
        connection.send({"id": request_id, "ok": "pong"}, after_sync=False)

    def _stats(self, connection: Connection, request_id: Any, *_: Any) -> None:
        self.server.soon(self._describe_to(connection, request_id))

    def _shm_alloc(self, connection: Connection, request_id: Any, args: list[Any], _: Any) -> None:
        slot = self.server.segments.alloc(args[0] if len(args) == 1 else None, connection)
        connection.send({"id": request_id, "ok": slot}, after_sync=False)

    def _shm_release(
        self, connection: Connection, request_id: Any, args: list[Any], _: Any
    ) -> None:
        if len(args) not in (2, 3):
            raise InvalidCommandError(
                "shm_release: takes a segment name, its generation and, for a "
                "view, whether it is closed"
            )
        closed = args[2] if len(args) == 3 else None
        self.server.segments.release(args[0], args[1], connection, closed)
        connection.send({"id": request_id, "ok": True})

    def _shm_view(self, connection: Connection, request_id: Any, args: list[Any], _: Any) -> None:
        if len(args) != 2:
            raise InvalidCommandError("shm_view: takes a segment name and generation")
        self.server.segments.mark_viewed(args[0], args[1], connection)
        connection.send({"id": request_id, "ok": True})

    def _dispatch_soon(
        self, connection: Connection, request_id: Any, args: list[Any], _: Any
    ) -> None:
        self.server.soon(self._dispatch_to(connection, request_id, args))

    def _watch(self, connection: Connection, request_id: Any, args: list[Any], _: Any) -> None:
        if len(args) != 1:
            raise InvalidCommandError("watch: takes a prefix")
        connection.watching.add(check_prefix(args[0]))
        connection.send({"id": request_id, "ok": True})

    async def _describe_to(self, connection: Connection, request_id: Any) -> None:
        try:
            connection.send({"id": request_id, "ok": await self.server.describe()})
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})

    async def _dispatch_to(self, connection: Connection, request_id: Any, args: list[Any]) -> None:
        received = time.monotonic()
        try:
            await self._dispatch(args)
            connection.send({"id": request_id, "ok": True})
            self.server.stats.record("dispatch", time.monotonic() - received, True)
        except QueueError as exc:
            connection.send({"id": request_id, "error": error_payload(exc)})
            self.server.stats.record("dispatch", time.monotonic() - received, False)

    async def _dispatch(self, args: list[Any]) -> None:
        """A client's fast track retrieved an item: run it in the pool. Only the item's
        name is taken; what runs is the query as this store holds it, and only if it is
        active and not already handed off."""
        if not self.server.pools:
            raise InvalidCommandError(
                "dispatch: this supervisor has no worker pool (start it with --app and --workers)"
            )
        if (
            len(args) != 2
            or not isinstance(args[0], str)
            or not isinstance(args[1], int)
            or isinstance(args[1], bool)
        ):
            raise InvalidCommandError("dispatch: takes an item's path and its queue id")
        path, queue_id = args
        check_key(path)
        check_key(queue_id)
        prefix, _, query_key_hash = path.rpartition(":")
        active = await self.server.store.run_off_loop(self.server.store.active, prefix)
        if not any(row.queue_id == queue_id for row in active):
            raise InvalidCommandError(f"dispatch: {path} ({queue_id}) is not an active item")
        query = decode_def(await self.server.store.run_off_loop(self.server.store.get, queue_id))
        if query is None:
            raise InvalidCommandError(f"dispatch: {path} ({queue_id}) is not an active item")
        if self.server.hand_off.pool_for(prefix) is None:
            raise InvalidCommandError(f"dispatch: no pool of this supervisor runs {prefix!r}")
        item = RetrievedQuery(query_key_hash, queue_id, queue_id, 0, query)
        try:
            given = self.server.hand_off.give(prefix, item)
        except RuntimeError as exc:
            raise InvalidCommandError(f"dispatch: {exc}") from None
        if not given:
            raise InvalidCommandError("dispatch: the worker pool is stopping")
