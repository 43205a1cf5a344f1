"""Answers: what a batch answered goes to its clients, and long polls wait for theirs.

The shell's side of a batch: each answer is recorded (stats, metrics), its shared-memory
result leased to the connection that reads it, and queued for the loop iteration's one
write pass; a long poll whose first look found nothing parks until its item's ACK (or its
timeout), and every poll one ACK wakes gets the same answer, encoded once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from queryqueue.driver_socket.protocol import encode_body, error_payload
from queryqueue.driver_socket.segments import parse_reference
from queryqueue.engine.errors import QueueError
from queryqueue.engine.lanes import route_of
from queryqueue.engine.waiters import AckEvent, Waiter
from queryqueue.supervisor import cube_results
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.core.requests import COMMANDS, Request, poll_args
from queryqueue.supervisor.polls import ParkedPoll

if TYPE_CHECKING:
    from queryqueue.supervisor.server import QueueServer


class Answers:
    """Writes a server's answers, parks its long polls."""

    def __init__(self, server: QueueServer) -> None:
        self.server = server
        self.to_flush: list[Connection] = []  # `flush_soon`'s, this loop iteration's
        self.flush_pass: asyncio.Handle | None = None  # that write pass, once scheduled
        # The last ACK event's answer as JSON, for every poll it wakes (`answer`).
        self._encoded_for: tuple[AckEvent, bytes] | None = None
        self._nudge_scheduled = False

    def flush_soon(self, connection: Connection) -> None:
        """Write `connection`'s answers in this loop iteration's pass. One pass, not a
        callback per connection: the long polls an ACK woke (their futures' callbacks,
        queued ahead of the pass by the same turn) are written in it, not an iteration
        later, and before their worker's ACK answer."""
        if not self.to_flush:
            self.flush_pass = self.server.loop().call_soon(self.flush_all)
        self.to_flush.append(connection)

    def flush_after_wake_ups(self) -> None:
        """The long polls a batch woke have their callbacks queued now: a write pass that
        was scheduled before them (an answer queued earlier in this iteration, say) goes
        after them, so that they are written in it, ahead of the
        batch's ACK answers."""
        if self.flush_pass is not None:
            self.flush_pass.cancel()
            self.flush_pass = self.server.loop().call_soon(self.flush_all)

    def flush_all(self) -> None:
        self.flush_pass = None
        connections, self.to_flush = self.to_flush, []
        # Callers first: an answer ends a caller's wait; a worker's ACK answer only lets it
        # wait for a hand-off, which, if there is one, left already (and each write
        # that wakes a process costs the loop tens of microseconds).
        answered = False
        for connection in connections:
            if not connection.worker:
                connection.flush()
                answered = True
        for connection in connections:
            if connection.worker:
                connection.flush()
        if answered:
            self.server.runner.answered()

    @staticmethod
    def park(request: Request, parked: asyncio.Task[None]) -> None:
        request.connection.parked.add(parked)
        parked.add_done_callback(request.connection.parked.discard)

    def answer_batch(
        self, batch: list[Request], answers: list[tuple[bool, Any]], *, poke: bool = True
    ) -> None:
        """`poke`: tell the pool to reconcile after what changed (False: the batch did
        the pool's retrieval itself)."""
        self.server.stats.batches += 1
        self.server.stats.batched_commands += len(batch)
        now = time.monotonic()
        metrics = self.server.metrics
        if metrics is not None:
            metrics.batch(len(batch))
        for request, (ok, answer) in zip(batch, answers, strict=True):
            request.connection.in_flight -= 1
            if request.method == "result_blocking":  # it came through the inbox
                request.connection.polls_queued -= 1
                if ok and isinstance(answer, Waiter):
                    self.park_poll(request, answer)
                    continue
            if request.connection is self.server.own:
                continue  # the server's own note: nobody to answer or to count it for
            self.server.stats.record(request.method, now - request.received, ok)
            if metrics is not None:
                self.measure(metrics, request, ok, answer, now - request.received)
            self.answer(request, ok, answer, poke)

    def measure(self, metrics: Any, request: Request, ok: bool, answer: Any, took: float) -> None:
        if not ok:
            metrics.failed(request.method, took)
            return
        metrics.answered(request.method, request.args, answer, took)
        if request.method == "ack" and len(request.args) == 2 and answer.success:
            # The pool's job for it (ended by this ACK): what ran, and how long it waited.
            job = self.server.job(request.args[0])
            key = request.args[0]
            path = job.path if job is not None else key if isinstance(key, str) else ":"
            metrics.acked(path, request.args[1], job)
        elif request.method == "merge_extra" and '"attempt"' in str(request.args[-1]):
            job = self.server.job(request.args[0])  # the worker's retry of the query it runs
            if job is not None:
                metrics.retried(job.path, job.handler)

    def poke(self, request: Request, *, freed: bool) -> None:
        """The pool whose queue the command changed reconciles soon (every pool, for a
        command by queue id about no item a pool holds)."""
        hand_off = self.server.hand_off
        pool = hand_off.pool_for(route_of(tuple(request.args))) or (
            hand_off.holding(request.args[0]) if request.args else None
        )
        for each in [pool] if pool is not None else self.server.pools:
            each.poke(freed=freed)

    def answer(
        self,
        request: Request,
        ok: bool,
        answer: Any,
        poke: bool = True,
        *,
        woken_by: AckEvent | None = None,
    ) -> None:
        """`woken_by`: the ACK event that answers a parked long poll; every poll it wakes gets the same
        answer, encoded once (a dedup storm's thousand waiters, a large result's copies)."""
        command = COMMANDS.get(request.method)
        if (
            ok
            and command is not None
            and (command.adds or command.frees_slot)
            and self.server.pools
        ):
            if poke:
                self.poke(request, freed=command.frees_slot)
            if request.method == "cancel" and answer is not None and request.args:
                for pool in self.server.pools:
                    pool.removed(request.args[0])  # its worker hears of it now
        if ok and request.method == "ack" and len(request.args) == 2:
            self.server.segments.acked(request.args[1], bool(answer.success))
        elif ok and answer is not None and request.method in ("result", "result_blocking"):
            if request.rows is not None and cube_results.needs_materialising(answer.payload):
                self.server.soon(self.answer_as_json(request, answer))
                return
            leased = self.lease_result(request, answer)
            if leased is not answer:
                woken_by = None  # its segment is gone: this poll's answer is its own
            answer = leased
        connection = request.connection
        if not ok:
            connection.send({"id": request.id, "error": error_payload(answer)})
        elif request.rows is not None:
            connection.send({"id": request.id, "rows": request.rows(answer)})
        elif woken_by is not None and (encoded := self.encoded_answer(woken_by, answer)):
            connection.send_answer(request.id, encoded)
        else:
            connection.send({"id": request.id, "ok": answer}, after_sync=not request.pool_step)

    def encoded_answer(self, event: AckEvent, answer: Any) -> bytes | None:
        cached = self._encoded_for
        if cached is not None and cached[0] is event:
            return cached[1]
        try:
            encoded = encode_body(answer)
        except TypeError:
            return None  # sent the usual way, which answers the error
        if cached is None:  # held for this loop turn's polls, then let go
            self.server.loop().call_soon(self.forget_encoded)
        self._encoded_for = (event, encoded)
        return encoded

    def forget_encoded(self) -> None:
        self._encoded_for = None

    def nudge_soon(self) -> None:
        """A slot may have freed: tell the watching connections, once per loop turn."""
        if not self._nudge_scheduled and self.server.connections:
            self._nudge_scheduled = True
            self.server.loop().call_soon(self.nudge)

    def nudge(self) -> None:
        self._nudge_scheduled = False
        for connection in self.server.connections:
            for prefix in connection.watching:
                connection.send({"id": None, "nudge": prefix})

    async def answer_as_json(self, request: Request, answer: Any) -> None:
        """A SQL-text RESULT of a result a Cube client cannot follow: its JSON text."""
        limit, payload, rows = self.server.limits.max_sql_result, answer.payload, request.rows
        assert rows is not None
        try:
            ref = parse_reference(payload)
            if ref is None:
                text = await asyncio.to_thread(cube_results.inline_as_json, payload, limit)
            else:
                if ref.size > limit:
                    raise cube_results.too_large(ref.size, limit)
                # A read like any other: leased and released, so its segment goes back to
                # the pool as a client's read would send it.
                owner = object()
                if not self.server.segments.lease(payload, owner):
                    request.connection.send({"id": request.id, "rows": rows(None)})
                    return
                try:
                    _, data = self.server.segments.copy_out(payload)
                finally:
                    self.server.segments.release(ref.name, ref.generation, owner)
                text = await asyncio.to_thread(cube_results.as_json, ref.form, data, limit)
        except QueueError as exc:
            request.connection.send({"id": request.id, "error": error_payload(exc)})
            return
        request.connection.send(
            {"id": request.id, "rows": rows(dataclasses.replace(answer, payload=text))}
        )

    def lease_result(self, request: Request, answer: Any) -> Any:
        """A shared-memory result is readable by this connection until it releases it."""
        if parse_reference(answer.payload) is None or request.rows is not None:
            return answer
        if self.server.segments.lease(answer.payload, request.connection):
            if request.connection.closed:  # a long-poll whose reader hung up meanwhile
                self.server.segments.drop_owner(request.connection)
            return answer
        # Its segment went back to the pool (a late re-read): as if there were no result.
        return None

    def park_poll(self, request: Request, waiter: Waiter) -> None:
        """A long poll whose first look found nothing waits for its ACK's event (at
        shutdown: answered at once, with its timeout answer), as the runner has it."""
        self.server.runner.park(request, waiter)

    def park_in_memory(self, request: Request, waiter: Waiter) -> None:
        """... woken by the ACK's event in this process (every ACK commits here)."""
        key, timeout_ms = poll_args(request)
        parked = request.connection.parked

        def finish(ok: bool, answer: Any, event: AckEvent | None) -> None:
            parked.discard(poll)
            self.server.stats.record(request.method, time.monotonic() - request.received, ok)
            self.answer(request, ok, answer, woken_by=event)

        assert self.server.deadlines is not None  # started
        poll = ParkedPoll(self.server.store, key, timeout_ms, waiter, finish, self.server.deadlines)
        parked.add(poll)
        if self.server.stopping or request.connection.closed:
            poll.cancel()

    def park_on_store(self, request: Request, waiter: Waiter | None = None) -> None:
        """... waited for by the store (its ACK may come from another host)."""
        task = asyncio.ensure_future(self.result_blocking(request, waiter))
        self.park(request, task)
        if self.server.stopping or request.connection.closed:
            task.cancel()

    async def result_blocking(self, request: Request, waiter: Waiter | None = None) -> None:
        """A blocking store's long poll; `waiter`: its first look ran in a batch."""
        try:
            if waiter is None:
                answer = await self.server.store.result_blocking(*request.args, **request.kwargs)
            else:
                key, timeout_ms = poll_args(request)
                answer = await self.server.store.result_blocking_wait(key, timeout_ms, waiter)
        except asyncio.CancelledError:
            # Shutdown or hang-up: a parked long-poll gets its timeout answer.
            answer = None
        except QueueError as exc:
            self.server.stats.record(request.method, time.monotonic() - request.received, False)
            self.answer(request, False, exc)
            return
        finally:
            if waiter is not None:  # cancelled before it ever waited
                self.server.store.waiters.unsubscribe(waiter)
        self.server.stats.record(request.method, time.monotonic() - request.received, True)
        self.answer(request, True, answer)
