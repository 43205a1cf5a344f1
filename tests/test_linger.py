"""The linger (supervisor/core/linger.py): which ACKs a PostgreSQL prefix's next batch, or the
loop's next turn on SQLite, waits for, and until when, from the times it is given."""

from __future__ import annotations

import pytest

from queryqueue.supervisor.core.linger import MAX_WAIT_S, Gap, Linger
from queryqueue.supervisor.settings import Settings

POLL_S = Settings().poll_s


def _learned(turnaround: float, batch: float) -> Linger:
    linger = Linger()
    linger.acked(handed_at=10.0, now=10.0 + turnaround)
    linger.ran(batch)
    return linger


def test_it_waits_for_nothing_before_it_has_seen_an_ack_and_a_batch() -> None:
    assert Linger().awaited([(1, 100.0)], set(), 100.0) == (set(), 100.0)
    only_batches = Linger()
    only_batches.ran(0.004)
    assert only_batches.awaited([(1, 100.0)], set(), 100.0)[0] == set()


def test_a_query_just_handed_off_is_waited_for_until_its_ack_is_overdue() -> None:
    linger = _learned(turnaround=0.001, batch=0.004)
    awaited, until = linger.awaited([(1, 100.0), (2, 99.9995)], set(), 100.0)
    assert awaited == {1, 2}
    # The later of the two overdue times: handed at 100.0, twice the usual turnaround.
    assert until == pytest.approx(100.002)


def test_acks_already_queued_are_not_waited_for() -> None:
    linger = _learned(turnaround=0.001, batch=0.004)
    assert linger.awaited([(1, 100.0), (2, 100.0)], {1, 2}, 100.0) == (set(), 100.0)
    assert linger.awaited([(1, 100.0), (2, 100.0)], {2}, 100.0)[0] == {1}


def test_a_query_running_longer_than_twice_the_usual_is_not_waited_for() -> None:
    linger = _learned(turnaround=0.001, batch=0.004)
    assert linger.awaited([(1, 99.9975)], set(), 100.0)[0] == set()


def test_acks_not_due_within_half_a_batch_are_not_waited_for() -> None:
    # Queries that take longer than half a batch: a batch would wait longer than it saves.
    slow = _learned(turnaround=0.050, batch=0.004)
    assert slow.awaited([(1, 100.0)], set(), 100.0)[0] == set()
    # Due within half a batch, overdue after it: the wait ends at half a batch.
    close = _learned(turnaround=0.0015, batch=0.004)
    awaited, until = close.awaited([(1, 100.0)], set(), 100.0)
    assert awaited == {1}
    assert until == pytest.approx(100.002)


def test_queries_much_longer_than_a_batch_are_never_waited_for() -> None:
    # Many long queries handed off together (a worker running 32 I/O-bound queries at
    # once) all come back within the next batch: a short-query rule would wait for all of
    # them, and the first to end would start its next only with the last.
    batch = 0.004
    long_query = Linger(share=1.0)
    long_query.acked(handed_at=10.0, now=10.1)
    long_query.ran(batch)
    running = [(i, 99.9) for i in range(32)]
    assert long_query.awaited(running, set(), 100.0) == (set(), 100.0)
    # Within four batches it is a short query, waited for as before.
    short = Linger(share=1.0)
    short.acked(handed_at=10.0, now=10.0 + 3.5 * batch)
    short.ran(batch)
    assert short.awaited([(1, 100.0 - 3.5 * batch + 0.001)], set(), 100.0)[0] == {1}


def test_on_the_loop_it_waits_up_to_a_whole_batch() -> None:
    # Due past half a batch (a lane would not wait), within a whole one (the loop's share).
    loop = Linger(share=1.0)
    loop.acked(handed_at=10.0, now=10.003)
    loop.ran(0.004)
    awaited, until = loop.awaited([(1, 100.0)], set(), 100.0)
    assert awaited == {1}
    assert until == pytest.approx(100.004)  # overdue at 100.006: the wait ends at a batch
    assert _learned(turnaround=0.003, batch=0.004).awaited([(1, 100.0)], set(), 100.0)[0] == set()


