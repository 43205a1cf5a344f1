"""The one way a query reaches a worker: `HandOff.give`.

Work for the pool comes from four places: the pool's retrieval that a batch runs in its
transaction (`BatchTransaction`), the fast track (an ADD_AND_RETRIEVE that retrieved the
item it added), a client's `dispatch` of an item it retrieved itself, and the pool's own
reconcile. A batch's hand-offs may leave as its COMMIT starts and again once it is
answered; `give` hands an item over once, whichever comes first, and never to a pool
that is stopping (the item is then given back with what the pool held).
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from queryqueue.engine.lanes import route_of
from queryqueue.engine.responses import AddAndRetrieveResponse, QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.supervisor.core.requests import COMMANDS, Request, fast_tracked_answer


class Pool(Protocol):
    """What the core needs of the worker pool: its queue, what it holds, and a hand-off."""

    queue: Any  # its QueryQueue, once started
    saturated: bool

    @property
    def prefix(self) -> str | None: ...
    @property
    def full(self) -> bool: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def backlog(self) -> int: ...
    def holds(self, queue_id: QueueId) -> bool: ...
    def submit(self, prefix: str, retrieved: RetrievedQuery) -> None: ...
    def acking(self, queue_id: QueueId) -> None: ...
    def poke(self, freed: bool = True) -> None: ...
    def running(self) -> list[tuple[QueueId, float]]: ...


class HandOff:
    """Hands what batches retrieve to the pool, once each."""

    def __init__(self, pool: Pool | None) -> None:
        self.pool = pool

    def give(self, prefix: str, item: RetrievedQuery) -> bool:
        """Hand `item` to the pool unless it holds it already (sent as its batch's
        COMMIT left). False: the pool is stopping, and gives the item back itself.
        RuntimeError: a stream item, which only its owner's process may run."""
        pool = self.pool
        assert pool is not None
        if pool.holds(item.queue_id):
            return True
        try:
            pool.submit(prefix, item)
        except RuntimeError:
            if pool.stopping:
                return False
            raise
        return True

    def give_all(self, retrieved: list[RetrievedQuery] | None) -> None:
        """What the pool's retrieval in a batch found."""
        pool = self.pool
        if not retrieved or pool is None:
            return
        for item in retrieved:
            if not self.give(pool.prefix or "", item):
                pool.poke()  # stopping since: the stalled path reclaims it
                return

    def adds_to_pool(self, request: Request) -> bool:
        """An ADD (or ADD_AND_RETRIEVE) for the prefix of the pool's queue."""
        command = COMMANDS.get(request.method)
        return (
            command is not None
            and command.adds
            and self.pool is not None
            and route_of(tuple(request.args)) == self.pool.prefix
        )

    def may_fast_track(self, request: Request) -> bool:
        """ADD_AND_RETRIEVE asked to `dispatch`, for a prefix this pool runs."""
        return (
            request.dispatch
            and self.pool is not None
            and request.args[0].rpartition(":")[0] == self.pool.prefix
        )

    def fast_tracked(self, request: Request, answer: Any) -> bool:
        """... and it retrieved the item it added."""
        return self.may_fast_track(request) and answer.payload is not None and answer.extra is None

    def hand_over(
        self,
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        for_pool: list[RetrievedQuery] | None,
    ) -> None:
        """What a batch gives the pool: its retrieval, then its fast-tracked items (their
        answers marked dispatched)."""
        self.give_all(for_pool)
        self.dispatch_fast_tracked(batch, answers)

    def dispatch_fast_tracked(self, batch: list[Request], answers: list[tuple[bool, Any]]) -> None:
        """The items the batch's ADD_AND_RETRIEVEs retrieved go to the pool with its other
        hand-offs, before any answer is written (not as each is answered, after the
        batch's earlier answers): the fast track leaves no later than the queued path."""
        for i, (request, (ok, answer)) in enumerate(zip(batch, answers, strict=True)):
            if ok and self.fast_tracked(request, answer):
                answers[i] = (True, self._dispatched(request.args[0], answer, request.started_ms))

    def _dispatched(
        self, path: str, answer: AddAndRetrieveResponse, started_ms: int | None
    ) -> AddAndRetrieveResponse:
        """The fast track: what ADD_AND_RETRIEVE retrieved (committed) goes to the pool
        now, in this loop turn. The query is the store's own answer, not the client's."""
        assert self.pool is not None
        if self.pool.holds(answer.id):  # handed over as its COMMIT left
            return fast_tracked_answer(answer)
        prefix, _, query_key_hash = path.rpartition(":")
        query = orjson.loads(answer.payload) if answer.payload is not None else None
        if not isinstance(query, dict):
            return answer
        item = RetrievedQuery(
            query_key_hash, answer.id, answer.id, answer.pending, query, started_ms
        )
        if not self.give(prefix, item):
            return answer  # stopping: the client's own hand-off fails the same way, and says so
        return fast_tracked_answer(answer)
