"""Answers wait for their commit to be durable, when the store syncs in the background.

SQLite with `synchronous="FULL"` in a supervisor syncs the WAL on a thread of its own,
once for many commits (driver_sqlite/syncer.py), so that the loop runs the next batch
instead of waiting for the disk. What a client is told must still survive power loss:
every frame queued for a client while a commit is not yet durable is held, tagged with
that commit, and leaves once a sync covers it; frames leave in the order they were
queued. One sync is asked for at a time (one wake-up of the loop a sync round): what
committed meanwhile is asked for when it answers (that round did not cover it, or did:
then it answers at once).

A sync is asked for at once when nothing else is about to commit; while the pool runs a
query, whose ACK will commit within moments, it waits for that commit, SYNC_DELAY_S at
most (PostgreSQL's `commit_delay`, taken only while `commit_siblings` transactions are
open). Under load every sync then covers several batches' commits, not one or two: an
fsync costs the kernel about as much CPU as a batch costs the loop, and each sync round
wakes the loop and writes to every client once more. An idle caller's query is not
delayed: its ADD's sync waits for its ACK, and the ACK, with the pool idle, asks at once.

Not held: what the store's every commit is durable for (every store but that one), and
the answer to the pool's own worker's ACK: the worker runs on this host, a child of this
process, and dies with it in the power loss a sync guards against; it is told at once so
that it takes its next query (its caller's answer is held as any other).

A sync that fails makes the store refuse every commit (syncer.py); the server then hangs
up on every client and stops (`QueueServer.failed`): the supervisor exits with the error,
to be restarted, as PostgreSQL stops at a failed fsync of its WAL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Protocol

from queryqueue.engine.group_commit import GroupCommit

# How long a sync may wait for a commit that is due. 2 ms bought nothing on the benchmark
# machine (a sync takes ~1.4 ms there: the syncs ran back to back as before), 4-8 ms cut
# them from ~2,800 to 850-420 for 10,000 queries.
SYNC_DELAY_S = 0.005


class Holder(Protocol):
    """A connection's side (server._Connection)."""

    unsynced: deque[tuple[int, bytes]]

    def release_synced(self, commit: int | None) -> None:
        """Queue the frames held for commits up to `commit` (None: all)."""
        ...


class SyncGate:
    def __init__(
        self,
        store: GroupCommit,
        loop: asyncio.AbstractEventLoop,
        failed: Callable[[BaseException], object],
        *,
        expecting: Callable[[], bool] = lambda: False,
        delay: float = SYNC_DELAY_S,
    ) -> None:
        """`failed(error)`: a sync failed, so no answer held or to come can be promised
        (the store commits nothing more): the server hangs up on everyone and stops.
        `expecting()`: another commit is due soon (the pool runs a query, whose ACK will
        commit): a sync waits for it, `delay` seconds at most."""
        self.store = store
        self.loop = loop
        self.failed = failed
        self.expecting = expecting
        self.delay = delay
        self.holding: set[Holder] = set()
        self._asked: int | None = None  # the commit a `when_synced` is out for
        self._wanted = 0  # the latest commit a held frame waits for
        self._since: float | None = None  # loop time of the first frame held, not asked for
        self._timer: asyncio.TimerHandle | None = None  # the delayed ask
        self.held = 0  # frames held so far (for tests and status)

    def commit_to_wait_for(self) -> int | None:
        return self.store.unsynced_commit()

    def hold(self, holder: Holder, commit: int) -> None:
        """`holder` holds a frame for `commit` (it appended it to its `unsynced`)."""
        self.held += 1
        self.holding.add(holder)
        self._wanted = max(self._wanted, commit)
        if self._since is None:
            self._since = self.loop.time()
        if self._asked is None:
            self._ask_or_wait()

    def _ask_or_wait(self) -> None:
        """Frames wait for commits no sync is out for: ask for one now, or, while another
        commit is due soon, once it came (or `delay` after the first of them was held)."""
        if self.delay > 0 and self.expecting():
            if self._timer is None:
                assert self._since is not None
                self._timer = self.loop.call_at(self._since + self.delay, self._due)
            return
        self._ask(self._wanted)

    def _due(self) -> None:
        self._timer = None
        if self._asked is None and self.holding:
            self._ask(self._wanted)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ask(self, commit: int) -> None:
        self._cancel_timer()
        self._asked = commit
        self._since = None
        loop = self.loop

        def synced(error: BaseException | None) -> None:
            # On the syncer's thread (or here, at once, if it is synced already).
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._synced, commit, error)

        self.store.when_synced(commit, synced)

    def _synced(self, commit: int, error: BaseException | None) -> None:
        self._asked = None
        holders = list(self.holding)
        if error is not None:
            self._cancel_timer()
            self.holding.clear()
            self.failed(error)
            return
        for holder in holders:
            holder.release_synced(commit)
            if not holder.unsynced:
                self.holding.discard(holder)
        if self.holding and self._wanted > commit:
            # Held while that sync ran: `hold` noted when the first of them was.
            self._ask_or_wait()

    def release_now(self, holder: Holder) -> None:
        """What `holder` holds, synced here and now (it is hanging up, or the server
        stops): its answers are written before its connection closes."""
        if not holder.unsynced:
            return
        self.store.sync_now()
        if self.store.unsynced_commit() is not None:  # the sync failed
            self.holding.discard(holder)
            self.failed(OSError("the WAL could not be synced"))
            return
        holder.release_synced(None)
        self.holding.discard(holder)

    def forget(self, holder: Holder) -> None:
        self.holding.discard(holder)