def test_its_averages_follow_what_it_sees() -> None:
    linger = _learned(turnaround=0.001, batch=0.004)
    for _ in range(40):
        linger.acked(handed_at=0.0, now=0.1)
        linger.ran(0.002)
    assert linger.turnaround == pytest.approx(0.1, rel=1e-3)
    assert linger.batch == pytest.approx(0.002, rel=1e-3)
    # A clock read before the hand-off's (another clock's rounding) counts as no wait.
    linger.acked(handed_at=5.0, now=4.0)
    assert linger.turnaround is not None and linger.turnaround < 0.1


def test_it_never_waits_longer_than_its_cap_whatever_the_averages() -> None:
    # After an outage: batches took 30 s, the queries take 10 s.
    linger = _learned(turnaround=10.0, batch=30.0)
    awaited, until = linger.awaited([(1, 99.99)], set(), 100.0)
    assert awaited == set()  # due in 10 s: not within the cap
    linger = _learned(turnaround=0.04, batch=30.0)
    awaited, until = linger.awaited([(1, 100.0)], set(), 100.0)
    assert awaited == {1}
    assert until == pytest.approx(100.0 + MAX_WAIT_S)


def test_an_ack_is_polled_for_only_when_queries_come_back_within_the_poll() -> None:
    quick = _learned(turnaround=0.0001, batch=0.004)
    # Handed at 100.0, usually back 0.1 ms later: due until twice that, from now on.
    assert quick.ack_due([(1, 100.0)], 100.00005, POLL_S) == pytest.approx(100.0002)
    # The latest of several; never past the poll's own length from now.
    assert quick.ack_due([(1, 100.0), (2, 100.0001)], 100.0, POLL_S) == pytest.approx(100.0003)
    assert quick.ack_due([(1, 100.0)], 100.0, 0.00015) == pytest.approx(100.00015)
    # Overdue already, nothing running, nothing learned yet: no poll.
    assert quick.ack_due([(1, 100.0)], 100.0003, POLL_S) is None
    assert quick.ack_due([], 100.0, POLL_S) is None
    assert Linger().ack_due([(1, 100.0)], 100.0, POLL_S) is None
    # Queries that usually take longer than the poll are never polled for.
    slow = _learned(turnaround=0.002, batch=0.004)
    assert slow.ack_due([(1, 100.0)], 100.0, POLL_S) is None


def test_a_next_message_is_polled_for_while_it_usually_comes_within_the_poll() -> None:
    gap = Gap()
    assert gap.poll_until(100.0, 0.001) is None  # nothing learned yet
    gap.heard(0.0002, 0.001)
    # Twice the usual wait from the moment waited from; never past the poll's length.
    assert gap.poll_until(100.0, 0.001) == pytest.approx(100.0004)
    assert gap.poll_until(100.0, 0.0003) == pytest.approx(100.0003)
    # A wait usually longer than the poll is never polled for.
    assert gap.poll_until(100.0, 0.0001) is None


def test_a_pause_moves_the_gap_a_step_and_quick_messages_bring_it_back() -> None:
    gap = Gap()
    for _ in range(20):
        gap.heard(0.0002, 0.001)
    # An hour's pause counts as twice the poll: the average moves one step, not an hour's.
    gap.heard(3600.0, 0.001)
    assert gap.average == pytest.approx(0.0002 + 0.2 * (0.002 - 0.0002))
    assert gap.poll_until(100.0, 0.001) is not None
    for _ in range(3):
        gap.heard(3600.0, 0.001)
    assert gap.poll_until(100.0, 0.001) is None  # pauses now: it sleeps
    for _ in range(10):
        gap.heard(0.0002, 0.001)
    assert gap.poll_until(100.0, 0.001) is not None  # quick again: it polls again
    gap.heard(-1.0, 0.001)  # a clock that went back counts as no wait, not a negative one
    assert gap.average is not None and gap.average >= 0
