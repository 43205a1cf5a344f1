"""The one way a query reaches a worker: `HandOff.give`, to the pool of its queue.

Work for the pool comes from four places: the pool's retrieval that a batch runs in its
transaction (`BatchTransaction`), the fast track (an ADD_AND_RETRIEVE that retrieved the
item it added), a client's `dispatch` of an item it retrieved itself, and the pool's own
reconcile. A batch's hand-offs may leave as its COMMIT starts and again once it is
answered; `give` hands an item over once, whichever comes first, and never to a pool
that is stopping (the item is then given back with what the pool held).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    def room(self) -> int: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def backlog(self) -> int: ...
    def holds(self, queue_id: QueueId) -> bool: ...
    def job(self, key: Any) -> Any: ...
    def submit(self, prefix: str, retrieved: RetrievedQuery) -> None: ...
    def acking(self, queue_id: QueueId) -> None: ...
    def poke(self, freed: bool = True) -> None: ...
    def running(self) -> list[tuple[QueueId, float]]: ...


# What a batch's retrievals found: each item with the prefix of the pool it is for.
Retrieved = list[tuple[str, RetrievedQuery]]


class HandOff:
    """Hands what batches retrieve to the pools (one per queue a supervisor serves), once
    each."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        self.pools = list(pools)
        self._by_prefix: dict[str, Pool] = {}

    def pool_for(self, prefix: str | None) -> Pool | None:
        """The pool that runs `prefix`'s queue (known once it has started)."""
        if prefix is None:
            return None
        pool = self._by_prefix.get(prefix)
        if pool is None:
            for candidate in self.pools:
                if candidate.prefix is not None:
                    self._by_prefix[candidate.prefix] = candidate
            pool = self._by_prefix.get(prefix)
        return pool

    def holding(self, queue_id: Any) -> Pool | None:
        """The pool that holds the item (a job waiting or running), or whose ACK ended it."""
        for pool in self.pools:
            if pool.job(queue_id) is not None:
                return pool
        return None

    def give(self, prefix: str, item: RetrievedQuery) -> bool:
        """Hand `item` to its pool unless it holds it already (sent as its batch's COMMIT
        left). False: the pool is stopping (or gone), and gives the item back itself.
        RuntimeError: a stream item, which only its owner's process may run."""
        pool = self.pool_for(prefix)
        if pool is None:
            return False
        if pool.holds(item.queue_id):
            return True
        try:
            pool.submit(prefix, item)
        except RuntimeError:
            if pool.stopping:
                return False
            raise
        return True

    def give_all(self, retrieved: Retrieved | None) -> None:
        """What the pools' retrievals in a batch found."""
        for prefix, item in retrieved or ():
            if not self.give(prefix, item):
                pool = self.pool_for(prefix)
                if pool is not None:
                    pool.poke()  # stopping since: the stalled path reclaims it

    def adds_to_pool(self, request: Request) -> bool:
        """An ADD (or ADD_AND_RETRIEVE) for the prefix of a pool's queue."""
        command = COMMANDS.get(request.method)
        return (
            command is not None
            and command.adds
            and self.pool_for(route_of(tuple(request.args))) is not None
        )

    def may_fast_track(self, request: Request) -> bool:
        """ADD_AND_RETRIEVE asked to `dispatch`, for a prefix a pool runs."""
        return request.dispatch and self.pool_for(request.args[0].rpartition(":")[0]) is not None

    def fast_tracked(self, request: Request, answer: Any) -> bool:
        """... and it retrieved the item it added."""
        return self.may_fast_track(request) and answer.payload is not None and answer.extra is None

    def hand_over(
        self,
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        for_pool: Retrieved | None,
    ) -> None:
        """What a batch gives the pools: its retrievals, then its fast-tracked items (their
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
        prefix, _, query_key_hash = path.rpartition(":")
        pool = self.pool_for(prefix)
        if pool is not None and pool.holds(answer.id):  # handed over as its COMMIT left
            return fast_tracked_answer(answer)
        query = orjson.loads(answer.payload) if answer.payload is not None else None
        if not isinstance(query, dict):
            return answer
        item = RetrievedQuery(
            query_key_hash, answer.id, answer.id, answer.pending, query, started_ms
        )
        if not self.give(prefix, item):
            return answer  # stopping: the client's own hand-off fails the same way, and says so
        return fast_tracked_answer(answer)
