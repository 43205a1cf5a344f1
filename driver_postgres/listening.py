"""How a PostgreSQL store hears of ACKs made on other hosts, and waits for one.

One connection per store listens on its schema's channel. An ACK notifies it while
another host listens (`others_listen`, counted, and told by each new listener's hello);
its own waiters are woken in-process. A long poll waits for its ACK's event and reads the
table again only when a notification may have been missed: the listener down or back (a
new `listen_epoch`), or `safety_recheck_ms` passed. A base of `PostgresQueueStore`, whose
connections and transactions it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import sql

from queryqueue.driver_postgres.transaction import PostgresTransaction
from queryqueue.driver_postgres.watchdog import Watchdog
from queryqueue.engine import validation as v
from queryqueue.engine.aio import wait_within
from queryqueue.engine.errors import StoreError
from queryqueue.engine.responses import QueueKey, ResultResponse, ResultStatus
from queryqueue.engine.result_rules import blocking_lookup
from queryqueue.engine.store import QueueStore
from queryqueue.engine.waiters import AckEvent, Waiter

T = TypeVar("T")
# An ACK from another host: the waiter reads the result itself (NOTIFY carries no payload).
_FETCH = "\x00fetch"
LISTEN_CHECK_S = 5.0
# By this long after a listener starts, the hosts that listened alone (and sent no
# NOTIFY) have heard its hello: its waiters then look once more for what they ACKed.
LISTEN_GRACE_S = 1.0
CLAIMED_WAIT_S = 5.0


def _answered_by_the_ack(key: QueueKey, event: AckEvent) -> ResultResponse | None:
    """The answer a long poll woken by `event` gives without the database: an ACK with
    NULL (no payload), or a result the ACK's own transaction took for a waiter by id
    (a local ACK). None: the result is read, or consumed, in a transaction of its own.
    Decided on the loop, so such a poll costs no hop to a lane and back."""
    if event.result is None or (event.taken and isinstance(key, int)):
        return ResultResponse(
            payload=event.result,
            type=ResultStatus.SUCCESS,
            id=event.id,
            external_id=event.external_id,
        )
    return None


class AckListening(QueueStore):
    schema: str
    channel: str
    origin: str  # signs this store's NOTIFYs
    recheck_ms: int
    safety_recheck_ms: int
    # LISTEN's state: while it is up no ACK is missed; each reconnect is a new epoch.
    listen_epoch: int
    others_listen: bool
    _listen_healthy: bool
    _listening: threading.Event
    _hello: str
    _closed: bool
    _watchdog: Watchdog

    @abstractmethod
    def _connect(
        self, *, autocommit: bool = False, application_name: str | None = None
    ) -> psycopg.Connection[Any]: ...

    @abstractmethod
    def _atomic(self) -> AbstractContextManager[PostgresTransaction]: ...

    @abstractmethod
    def _again_if_disconnected(self, command: Callable[[], T]) -> T: ...

    def _prepare_listening(self, schema: str) -> None:
        # LISTEN's state: while it is up no ACK is missed, so parked long polls read the
        # table again only every `safety_recheck_ms`; each reconnect is a new epoch, after
        # which they read it at once (a NOTIFY may have come while it was down).
        self._listen_healthy = False
        self.listen_epoch = 0
        self.channel = f"queryqueue_ack_{schema}"
        # Whether another host (a store on this schema elsewhere) listens on the channel:
        # counted by the listener, True until it knows (`_listen`).
        self.others_listen = True
        # Signs this store's NOTIFYs: its own waiters were woken by the ACK as it committed,
        # with the result; its NOTIFY, often first on the listener's thread, would wake
        # them with none, to read it back in a transaction of their own.
        self.origin = uuid.uuid4().hex
        self._hello = orjson.dumps({"hello": True, "from": self.origin}).decode()
        self._listening = threading.Event()

    def _start_listening(self, within: float) -> None:
        """The listener's thread, waited for `within` seconds (not longer: re-checks cover
        what it misses until it listens)."""
        self._listener = threading.Thread(
            target=self._listen, name=f"queryqueue-listen-{self.schema}", daemon=True
        )
        self._listener.start()
        self._listening.wait(within)

    def _listen(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                conn = self._connect(autocommit=True, application_name=self._listener_name())
            except StoreError:
                self._listening.set()  # do not hold up the constructor: re-checks cover
                threading.Event().wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            try:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                # The hosts that listened alone notify from now on (`_publish`).
                conn.execute("SELECT pg_notify(%s, %s)", (self.channel, self._hello))
                self._count_listeners(conn)
                self.listen_epoch += 1
                self._listen_healthy = True
                self._listening.set()
                delay = 0.05
                checked = time.monotonic()
                heard_at: float | None = checked + LISTEN_GRACE_S
                while not self._closed:
                    for note in conn.notifies(timeout=0.5):
                        self._publish(note.payload)
                    now = time.monotonic()
                    if heard_at is not None and now >= heard_at:
                        # What another host ACKed unannounced before it heard the hello
                        # is found by one more look of each waiter (a new epoch).
                        self.listen_epoch += 1
                        heard_at = None
                    if now - checked >= LISTEN_CHECK_S:
                        # A silent connection is no proof of a live one (a partition
                        # delivers nothing either): one that stops answering is replaced.
                        with self._watchdog.watching(conn):
                            self._count_listeners(conn)
                        checked = time.monotonic()
            except psycopg.Error:
                pass  # reconnect; what was missed meanwhile, re-checks find
            finally:
                self._listen_healthy = False
                self.others_listen = True  # not known while not listening
                with contextlib.suppress(psycopg.Error):
                    conn.close()

    def _listener_name(self) -> str:
        # As pg_stat_activity keeps it (NAMEDATALEN - 1 bytes; a schema name is ASCII).
        return f"queryqueue-listen:{self.schema}"[:63]

    def _count_listeners(self, conn: psycopg.Connection[Any]) -> None:
        """Whether another listener of this schema's channel is connected: ACKs notify
        while one is. One connecting later says so itself (its hello, `_publish`)."""
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND pid <> pg_backend_pid()",
            (self._listener_name(),),
        ).fetchone()
        self.others_listen = row is not None and int(row[0]) > 0

    def _notifying(self) -> str | None:
        """The channel an ACK's NOTIFY goes to, or None while no other host listens."""
        return self.channel if self.others_listen else None

    def _publish(self, payload: str) -> None:
        try:
            note = orjson.loads(payload)
            if note.get("from") == self.origin:
                return
            if "hello" in note:  # another host has started listening
                self.others_listen = True
                # This host's waiters watched nothing while it listened alone: they look
                # again, and watch (watches.py).
                self.listen_epoch += 1
                return
            event = AckEvent(
                int(note["id"]), str(note["path"]), None if note["null"] else _FETCH, note["ext"]
            )
        except (ValueError, KeyError, TypeError):
            return
        self.waiters.publish(event)

    # -- RESULT_BLOCKING across hosts -------------------------------------------------------

    async def result_blocking(self, key: QueueKey, timeout_ms: int) -> ResultResponse | None:
        """As in every store, but the ACK may come from any host: woken by its NOTIFY; the
        table is read again only when a notification may have been missed."""
        v.check_key(key)
        v.check_non_negative_ms("timeout", timeout_ms)
        return await self._blocking_until(key, self._deadline(timeout_ms), None)

    async def result_blocking_wait(
        self, key: QueueKey, timeout_ms: int, waiter: Waiter
    ) -> ResultResponse | None:
        return await self._blocking_until(key, self._deadline(timeout_ms), waiter)

    @staticmethod
    def _deadline(timeout_ms: int) -> float:
        return asyncio.get_running_loop().time() + timeout_ms / 1000

    async def _blocking_until(
        self, key: QueueKey, deadline: float, waiter: Waiter | None
    ) -> ResultResponse | None:
        """Until `deadline` (loop time): subscribe, look, wait for the ACK; looked again
        whenever a notification may have been missed. `waiter`: subscribed, and its first
        look done already (in a server's batch)."""
        loop = asyncio.get_running_loop()
        while True:
            if waiter is None:
                waiter = self.waiters.subscribe(key)
                try:
                    found: ResultResponse | None = await self.run_off_loop(
                        self._again_if_disconnected, functools.partial(self._lookup, key)
                    )
                except BaseException:
                    self.waiters.unsubscribe(waiter)
                    raise
                if found is not None:
                    self.waiters.unsubscribe(waiter)
                    return found
            try:
                event = await self._await_ack(waiter, deadline)
                if event is None and waiter.claimed:
                    event = await self._claimed_event(waiter)
            finally:
                self.waiters.unsubscribe(waiter)
            if event is not None:
                answered = _answered_by_the_ack(key, event)
                if answered is not None:  # on the loop: nothing to read or write
                    return answered
                taken: ResultResponse | None = await self.run_off_loop(
                    self._again_if_disconnected, functools.partial(self._take, key, event)
                )
                return taken
            if loop.time() >= deadline:
                return None
            waiter = None  # a notification may have been missed: subscribe, read again

    @staticmethod
    async def _claimed_event(waiter: Waiter) -> AckEvent | None:
        """An ACK on a lane took the result for this waiter, which timed out before it
        committed: its event comes as the ACK commits (within CLAIMED_WAIT_S, or it did
        not commit: nothing was taken)."""
        try:
            return await wait_within(waiter.future, CLAIMED_WAIT_S)
        except TimeoutError:
            return None

    async def _await_ack(self, waiter: Waiter, deadline: float) -> AckEvent | None:
        """The ACK's event; None at the deadline, or when a re-check is due: the listener
        is down or came back (a new epoch), or `safety_recheck_ms` passed."""
        loop = asyncio.get_running_loop()
        epoch, since = self.listen_epoch, loop.time()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                return await wait_within(waiter.future, min(remaining, self.recheck_ms / 1000))
            except TimeoutError:
                if (
                    not self._listen_healthy
                    or self.listen_epoch != epoch
                    or loop.time() - since >= self.safety_recheck_ms / 1000
                ):
                    return None

    def _lookup(self, key: QueueKey) -> ResultResponse | None:
        with self._atomic() as tx:
            return blocking_lookup(tx, key, self.clock.now_ms())

    def _take(self, key: QueueKey, event: AckEvent) -> ResultResponse | None:
        """The result `event` announced, read or consumed (`_answered_by_the_ack` was not
        enough)."""
        with self._atomic() as tx:
            value: str | None = event.result
            if value == _FETCH:
                value = tx.fetch_acked(event.id, self.clock.now_ms())
                if value is None:
                    return None  # expired meanwhile
            # As in every store: a waiter by path takes the row, a waiter by id leaves it.
            if isinstance(key, int):
                tx.mark_result_consumed(event.id)
            else:
                tx.delete_result(event.id)
        return ResultResponse(
            payload=value, type=ResultStatus.SUCCESS, id=event.id, external_id=event.external_id
        )
