"""A batch as one store transaction: the core's decisions of what runs, and what it gives
the pool.

`BatchTransaction.execute` runs a batch's commands in one transaction of the store (each
in a savepoint of its own) and returns their answers and the queries it retrieved for the
pool. Within it: a worker's ACK frees a slot, and the head of PENDING is retrieved for
it in the same transaction; the workers whose ACKs lead the batch are sent their next
before the rest runs (`hand_off_early`), the rest as the COMMIT starts
(`hand_off_as_it_commits`). No asyncio, sockets or wall clock here: the store's clock
stamps what it records, and a store on a lane hands its effects to the loop through
`to_loop`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal

from queryqueue.engine.connection import decode_query
from queryqueue.engine.errors import QueueError, StoreError
from queryqueue.engine.lanes import route_of
from queryqueue.engine.responses import QueueId
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.store import QueueStore
from queryqueue.engine.validation import check_priority
from queryqueue.engine.waiters import Waiter
from queryqueue.supervisor.core.handoff import HandOff, Pool, Retrieved
from queryqueue.supervisor.core.requests import (
    COMMANDS,
    Request,
    acked_ids,
    acking_end,
    follow_key,
    moves_pool,
)

_log = logging.getLogger("queryqueue.server")

# The commands whose answer tells their prefix's pending count once they ran.
REPORT_PENDING = frozenset({"add", "add_and_retrieve", "retrieve"})


class BatchTransaction:
    """Runs batches against `store` for `hand_off`'s pools."""

    def __init__(
        self, store: QueueStore, hand_off: HandOff, to_loop: Callable[[Callable[[], None]], Any]
    ) -> None:
        self.store = store
        self.hand_off = hand_off
        # Chosen once: a blocking store runs batches on its lanes, off the loop.
        self.on_lane = store.blocking
        self.to_loop = to_loop
        self.stopping = False  # set by the shell: nothing more is retrieved for the pools
        # A lane's batch: its pool's room as the loop saw it as it sent the batch there
        # (`room_at_dispatch`), by prefix; the pool is the loop's, never read on a lane.
        self.rooms: dict[str, int] = {}

    def execute(
        self, batch: list[Request], route: str | None = None
    ) -> tuple[list[tuple[bool, Any]], Retrieved | None]:
        """The batch (on the loop, or on a blocking store's lane), and in the same
        transaction, when the batch freed a slot or added work, the pool's retrieval: what
        its reconcile would retrieve next, handed to its workers as soon as the batch
        commits (None: not tried)."""
        try:
            return self.store.batched(
                lambda: self.attempt(batch, route), self.forget_polls, prefix=route
            )
        except StoreError as exc:
            return [(False, exc)] * len(batch), None

    def forget_polls(self, done: tuple[list[tuple[bool, Any]], Any]) -> None:
        """A batch that did not commit: the long polls it subscribed wait for nothing."""
        for _, answer in done[0]:
            if isinstance(answer, Waiter):
                self.store.waiters.unsubscribe(answer)

    def attempt(
        self, batch: list[Request], route: str | None = None
    ) -> tuple[list[tuple[bool, Any]], Retrieved | None]:
        answers: list[tuple[bool, Any]] = []
        self.store.expect((r.method, r.args, r.kwargs) for r in batch if r.refused is None)
        if self.on_lane:  # a store on the loop reads for nothing ahead
            self.expect_retrieval(batch, route)
        try:
            done = self.attempt_into(batch, answers)
        except BaseException:
            # Unwound (a store runs the batch again from the start): its long polls so far
            # wait for nothing.
            self.forget_polls((answers, None))
            raise
        self.hand_off_as_it_commits(batch[: len(done[0])], *done)
        return done

    def hand_off_as_it_commits(
        self,
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        for_pool: Retrieved | None,
    ) -> None:
        """What the batch gives the pool (the fast track's items, its retrieval) goes to
        the workers as its COMMIT leaves, not once it is done (`before_commit`), where
        the store allows it: a query runs while SQLite writes its WAL; with it, the workers whose ACKs the batch carries are sent their next
        (`hand_over_committing`). Answers still wait for the commit, and so does the
        pool's word that those ACKs ended their queries (`Runner.note_acks`); `Runner.settle` then
        hands over only what was not. A batch that does not commit after
        all gave a worker a query of nothing (its ACK finds no item: no store hands out
        an id twice, group_commit.py); one run again hands over what it retrieves then."""
        acks = acked_ids(batch, answers)
        if (
            for_pool
            or (acks and any(pool.backlog for pool in self.hand_off.pools))
            or any(
                ok and self.hand_off.fast_tracked(request, answer)
                for request, (ok, answer) in zip(batch, answers, strict=True)
            )
        ):
            # A copy of the answers: the loop marks them dispatched when it settles.
            hand_over = functools.partial(
                self.hand_over_committing, batch, list(answers), for_pool, acks
            )
            if self.on_lane:  # on a lane: the pool is the loop's
                self.store.before_commit(functools.partial(self.to_loop, hand_over))
            else:
                self.store.before_commit(hand_over)

    def hand_over_committing(
        self,
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        for_pool: Retrieved | None,
        acks: list[QueueId],
    ) -> None:
        """`HandOff.hand_over` as the batch's COMMIT starts, where the workers whose ACKs it
        carries take their next at once (`WorkerPool.acking`, here on the loop): they start
        it while the COMMIT is made, not once their ACK is answered."""
        for pool in self.hand_off.pools:
            for queue_id in acks:
                pool.acking(queue_id)
        self.hand_off.hand_over(batch, answers, for_pool)

    def attempt_into(
        self, batch: list[Request], answers: list[tuple[bool, Any]]
    ) -> tuple[list[tuple[bool, Any]], Retrieved | None]:
        added: set[int] = set()  # the ADDs of this transaction that inserted their item
        pools = self.retrieving_pools()
        split = -1 if self.on_lane or not pools else acking_end(batch)
        early: Retrieved | None = None
        for i, request in enumerate(batch):
            if i == split:
                early = self.hand_off_early(pools, batch[:i], answers, batch[i:])
            if request.follows is not None and id(request.follows) in added:
                answers.append(self.wait_for_new(request))
                continue
            answers.append(self.run(request))
            ok, answer = answers[-1]
            if ok and request.then_wait is not None and answer.added:
                added.add(id(request))
            if i + 1 < len(batch) and self.gives_work(request, ok, answer):
                if batch[i + 1].follows is request:  # its long poll: in this batch
                    answers.append(self.wait_for_new(batch[i + 1]))
                break
        later, tried = self.retrieve_at_the_end(pools, batch, answers, split, early)
        return answers, (early or []) + later if tried else early

    def retrieve_at_the_end(
        self,
        pools: list[Pool],
        batch: list[Request],
        answers: list[tuple[bool, Any]],
        split: int,
        early: Retrieved | None,
    ) -> tuple[Retrieved, bool]:
        """What each pool whose slot the batch freed (or whose work it added) retrieves
        as it ends, and whether any retrieval ran (nothing pending is found nothing: no
        listing, and no reconcile poked for it)."""
        later: Retrieved = []
        tried = False
        for pool in pools:
            if early and pool.full:
                # The early hand-off filled the budget: only a slot the rest frees is left.
                due = self.pool_retrieval_due(pool, batch[split : len(answers)], answers[split:])
            else:
                due = self.pool_retrieval_due(pool, batch[: len(answers)], answers)
            if due is None:
                continue
            # What the early hand-off retrieved and has not given the pool yet.
            taken = 0
            if not self.store.hands_off_early():
                taken = sum(1 for prefix, _ in early or [] if prefix == pool.prefix)
            room = self.pool_room(pool, batch[: len(answers)], answers, taken)
            got = self.retrieve_for_pool(pool, limit=room) if due and room else []
            if got is not None:
                tried = True
                later += got
        return later, tried

    def hand_off_early(
        self,
        pools: list[Pool],
        done: list[Request],
        answers: list[tuple[bool, Any]],
        rest: list[Request],
    ) -> Retrieved | None:
        """The batch's workers' ACKs have run, the rest of it has not: the slots they
        freed are filled now, in this transaction, and the workers sent their next before
        the batch's other commands run (its callers' ADDs, their long polls), not as its
        COMMIT leaves. A worker's turnaround bounds a busy queue's throughput. Only with
        the head of PENDING as the end of the batch would find it: nothing below the
        priority of an ADD of the rest (`min_priority`). What it retrieved joins the
        batch's retrieval (None: nothing tried)."""
        acks = acked_ids(done, answers)
        if not acks:
            return None
        got: Retrieved | None = None
        for pool in pools:
            if not self.pool_retrieval_due(pool, done, answers):
                continue
            floor = self.priority_floor(pool, rest)
            if floor is False:
                continue
            room = self.pool_room(pool, done, answers)
            found = self.retrieve_for_pool(pool, min_priority=floor, limit=room) if room else []
            if found is not None:
                got = (got or []) + found
        if got and self.store.hands_off_early():
            for pool in pools:
                for queue_id in acks:
                    pool.acking(queue_id)
            self.hand_off.give_all(got)
        return got

    def priority_floor(self, pool: Pool, requests: list[Request]) -> int | Literal[False] | None:
        """The highest priority of `pool`'s prefix that `requests` may add (None: they
        add none; False: one of them asks for one no item can have)."""
        floor: int | None = None
        for request in requests:
            if self.hand_off.adds_to_pool(request) and route_of(tuple(request.args)) == pool.prefix:
                try:
                    priority = check_priority(request.kwargs.get("priority", 0))
                except QueueError:
                    return False  # its ADD fails: the batch's end retrieves as before
                floor = priority if floor is None else max(floor, priority)
        return floor

    def expect_retrieval(self, batch: list[Request], route: str | None) -> None:
        """Tell the store of the pool's retrieval the batch will likely end with (a slot
        it may free, work it may add), so it can read for it ahead (`expect_retrieval`):
        the pool of the batch's prefix (a lane's batch is one prefix's)."""
        pools = self.retrieving_pools()
        pool = pools[0] if len(pools) == 1 else self.hand_off.pool_for(route)
        if pool is None or pool.queue is None or pool.stopping:
            return
        full = pool.full
        # Not for the fast track's ADD_AND_RETRIEVE: it retrieves what it adds while the
        # prefix has room, which leaves nothing pending to read (an idle query's batch
        # read the head for nothing); where it does not, the retrieval reads it then.
        if any(
            moves_pool(COMMANDS.get(request.method), full)
            and not self.hand_off.may_fast_track(request)
            for request in batch
        ):
            queue = pool.queue
            if self.store.nothing_pending_seen(queue.prefix) and not any(
                (command := COMMANDS.get(request.method)) is not None and command.adds
                for request in batch
            ):
                # A slot freed (an idle queue's ACK) with nothing pending to fill it: the
                # retrieval reads the counts only. Should another host have added work
                # since, it reads the head then, a round trip of its own.
                return
            self.store.expect_retrieval(queue.prefix, queue.process_uid, queue.concurrency)

    def retrieving_pools(self) -> list[Pool]:
        """The pools a batch may retrieve for: with a queue, none stopping."""
        if self.stopping:
            return []
        return [
            pool for pool in self.hand_off.pools if pool.queue is not None and not pool.stopping
        ]

    def gives_work(self, request: Request, ok: bool, answer: Any) -> bool:
        """An ADD that inserted work for a pool while it has an idle slot ends its batch
        (on a store that runs batches on the loop): the worker starts once it commits,
        not after everything that arrived with it (a dedup storm's thousand joins)."""
        command = COMMANDS.get(request.method)
        if not ok or self.on_lane or command is None or not command.adds or not answer.added:
            return False
        pool = self.hand_off.pool_for(route_of(tuple(request.args)))
        return pool is not None and pool.queue is not None and not pool.full

    def wait_for_new(self, request: Request) -> tuple[bool, Any]:
        """The long poll of an item its ADD inserted in this same transaction: nothing can
        have answered it yet, so it subscribes (before the item is visible to anyone)
        without a look."""
        follow_key(request)
        return True, self.store.waiters.subscribe(request.args[0])

    def pool_retrieval_due(
        self, pool: Pool, batch: list[Request], answers: list[tuple[bool, Any]]
    ) -> bool | None:
        """Whether the batch freed a slot or added work for `pool` (None: neither), and
        if so whether anything may be pending for it to retrieve."""
        full, prefix = pool.full, pool.prefix
        may = False
        # The prefix's pending count as the batch's last command that reports it
        # answered: later ones can only lower it (only an ADD makes an item pending, and
        # an ADD reports it). None pending: nothing to retrieve, no listing to run (the
        # fast track's own batch, an idle queue's).
        pending: int | None = None
        for request, (ok, answer) in zip(batch, answers, strict=True):
            if not ok:
                continue
            command = COMMANDS.get(request.method)
            if command is None or not (command.frees_slot or command.adds):
                continue
            route = route_of(tuple(request.args))
            if route is not None and route != prefix:
                continue  # another queue's
            may = may or moves_pool(command, full)
            if request.method in REPORT_PENDING and route == prefix:
                pending = answer.pending if answer is not None else pending
        return (pending != 0) if may else None

    def pool_room(
        self, pool: Pool, batch: list[Request], answers: list[tuple[bool, Any]], taken: int = 0
    ) -> int:
        """What `pool`'s workers can start once the batch commits: its free lanes and those
        whose ACK the batch carries, less what the batch retrieved for it already (`taken`).
        A host retrieves no more than that, whatever the budget allows: the rest stays
        pending for hosts with idle workers. On a lane, as the loop saw it."""
        if self.on_lane:
            prefix = pool.prefix
            return max(0, self.rooms.get(prefix, 0) - taken) if prefix is not None else 0
        freed = sum(1 for queue_id in acked_ids(batch, answers) if pool.holds(queue_id))
        return max(0, pool.room + freed - taken)

    @staticmethod
    def room_at_dispatch(pool: Pool, batch: list[Request]) -> int:
        """On the loop, as a lane's batch leaves for its lane: the pool's room once the
        batch's ACKs of its workers' queries have run."""
        acks = (r.args[0] for r in batch if r.method == "ack" and r.args and type(r.args[0]) is int)
        return pool.room + sum(1 for queue_id in acks if pool.holds(queue_id))

    def retrieve_for_pool(
        self, pool: Pool, min_priority: int | None = None, limit: int | None = None
    ) -> Retrieved | None:
        """`pool`'s queue's reconcile, in the batch: the head of PENDING retrieved per free
        slot (`retrieve_next`), with its process id, its concurrency and the design's rule
        on persistent keys, at most `limit`. None: it failed (the reconcile does the rest)."""
        queue = pool.queue
        assert queue is not None
        # startQueryTime in the retrieving write (Cube's processQuery records it right
        # after RETRIEVE): the worker need not send it.
        started = self.store.clock.now_ms()
        try:
            got = self.store.retrieve_next(
                queue.prefix,
                concurrency=queue.concurrency,
                process_id=queue.process_uid,
                start_query_time=started,
                min_priority=min_priority,
                limit=limit,
            )
        except QueueError as exc:
            _log.warning("retrieving for the pool in the batch failed: %s", exc)
            return None
        return [
            (
                queue.prefix,
                RetrievedQuery(
                    item.key,
                    item.id,
                    item.id,
                    item.pending,
                    decode_query(item.payload, item.extra),
                    started,
                ),
            )
            for item in got
        ]

    def run(self, request: Request) -> tuple[bool, Any]:
        if request.refused is not None:
            return False, request.refused
        try:
            if request.method == "result_blocking":
                follow_key(request)
                found, waiter = self.store.result_blocking_start(*request.args, **request.kwargs)
                return True, found if waiter is None else waiter
            kwargs = request.kwargs
            if self.hand_off.may_fast_track(request):
                # The fast track's startQueryTime, written as the pool's own retrieval's is.
                request.started_ms = self.store.clock.now_ms()
                kwargs = {**kwargs, "start_query_time": request.started_ms}
            answer = getattr(self.store, request.method)(*request.args, **kwargs)
            if request.then_wait is not None:
                request.added_id = answer.id
            return True, answer
        except QueueError as exc:
            return False, exc
        except Exception as exc:  # a bug must not take the server down with it
            return False, StoreError(f"{request.method} failed: {exc!r}")
