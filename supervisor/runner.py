"""How the server runs its batches: chosen once for its store, as `LoopRunner` (a store
on the event loop: SQLite) or `LaneRunner` (a blocking store's lanes: PostgreSQL).

Both take batches from the server's inbox, run each as one `BatchTransaction`, and settle
it here: the pool hears of its ACKs and gets its hand-offs, then the waiters it woke,
then its answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from queryqueue.driver_socket.segments import Reference, parse_reference
from queryqueue.engine.errors import QueueError, ResultTooLargeError
from queryqueue.engine.waiters import Waiter
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.core.handoff import Retrieved
from queryqueue.supervisor.core.linger import Linger
from queryqueue.supervisor.core.requests import Request

if TYPE_CHECKING:
    from queryqueue.supervisor.server import QueueServer

_log = logging.getLogger("queryqueue.server")
MiB = 1024 * 1024

# What a pool's worker says of the query it runs, besides its ACK (`note_acks`).
_POOL_STEPS = frozenset({"heartbeat", "merge_extra"})


class Runner:
    """What both runners share; the server calls these."""

    # How much of a batch the pool prefix's next one may wait for ACKs (linger.py).
    linger_share = 1.0

    def __init__(self, server: QueueServer) -> None:
        self.server = server
        self.transaction = server.transaction
        # The pool prefix's batches: how long they and its workers' ACKs take, and the
        # ACKs its next batch waits for, if it does (linger.py).
        self.linger = Linger(share=self.linger_share)
        self.loop: asyncio.AbstractEventLoop | None = None  # from start to stop
        # The next batch's loop turn, once scheduled.
        self.turn: asyncio.Handle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.schedule()  # what arrived before start (nothing can have, but in case)

    def schedule(self) -> None:
        """Something arrived in the inbox: a turn runs it after this loop iteration's
        reads (every connection that had something to say has said it: one batch). A
        callback, not a task waiting on a queue: no future and no task step per batch."""
        loop = self.loop
        if self.turn is None and loop is not None:
            self.turn = loop.call_soon(self.execute_turn)

    def execute_turn(self) -> None:
        raise NotImplementedError

    def arrived(self, request: Request) -> None:
        """`request` joined the inbox (a worker's ACK may end a wait)."""

    def heard(self, connection: Connection) -> None:
        """A frame arrived from `connection`."""

    def answered(self) -> None:
        """Callers were just answered."""

    def polls_itself(self, request: Request) -> bool:
        """A long poll arrived: True if the runner waits for it itself (else its first
        look runs in a batch, and it parks as the batch is answered: `park`)."""
        return False

    def park(self, request: Request, waiter: Waiter) -> None:
        """A long poll whose first look in a batch found nothing: its wait."""
        self.server.answers.park_in_memory(request, waiter)

    def stop(self) -> None:
        """Stopping: no more turns, and nothing waits for ACKs any more."""
        self.loop = None
        if self.turn is not None:  # a lingering turn too: it runs now
            self.turn.cancel()
            self.turn = None

    def waiting_for_acks(self) -> bool:
        """Whether a batch waits for the ACKs its workers are about to send."""
        raise NotImplementedError

    def idle(self, prefix: str | None) -> bool:
        """Whether no batch of `prefix` waits, runs or is due."""
        raise NotImplementedError

    async def finish(self) -> None:
        """Stopping: what runs off the loop has ended."""

    def batch_limit(self) -> int | None:
        """The most commands a batch takes from the inbox (None: the inbox's own)."""
        return None

    def take_batch(self) -> list[Request]:
        server = self.server
        batch = self.order(server.inbox.take(self.batch_limit()))
        for connection in {request.connection for request in batch if request.connection.throttled}:
            connection.reader.resume()  # read again if the inbox held it back
        segments, shared = server.segments, server.store.shared
        for request in batch:  # checked here, on the loop: the segments live on it
            if request.checked:
                continue  # carried over from a batch that ended early
            request.checked = True
            if request.method == "ack" and len(request.args) == 2:
                try:
                    segments.check_ack(request.args[1])
                    if shared and (parsed := parse_reference(request.args[1])) is not None:
                        # Other hosts read this store, not our /dev/shm: it keeps the
                        # result itself (shared memory stays a same-host hand-off).
                        request.args[1] = self.stored_shared(request.args[1], parsed)
                except QueueError as exc:
                    request.refused = exc
        return batch

    def stored_shared(self, reference: str, parsed: Reference) -> str:
        """The result in shared memory that `reference` (`parsed`) names, as the shared
        store keeps it; one past the limit is refused (its segment freed), naming it."""
        server, limit = self.server, self.server.limits.max_shared_result
        if parsed.size > limit:
            server.segments.acked(reference, False)
            raise ResultTooLargeError(
                f"the result is {parsed.size / MiB:.1f} MiB; a store several hosts share"
                f" keeps results of up to {limit / MiB:g} MiB (--max-shared-result)"
            )
        return server.segments.take(reference)

    def order(self, batch: list[Request]) -> list[Request]:
        return batch

    def run_rest(self) -> None:
        """Run what has arrived, here and now (at shutdown)."""
        server = self.server
        while server.inbox:
            batch = self.take_batch()
            answers, _ = self.transaction.execute(batch)
            if len(answers) < len(batch):
                server.inbox.carry(batch[len(answers) :])
                batch = batch[: len(answers)]
            self.transaction.hand_off.dispatch_fast_tracked(batch, answers)
            server.answers.answer_batch(batch, answers)

    def settle(
        self,
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        for_pool: Retrieved | None,
        effects: list[Callable[[], object]] | None = None,
    ) -> None:
        """A committed batch: the pool hears of it (its workers' next queries leave
        first: their ACKs are what the next batch waits for), then the waiters it woke
        (`effects`, a lane's batch), then its answers."""
        answers_out = self.server.answers
        # A write pass scheduled before the batch's waiters were woken (on SQLite they
        # are as it commits) would write its ACK answers ahead of the polls they woke.
        passed_early = answers_out.flush_pass is not None
        self.note_acks(batch, answers)
        self.transaction.hand_off.hand_over(batch, answers, for_pool)
        for effect in effects or ():  # here on the loop
            try:
                effect()
            except Exception:
                _log.exception("waking the waiters of a batch failed")
        # A batch that tried the pool's retrieval did its reconcile's work (found nothing
        # is an answer too): a poke would list ACTIVE and PENDING again for nothing.
        answers_out.answer_batch(batch, answers, poke=for_pool is None)
        if passed_early:
            answers_out.flush_after_wake_ups()

    def note_acks(self, batch: list[Request], answers: list[tuple[bool, Any]]) -> None:
        """The pool hears of its workers' ACKs as they are answered (committed, or found
        their item gone): the ACK ends a worker's query, and the worker is sent its next
        in this same turn, with no word from it. A worker's steps of the pool's query (its
        ACK, heartbeats, extra) are answered without waiting for a sync (synced.py)."""
        pools = self.server.pools
        if not pools:
            return
        gated = self.server.gate is not None
        for request, (ok, _) in zip(batch, answers, strict=True):
            if not (ok and request.args):
                continue
            if request.method == "ack":
                request.pool_step = any(pool.acked(request.args[0]) for pool in pools)
                if request.pool_step:
                    request.connection.worker = True
            elif gated and request.method in _POOL_STEPS:
                request.pool_step = self.server.hand_off.holding(request.args[0]) is not None
