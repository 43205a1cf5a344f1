"""What has arrived and waits for a batch: in order, with what a batch carried over first.

An ADD for the pool's queue while the pool holds its whole budget cannot be retrieved
before a slot frees, and its caller waits for the result, not for this answer: it is held
(at most `hold_adds_s`, armed by the shell) to run in the batch of the ACK that frees the
slot. Each SQLite transaction writes the same pages however many ADDs it holds, so this
takes the ADD-only transactions away under load. The long poll sent with an ADD waits
with it.
"""

from __future__ import annotations

from collections import deque

from queryqueue.supervisor.core.requests import Request


class Inbox:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.queued: deque[Request] = deque()
        # Taken for a batch that ended early (`BatchTransaction.gives_work`): first next.
        self.carried: deque[Request] = deque()
        self.held: list[Request] = []  # ADDs waiting for the next batch

    def __bool__(self) -> bool:
        """Whether a batch has anything to run (held ADDs wait for their release)."""
        return bool(self.carried or self.queued)

    def append(self, request: Request) -> None:
        self.queued.append(request)

    def take(self) -> list[Request]:
        """The next batch: what was carried over, then what arrived, at most `max_batch`."""
        batch: list[Request] = []
        carried, queued, most = self.carried, self.queued, self.max_batch
        while len(batch) < most and carried:
            batch.append(carried.popleft())
        while len(batch) < most and queued:
            batch.append(queued.popleft())
        return batch

    def carry(self, rest: list[Request]) -> None:
        """What a batch that ended early did not run: ahead of anything since."""
        self.carried.extendleft(reversed(rest))

    def follows_held(self, request: Request) -> bool:
        """The long poll sent with the last held ADD: it waits with it."""
        return bool(self.held) and request.follows is self.held[-1]

    def hold(self, request: Request) -> bool:
        """Hold `request` for the next batch; True: it is the first (arm the release)."""
        self.held.append(request)
        return len(self.held) == 1

    def release_held(self) -> bool:
        """What was held joins the queue, in its order; True: there was some."""
        if not self.held:
            return False
        self.queued.extend(self.held)
        self.held.clear()
        return True
