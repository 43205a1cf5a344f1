"""A lane's next batch waits a moment for the ACK a worker is about to send.

On a blocking store (PostgreSQL) a prefix's batches run one after another on its lane, and
a batch costs about the same with one ACK in it as with two: its round trips and its
COMMIT are most of it. A batch that freed a slot hands the slot's next query to a worker
as it commits; the worker's ACK then comes back within a fraction of a batch, while the
lane has already started the next batch with what queued meanwhile. So with two workers
the ACKs alternate: one a batch, and each waits behind a whole batch it is not in.

PostgreSQL's own group commit has the answer (`commit_delay`, tried only when other
transactions are active, `commit_siblings`): wait a little before flushing when another
commit is likely to come. Here: when the next batch is ready and a worker was handed its
query recently enough that its ACK is due within half a batch, the batch waits for that
ACK (or until the ACK is overdue), then runs with it. Half a batch (and never more than
MAX_WAIT_S) bounds what lingering costs the commands already queued; the ACK it waits
for saves a batch it would otherwise wait behind. Workers whose queries take longer than
that are never waited for.

On SQLite the batches run on the event loop, and the same happens there: an ACK that
arrives as a turn starts waits out that turn, then takes a transaction of its own, and its
worker's next query waits for that commit. The loop's turn may wait up to a whole turn
(`share` 1): while it waits the loop reads sockets, and what arrives joins the turn.

The same averages say when not to sleep at all (`ack_due`): on SQLite, when the pool's
queries come back sooner than a sleep and a wake-up cost (on a VM whose idle vCPU halts,
tens of microseconds each way), the loop polls for their ACKs. So for the other two
waits of a query that callers send one after another (`Gap`): the loop for a caller's
next command once it has answered, a worker for its next query once it has sent its ACK.

Decide here, act in the server: this module only reads times it is given.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from queryqueue.engine.responses import QueueId

# Weight of the newest sample in the moving averages: a few batches to follow a change.
_NEW = 0.2
# Never longer than this, whatever the averages say: after a database outage a batch
# took seconds, and half of that average would hold the next batches as long.
MAX_WAIT_S = 0.05
# Only queries that come back within this many batches of their hand-off are waited for.
# A longer query's ACK comes when its query ends, not in step with the batches: waiting
# for it holds back the ACKs that came before it, and workers whose queries end together
# (a worker running many I/O-bound queries at once) start their next ones together again,
# round after round, each round's last ACK setting the pace.
SHORT_TURNAROUND_BATCHES = 4


@dataclass
class Linger:
    """What a prefix's lane learns of its batches and of its workers' turnarounds."""

    # Seconds from a query's hand-off to its ACK's arrival at the server (moving average).
    turnaround: float | None = None
    # Seconds a lane's batch takes, the hop to the lane and back included.
    batch: float | None = None
    # How much of a batch the next one may wait at most: half on a lane, where the
    # queued commands wait behind it; a whole one on the loop (SQLite).
    share: float = 0.5

    def acked(self, handed_at: float, now: float) -> None:
        """A worker's ACK arrived for a query handed to it at `handed_at`."""
        self.turnaround = _moved(self.turnaround, max(0.0, now - handed_at))

    def ran(self, seconds: float) -> None:
        self.batch = _moved(self.batch, seconds)

    def awaited(
        self,
        running: Iterable[tuple[QueueId, float]],
        coming: Collection[QueueId],
        now: float,
    ) -> tuple[set[QueueId], float]:
        """The queries (of `running`: id, handed at) whose ACK the next batch waits for,
        none of `coming` (ACKs already queued), and until when at most."""
        if self.turnaround is None or self.batch is None:
            return set(), now
        if self.turnaround > SHORT_TURNAROUND_BATCHES * self.batch:
            return set(), now
        limit = now + min(self.batch * self.share, MAX_WAIT_S)
        waits: set[QueueId] = set()
        until = now
        for queue_id, handed_at in running:
            if queue_id in coming:
                continue
            due = handed_at + self.turnaround
            overdue = self._overdue(handed_at)
            if due <= limit and overdue > now:
                waits.add(queue_id)
                until = max(until, overdue)
        return waits, min(until, limit)

    def ack_due(
        self, running: Iterable[tuple[QueueId, float]], now: float, at_most: float
    ) -> float | None:
        """Until when an ACK of `running` (id, handed at) may arrive, if the pool's queries
        usually come back within `at_most` of their hand-off: the loop polls its sockets
        until then rather than sleep (None: none is due that soon)."""
        if self.turnaround is None or self.turnaround > at_most:
            return None
        until = max((self._overdue(handed_at) for _, handed_at in running), default=now)
        until = min(until, now + at_most)
        return until if until > now else None

    def _overdue(self, handed_at: float) -> float:
        """When the ACK of a query handed off at `handed_at` is overdue: twice the usual
        turnaround, so that a query a little slower than the usual is still waited for."""
        assert self.turnaround is not None
        return handed_at + 2 * self.turnaround


@dataclass
class Gap:
    """How long a process usually waits for its next message from a given moment on (a
    moving average): whether it polls for it rather than sleep, and until when. A wait
    past the poll's limit counts as twice that limit, however long it was: the pause
    before a burst moves the average a step, not for the burst's first thirty messages."""

    average: float | None = None

    def heard(self, waited: float, at_most: float) -> None:
        """The next message came `waited` seconds after the moment waited from."""
        self.average = _moved(self.average, min(max(0.0, waited), 2 * at_most))

    def poll_until(self, since: float, at_most: float) -> float | None:
        """Until when to poll for the next message, waited for since `since`: twice the
        usual wait, and never past `at_most` after it (None: it usually takes longer)."""
        if self.average is None or self.average > at_most:
            return None
        return since + min(2 * self.average, at_most)


def _moved(average: float | None, sample: float) -> float:
    return sample if average is None else average + _NEW * (sample - average)
