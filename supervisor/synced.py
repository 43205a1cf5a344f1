"""Answers wait for their commit to be durable, when the store syncs in the background.

SQLite with `synchronous="FULL"` in a supervisor syncs the WAL on a thread of its own,
once for many commits (driver_sqlite/syncer.py), so that the loop runs the next batch
instead of waiting for the disk. What a client is told must still survive power loss:
every frame queued for a client while a commit is not yet durable is held, tagged with
that commit, and leaves once a sync covers it; frames leave in the order they were
queued. One sync is asked for at a time (one wake-up of the loop a sync round): what
committed meanwhile is asked for when it answers (that round did not cover it, or did:
then it answers at once).

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
    ) -> None:
        """`failed(error)`: a sync failed, so no answer held or to come can be promised
        (the store commits nothing more): the server hangs up on everyone and stops."""
        self.store = store
        self.loop = loop
        self.failed = failed
        self.holding: set[Holder] = set()
        self._asked: int | None = None  # the commit a `when_synced` is out for
        self._wanted = 0  # the latest commit a held frame waits for
        self.held = 0  # frames held so far (for tests and status)

    def commit_to_wait_for(self) -> int | None:
        return self.store.unsynced_commit()

    def hold(self, holder: Holder, commit: int) -> None:
        """`holder` holds a frame for `commit` (it appended it to its `unsynced`)."""
        self.held += 1
        self.holding.add(holder)
        self._wanted = max(self._wanted, commit)
        if self._asked is None:
            self._ask(commit)

    def _ask(self, commit: int) -> None:
        self._asked = commit
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
            self.holding.clear()
            self.failed(error)
            return
        for holder in holders:
            holder.release_synced(commit)
            if not holder.unsynced:
                self.holding.discard(holder)
        if self.holding and self._wanted > commit:
            self._ask(self._wanted)

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
