"""A store on the event loop (SQLite): each loop turn runs what has arrived as one batch.

While the
pool holds its budget, a turn may wait for the ACKs its workers are about to send, to run
with them in one transaction (linger.py); with the loop idle, it polls its sockets for an
ACK or a caller's next command due within `poll_s` rather than sleep.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from queryqueue.engine.responses import QueueId
from queryqueue.supervisor import loops
from queryqueue.supervisor.connection import Connection
from queryqueue.supervisor.core.linger import Gap
from queryqueue.supervisor.core.requests import Request, acks_first, coming, ends_or_waits
from queryqueue.supervisor.runner import Runner

if TYPE_CHECKING:
    from queryqueue.supervisor.server import QueueServer


class LoopRunner(Runner):
    def __init__(self, server: QueueServer) -> None:
        super().__init__(server)
        # The ACKs the next turn waits for (`lingers`).
        self.awaited_acks: set[QueueId] | None = None
        # Polling for an ACK or a caller's next command due soon.
        self.polling = loops.Polling()
        # When callers were last answered (None: a command came since), and how soon their
        # next command usually follows (`answered`).
        self.answered_at: float | None = None
        self.next_command = Gap()

    def batch_limit(self) -> int:
        return self.server.settings.loop_batch

    def order(self, batch: list[Request]) -> list[Request]:
        return acks_first(batch)

    def execute_turn(self) -> None:
        self.turn = None
        if self.server.inbox and not self.lingers():
            self.run_turn()

    def lingers(self) -> bool:
        """Whether this turn waits for the ACKs its workers are about to send (linger.py),
        to run with them in one transaction; it runs when they have arrived (`arrived`) or
        are overdue. Never while a worker is idle: an ADD in the turn may have work for it."""
        pools = self.transaction.retrieving_pools()
        if not pools or not all(pool.full for pool in pools):
            return False
        inbox = self.server.inbox
        now = time.monotonic()
        awaited, until = self.linger.awaited(
            self.server.running(), coming(inbox.carried, inbox.freeing, inbox.queued), now
        )
        if not awaited:
            return False
        self.awaited_acks = awaited
        assert self.loop is not None
        # In whole ms on uvloop: an overdue ACK may hold the turn up to a ms longer.
        self.turn = self.loop.call_later(until - now, self.lingered)
        return True

    def lingered(self) -> None:
        self.turn = None
        self.awaited_acks = None
        if self.server.inbox:
            self.run_turn()

    def run_turn(self) -> None:
        server = self.server
        try:
            batch = self.take_batch()
            began = time.monotonic()
            answers, for_pool = self.transaction.execute(batch)
            if len(answers) < len(batch):  # ended early (`gives_work`): the rest is next
                server.inbox.carry(batch[len(answers) :])
                batch = batch[: len(answers)]
            self.settle(batch, answers, for_pool)
            self.linger.ran(time.monotonic() - began)
            self.poll_for_acks()
        finally:
            # What is left (carried, or arrived meanwhile) goes in the next turn, after the
            # connections have read what arrived since: the next batch groups it.
            if server.inbox:
                self.schedule()

    def arrived(self, request: Request) -> None:
        """An ACK tells the linger how long its query took from its hand-off; if the turn
        lingers for it (or for the ACK that follows a command its worker waits for,
        `ends_or_waits`), the wait is over for it. The last one awaited: the turn runs in
        this loop iteration, after its other reads (what else arrived joins it)."""
        if not self.server.pools or not ends_or_waits(request):
            return
        if request.method == "ack":
            job = self.server.job(request.args[0])
            if job is not None:
                self.ack_arrived(job.sent_at)
        awaited = self.awaited_acks
        if awaited is None:
            return
        awaited.discard(request.args[0])
        if not awaited and self.turn is not None and self.loop is not None:
            self.turn.cancel()
            self.turn = self.loop.call_soon(self.lingered)

    def ack_arrived(self, sent_at: float | None) -> None:
        """A worker's ACK arrived for a query handed to it at `sent_at`: the linger learns
        how long that took, and the poll for it is over (its turn polls again if another
        is due)."""
        self.polling.stop()
        if sent_at is not None:
            self.linger.acked(sent_at, time.monotonic())

    def poll_for_acks(self) -> None:
        """The turn settled: if a worker's ACK is due within `poll_s` (linger.py), the
        loop keeps polling its sockets until it arrives or is overdue, rather than sleep.
        On a machine whose idle CPU halts (a VM's vCPU), the wake-up that sleeping costs
        is tens of microseconds, a good part of a short query's round trip; queries that
        take longer than that are never polled for, and neither are those of a saturated
        queue (`WorkerPool.saturated`): the loop hardly sleeps then, and its polls' yields
        gave away the CPU it was short of."""
        if not self.server.pools or not self.may_poll():
            return
        poll_s = self.server.settings.poll_s
        until = self.linger.ack_due(self.server.running(), time.monotonic(), poll_s)
        if until is not None:
            self.polling.extend(until)

    def answered(self) -> None:
        """Callers answered: if their next command usually follows within `poll_s` (a
        caller that sends its queries one after another), the loop polls for it rather
        than sleep, for `poll_for_acks`' reasons and with its exceptions."""
        if not self.may_poll():
            return
        now = time.monotonic()
        self.answered_at = now
        until = self.next_command.poll_until(now, self.server.settings.poll_s)
        if until is not None:
            self.polling.extend(until)

    def may_poll(self) -> bool:
        """Whether the loop polls at all: on, running, and its pool's queue not saturated."""
        server = self.server
        return (
            server.settings.poll_s > 0
            and not server.stopping
            and not any(pool.saturated for pool in server.pools)
        )

    def heard(self, connection: Connection) -> None:
        """A caller's command after answers: how long it took teaches the next poll, and
        this one is over (the turn's end polls again if an ACK is due then)."""
        answered_at = self.answered_at
        if answered_at is None or connection.worker:
            return
        self.answered_at = None
        self.polling.stop()
        self.next_command.heard(time.monotonic() - answered_at, self.server.settings.poll_s)

    def waiting_for_acks(self) -> bool:
        return self.awaited_acks is not None

    def idle(self, prefix: str | None) -> bool:
        return self.awaited_acks is None and self.turn is None and not self.server.inbox

    def stop(self) -> None:
        super().stop()
        self.awaited_acks = None
