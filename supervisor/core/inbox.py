"""What has arrived and waits for a batch: in order, with what a batch carried over first
and the commands that free a slot (a worker's ACK) next.

A burst of ADDs (thousands of callers at once) fills the inbox; an ACK arriving behind
them would wait for every one of them to run, its worker's next query with it, while the
queue's budget sat idle. So a command that frees a slot goes ahead of what other
connections sent, never ahead of anything its own connection sent earlier.
"""

from __future__ import annotations

from collections import deque

from queryqueue.supervisor.core.requests import COMMANDS, Request


class Inbox:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.queued: deque[Request] = deque()
        # Taken for a batch that ended early (`BatchTransaction.gives_work`): first next.
        self.carried: deque[Request] = deque()
        # Commands freeing a slot whose connection had nothing queued: after `carried`.
        self.freeing: deque[Request] = deque()
        self._queued_by: dict[int, int] = {}  # requests in `queued`, by connection

    def __bool__(self) -> bool:
        """Whether a batch has anything to run."""
        return bool(self.carried or self.freeing or self.queued)

    def append(self, request: Request) -> None:
        by = id(request.connection)
        command = COMMANDS.get(request.method)
        if command is not None and command.frees_slot and by not in self._queued_by:
            self.freeing.append(request)
            return
        self._queued_by[by] = self._queued_by.get(by, 0) + 1
        self.queued.append(request)

    def queued_from(self, connection: object) -> int:
        """Requests of `connection` waiting behind the others (not freeing a slot)."""
        return self._queued_by.get(id(connection), 0)

    def take(self, most: int | None = None) -> list[Request]:
        """The next batch: what was carried over, the commands freeing a slot, then what
        arrived, at most `most` (by default `max_batch`)."""
        batch: list[Request] = []
        carried, freeing, queued = self.carried, self.freeing, self.queued
        most = self.max_batch if most is None else min(most, self.max_batch)
        while len(batch) < most and carried:
            batch.append(carried.popleft())
        while len(batch) < most and freeing:
            batch.append(freeing.popleft())
        counts = self._queued_by
        while len(batch) < most and queued:
            request = queued.popleft()
            by = id(request.connection)
            left = counts[by] - 1
            if left:
                counts[by] = left
            else:
                del counts[by]
            batch.append(request)
        return batch

    def carry(self, rest: list[Request]) -> None:
        """What a batch that ended early did not run: ahead of anything since."""
        self.carried.extendleft(reversed(rest))
