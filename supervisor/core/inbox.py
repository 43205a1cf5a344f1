"""What has arrived and waits for a batch: in order, with what a batch carried over first."""

from __future__ import annotations

from collections import deque

from queryqueue.supervisor.core.requests import Request


class Inbox:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.queued: deque[Request] = deque()
        # Taken for a batch that ended early (`BatchTransaction.gives_work`): first next.
        self.carried: deque[Request] = deque()

    def __bool__(self) -> bool:
        """Whether a batch has anything to run."""
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
