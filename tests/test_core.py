"""The supervisor's core stepped by hand: requests, the inbox, a batch's transaction, the
one hand-off and the pool's slots, with no socket, no process and no sleep (a long poll's
waiter belongs to a running loop: that test runs on one, and waits for nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from queryqueue import (
    InvalidCommandError,
    MemoryQueueStore,
    QueryQueue,
    UnknownHandlerError,
    UnknownQueueError,
)
from queryqueue.engine.retrieved import RetrievedQuery
from queryqueue.engine.waiters import Waiter
from queryqueue.supervisor.core.handoff import HandOff
from queryqueue.supervisor.core.inbox import Inbox
from queryqueue.supervisor.core.requests import (
    Message,
    Request,
    Shapes,
    follow_up,
    make_request,
    read_message,
)
from queryqueue.supervisor.core.slots import Job, Phase, Slots, Worker
from queryqueue.supervisor.core.transaction import BatchTransaction
from queryqueue.supervisor.pool import WorkerPool


def _request(method: str, *args: Any, **kwargs: Any) -> Request:
    return Request("caller", None, method, list(args), kwargs, None, 0.0)


def _transaction(store: Any) -> BatchTransaction:
    return BatchTransaction(store, HandOff([]), to_loop=lambda callback: callback())


def test_a_batch_answers_each_command_in_order_in_one_transaction() -> None:
    store = MemoryQueueStore()
    batch = [
        _request("add", "p:a", "{}"),
        _request("add", "p:a", "{}"),  # the same key in flight: it joins
        _request("add", "p:b", "{}", priority=5),
        _request("result", "p:a"),
    ]
    answers, for_pool = _transaction(store).execute(batch)
    assert [ok for ok, _ in answers] == [True, True, True, True]
    first, joined, other, result = (answer for _, answer in answers)
    assert first.added and not joined.added and joined.id == first.id
    assert other.added and result is None
    assert for_pool is None  # no pool: nothing retrieved for one
    assert [item.id for item in store.pending("p")] == ["b", "a"]  # by priority


def test_a_refused_or_failing_command_answers_its_error_and_the_others_run() -> None:
    store = MemoryQueueStore()
    refused = _request("add", "p:refused", "{}")
    refused.refused = InvalidCommandError("refused before the store")
    batch = [refused, _request("add", "p:bad", "{}", priority=10**6), _request("add", "p:ok", "{}")]
    answers, _ = _transaction(store).execute(batch)
    assert answers[0] == (False, refused.refused)
    assert not answers[1][0] and "priority" in str(answers[1][1])
    assert answers[2][0] and answers[2][1].added
    assert [item.id for item in store.pending("p")] == ["ok"]


async def test_the_long_poll_sent_with_an_add_waits_on_the_id_the_add_answers() -> None:
    store = MemoryQueueStore()
    add = Request("caller", 1, "add", ["p:k", "{}"], {}, None, 0.0, then_wait=(2, 60_000))
    poll = follow_up(add)
    answers, _ = _transaction(store).execute([add, poll])
    (added_ok, added), (poll_ok, waiter) = answers
    assert added_ok and poll_ok and isinstance(waiter, Waiter)
    assert poll.args == [added.id, 60_000] and poll.id == 2
    store.waiters.unsubscribe(waiter)


def test_a_long_poll_whose_add_failed_says_so() -> None:
    add = Request("caller", 1, "add", ["p:k", "{}"], {"priority": -(10**6)}, None, 0.0)
    add.then_wait = (2, 1_000)
    answers, _ = _transaction(MemoryQueueStore()).execute([add, follow_up(add)])
    assert not answers[0][0]
    assert not answers[1][0] and "the ADD it follows failed" in str(answers[1][1])


def test_a_request_is_checked_and_a_pools_queue_keeps_its_own_budget() -> None:
    shapes = Shapes(MemoryQueueStore())
    budgets = {"p": 2}
    message = read_message(
        {"cmd": "add_and_retrieve", "args": ["p:k", "{}", 8], "kwargs": {"dispatch": True}}
    )
    request = make_request(
        "caller", 7, message, 0.0, shapes=shapes, process_id="proc", budgets=budgets
    )
    assert request.args[2] == 2 and request.dispatch  # the caller's 8 is not the budget
    other = read_message({"cmd": "add_and_retrieve", "args": ["q:k", "{}", 8]})
    unchanged = make_request(
        "caller", 8, other, 0.0, shapes=shapes, process_id=None, budgets=budgets
    )
    assert unchanged.args[2] == 8  # not the pool's queue: the caller's own
    wrong = Message("add", ["p:k"], {"bogus": 1}, None)
    with pytest.raises(InvalidCommandError, match="unexpected keyword argument 'bogus'"):
        make_request("caller", 9, wrong, 0.0, shapes=shapes, process_id=None)
    bad_wait = Message("add", ["p:k", "{}"], {"then_wait": [1]}, None)
    with pytest.raises(InvalidCommandError, match="then_wait"):
        make_request("caller", 10, bad_wait, 0.0, shapes=shapes, process_id=None)
    with pytest.raises(InvalidCommandError, match="'cmd'"):
        read_message({"args": []})


def test_the_inbox_takes_batches_in_arrival_order_with_carried_requests_first() -> None:
    inbox = Inbox(max_batch=3)
    arrived = [_request("add", f"p:{n}", "{}") for n in range(5)]
    assert not inbox
    for request in arrived[:2]:
        inbox.append(request)
    batch = inbox.take()
    assert batch == arrived[:2] and not inbox
    inbox.carry(batch[1:])  # the batch ended early: its rest goes first next time
    for request in arrived[2:]:
        inbox.append(request)
    assert inbox.take() == [arrived[1], *arrived[2:4]]
    assert inbox.take() == [arrived[4]] and not inbox


def _phase(worker: Worker) -> Phase:
    return worker.phase  # read afresh each time (mypy would narrow the property)


def _job(queue_id: int) -> Job:
    return Job(queue_id, f"p:{queue_id}", str(queue_id).encode())


def test_a_worker_whose_ack_commits_is_sent_its_next_and_ends_the_first_when_answered() -> None:
    slots, worker = Slots(), Worker(process=None, conn=None)
    slots.workers.append(worker)
    a, b = _job(1), _job(2)
    assert slots.submit(a) == [(worker, a)] and _phase(worker) is Phase.BUSY
    assert slots.submit(b) == [] and slots.held == 2  # b waits in the backlog
    assert slots.acking(1, task_limit=None) == [(worker, b)]
    assert (worker.job, worker.acking) == (b, a)
    assert slots.holding(1) is None and slots.job(1) is a  # over for the pool, still known
    assert slots.acked(1) == (worker, None) and worker.finished is a and worker.executed == 1
    assert slots.acked("p:2") == (worker, None) and _phase(worker) is Phase.IDLE
    assert slots.held == 0 and slots.acked(3) is None


def test_nothing_is_sent_ahead_to_a_worker_due_to_retire_or_draining() -> None:
    slots, worker = Slots(), Worker(process=None, conn=None)
    slots.workers.append(worker)
    slots.submit(_job(1))
    slots.submit(_job(2))
    assert slots.acking(1, task_limit=1) == []  # its first query is its last
    slots.drain(worker, 1, now=5.0)  # a thread of query 1 runs on past its end
    assert _phase(worker) is Phase.DRAINING and worker.job is None and worker.executed == 1
    assert slots.assign() == [] and slots.held == 1  # query 2 waits for the thread
    assert slots.drained(worker) is None and _phase(worker) is Phase.IDLE
    assert slots.assign() == [(worker, slots.holding(2))]
    worker.retiring = True
    slots.submit(_job(3))
    assert slots.finish(worker) is None and _phase(worker) is Phase.RETIRING
    assert slots.assign() == []


def test_a_cancelled_query_leaves_the_backlog_and_its_worker_is_told() -> None:
    slots, worker = Slots(), Worker(process=None, conn=None)
    slots.workers.append(worker)
    running, waiting = _job(1), _job(2)
    slots.submit(running)
    slots.submit(waiting)
    assert slots.removed(2) == [] and not slots.backlog
    assert slots.removed("p:1") == [(worker, running)]


def test_a_failed_send_puts_the_query_first_again_and_a_stop_takes_everything_back() -> None:
    slots, worker = Slots(), Worker(process=None, conn=None)
    slots.workers.append(worker)
    a, b = _job(1), _job(2)
    ((to, sent),) = slots.submit(a)
    slots.submit(b)
    slots.unsent(to, sent)
    assert list(slots.backlog) == [a, b] and worker.job is None
    assert slots.assign() == [(worker, a)]
    assert slots.clear() == [a, b] and slots.held == 0 and not slots.workers


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, blob: bytes) -> None:
        self.sent.append(blob)


def test_one_hand_off_reaches_a_worker_once_whichever_source_gives_it(workdir: Path) -> None:
    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=1)
    pool.queue = QueryQueue("p", query_handlers={}, driver=store)  # as its start makes it
    pipe = _Pipe()
    pool.slots.workers.append(Worker(process=None, conn=pipe))
    hand_off = HandOff([pool])
    item = RetrievedQuery("k", 1, 1, 0, {"queryHandler": "sql", "query": 1})
    assert hand_off.give("p", item)  # the batch's retrieval, as its COMMIT left
    assert hand_off.give("p", item)  # the same, once the batch was answered
    assert len(pipe.sent) == 1 and pool.holds(1)
    stream = RetrievedQuery("k@proc", 2, 2, 0, {"queryHandler": "sql", "query": 2})
    with pytest.raises(RuntimeError, match="stream query"):
        hand_off.give("p", stream)


def test_a_pool_retrieves_only_what_its_free_lanes_can_start(workdir: Path) -> None:
    # Budget 4, one lane: the three it cannot start stay pending for other hosts' workers
    # rather than wait in its backlog, active in the store.
    store = MemoryQueueStore()
    pool = WorkerPool("tests.apps.pool_app:app", workdir / "s.sock", store, workers=1)
    pool.queue = QueryQueue("p", query_handlers={}, driver=store, concurrency=4)
    pipe = _Pipe()
    pool.slots.workers.append(Worker(process=None, conn=pipe))
    hand_off = HandOff([pool])
    transaction = BatchTransaction(store, hand_off, to_loop=lambda callback: callback())

    def run(batch: list[Request]) -> None:
        answers, for_pool = transaction.execute(batch)
        assert len(answers) == len(batch) and all(ok for ok, _ in answers)
        hand_off.hand_over(batch, answers, for_pool)

    for i in range(4):
        run([_request("add", f"p:k{i}", f'{{"queryHandler": "sql", "query": {i}}}')])
    assert len(store.active("p")) == 1 and len(store.pending("p")) == 3
    assert len(pipe.sent) == 1 and pool.backlog == 0 and pool.room == 0
    # Its ACK frees the lane in the same batch: exactly one more is retrieved.
    ((running, _),) = pool.running()
    run([_request("ack", running, '{"result": 1}')])
    assert len(store.active("p")) == 1 and len(store.pending("p")) == 2
    pool.acked(running)  # as the runner tells it once the ACK is answered
    assert len(pipe.sent) == 2 and pool.backlog == 0


def test_a_query_for_a_queue_or_handler_no_pool_serves_is_refused() -> None:
    shapes, served = Shapes(MemoryQueueStore()), {"p": frozenset({"sql"})}

    def add(path: str, payload: str) -> Request:
        message = Message("add", [path, payload], {}, None)
        return make_request(
            "caller", 1, message, 0.0, shapes=shapes, process_id=None, served=served
        )

    with pytest.raises(UnknownQueueError, match=r"no queue 'q' .* runs 'p'"):
        add("q:k", '{"queryHandler": "sql", "query": 1}')
    with pytest.raises(UnknownHandlerError, match=r"no handler 'nope' \(it has 'sql'\)"):
        add("p:k", '{"queryHandler": "nope", "query": 1}')
    assert add("p:k", '{"queryHandler": "sql", "query": 1}').args[0] == "p:k"
    assert add("q:s", '{"queryHandler": "stream"}').args[0] == "q:s"  # runs in its caller
    assert add("q:raw", "{}").args[0] == "q:raw"  # not a query: the store's, as in Cube
