"""Group commit: the commands a supervisor's loop turn gathered, run as one transaction.

A base of `QueueStore`. A store in memory needs none of it (every command is atomic on
its own and nothing is written); SQLite and PostgreSQL share one transaction, and one
COMMIT, among a batch's commands, each atomic on its own within it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from queryqueue.engine.errors import StoreError

T = TypeVar("T")
_log = logging.getLogger(__name__)


def call_before_commit(callbacks: list[Callable[[], object]]) -> None:
    """A batch's `before_commit` callbacks, in order. Decide, then act: what they start
    cannot undo the batch, so one that fails is logged and the COMMIT goes ahead."""
    for callback in callbacks:
        try:
            callback()
        except Exception:
            _log.exception("a callback before a batch's COMMIT failed")


class GroupCommit:
    # True: commits become durable after they return (`unsynced_commit`, `when_synced`).
    background_sync = False

    def batch(self, prefix: str | None = None) -> AbstractContextManager[None]:
        """Group commit: one transaction, each command in it atomic on its own; `prefix`: what
        most are about. Waiters wake once it committed. A store in memory needs none."""
        return nullcontext()

    def batched(
        self, work: Callable[[], T], undo: Callable[[T], object], prefix: str | None = None
    ) -> T:
        """`work()` in one `batch`; not committed: `undo(what work returned)`, StoreError.
        A store that re-runs a lost batch whole (nothing happened) overrides this."""
        done: list[T] = []
        try:
            with self.batch(prefix):
                done.append(work())
        except StoreError:
            for what in done:
                undo(what)
            raise
        return done[0]

    def before_commit(self, callback: Callable[[], object]) -> None:
        """Inside a `batch`, on its thread: `callback()` once its commands have run, as its
        COMMIT leaves, before the COMMIT's answer (so it is not known to have committed):
        work the batch gave a worker starts while SQLite writes its WAL. Not on a store
        shared by hosts (PostgreSQL): a COMMIT lost there leaves the work to them. A batch that does not get that far (it failed, or
        runs again) drops it; a store with no COMMIT (in memory) never calls it. The ids
        such work carries are never given again, whether or not the COMMIT succeeds (a
        PostgreSQL sequence; SQLite's blocks, driver_sqlite/ids.py), so its ACK finds no
        item rather than another's. Not for an answer: those wait for the commit."""

    def hands_off_early(self) -> bool:
        """Inside a `batch`, on its thread, before its commands are all run: True when
        what the batch has done so far may go to the workers now, as `before_commit`'s
        callbacks do at its end (the ids it took are never given again from here on,
        whatever becomes of the batch); the batch is marked handed. False: not here
        (no batch; a store with no COMMIT, or ids it cannot vouch for yet)."""
        return False

    def unsynced_commit(self) -> int | None:
        """The commit an answer given now must wait for before it leaves (a number for
        `when_synced`); None: every commit so far is durable. None but on a store that
        syncs in the background (SQLite FULL in a supervisor: driver_sqlite/syncer.py)."""
        return None

    def when_synced(self, commit: int, callback: Callable[[BaseException | None], object]) -> None:
        """`callback(None)`, from any thread, once commit number `commit` is durable;
        `callback(error)` once it cannot be."""
        callback(None)

    def sync_now(self) -> None:
        """Make every commit so far durable, here and now (graceful shutdown)."""

    def expect(self, commands: Iterable[Sequence[Any]]) -> None:
        """The commands (name, positional arguments and, as a supervisor tells them,
        keywords) a `batch` is about to run, in order: a store whose reads cost a round
        trip each may send some ahead, together. A hint: each command still runs and
        reads as it would without it."""

    def deferring_effects(self) -> AbstractContextManager[list[Callable[[], object]]]:
        """What committing batches on this thread would do next (wake waiters and slot
        watchers), collected into the list given instead of done, for the caller to do
        where it sits: a server runs a blocking store's batch on a lane thread, and
        hands the effects to its loop with the batch's answers (one wake-up of the loop,
        not one per waiter). A store that runs on the loop does them in place: the list
        stays empty."""
        return nullcontext([])

    def expect_retrieval(self, prefix: str, process_id: str | None, limit: int) -> None:
        """A hint as `expect`'s: the `batch` will likely end with `retrieve_next(prefix,
        ...)` for that process, at most `limit` rows."""

    def nothing_pending_seen(self, prefix: str) -> bool:
        """A hint: the last batch of `prefix` this store committed left nothing pending
        in it (another host may have added some since). False: not known."""
        return False
