"""What the socket driver keeps of a result on its way: a long poll sent with its ADD
(`PipelinedPoll`, claimed by the caller that asks next) and a result in shared memory,
leased to the connection until it is copied or its view released (`SharedRead`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from queryqueue.driver_socket.link import ConnectionLost, Link, Overdue
from queryqueue.driver_socket.segments import Reference, view_value
from queryqueue.engine.errors import CommandTimeoutError, SupervisorUnavailableError
from queryqueue.engine.responses import QueueKey

_PIPELINED_KEPT_S = 5.0  # an answered, unclaimed pipelined long poll is dropped after


@dataclasses.dataclass(eq=False)
class PipelinedPoll:
    """A RESULT_BLOCKING sent with its ADD: its answer, when it comes, on `link`."""

    link: Link
    wait_id: int
    waited: asyncio.Future[dict[str, Any]]

    async def reply(self, within: float) -> dict[str, Any] | None:
        """Its reply; None if its connection was lost (ask again, the ordinary way)."""
        if not self.waited.done():
            self.link.answer_within(self.wait_id, within)
        try:
            return await self.waited
        except ConnectionLost:
            return None
        except Overdue:
            self.drop()
            raise CommandTimeoutError(f"result_blocking: no answer in {within}s") from None
        except asyncio.CancelledError:
            self.drop()
            raise

    def drop(self) -> None:
        self.link.pending.pop(self.wait_id, None)
        if self.waited.done():
            if not self.waited.cancelled():
                self.waited.exception()  # retrieved: no "never retrieved" warning
        else:
            self.waited.cancel()


class PipelinedPolls:
    """RESULT_BLOCKINGs sent with their ADD (`then_wait_ms`), by (queue id, timeout), until
    the caller asks for them: oldest first, since callers of this process that joined one
    item (dedup) each sent one and each claims one."""

    def __init__(self) -> None:
        self._kept: dict[tuple[QueueKey, int], list[PipelinedPoll]] = {}

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def kept(self, key: tuple[QueueKey, int]) -> list[PipelinedPoll]:
        """The polls kept for `key`, oldest first (a copy)."""
        return list(self._kept.get(key, ()))

    def keep(self, key: tuple[QueueKey, int], pipelined: PipelinedPoll) -> None:
        """Keep `pipelined` for the caller that will ask for it (dropped unclaimed a
        while after its answer came: nobody will)."""
        self._kept.setdefault(key, []).append(pipelined)

        def forget() -> None:  # answered and never asked for: nobody will
            kept = self._kept.get(key, [])
            if pipelined in kept:
                kept.remove(pipelined)
                if not kept:
                    del self._kept[key]
                pipelined.drop()

        def kept(waited: asyncio.Future[dict[str, Any]]) -> None:
            if not waited.cancelled():
                # Its connection's loss is nobody's concern until the poll is claimed (the
                # claim still sees it): no "exception was never retrieved" at collection.
                waited.exception()
            if pipelined in self._kept.get(key, ()):  # claimed already: no timer
                asyncio.get_running_loop().call_later(_PIPELINED_KEPT_S, forget)

        pipelined.waited.add_done_callback(kept)

    def claim(self, key: tuple[QueueKey, int]) -> PipelinedPoll | None:
        """The oldest pipelined poll kept for `key`, now the caller's."""
        kept = self._kept.get(key)
        if not kept:
            return None
        pipelined = kept.pop(0)
        if not kept:
            del self._kept[key]
        return pipelined


@dataclasses.dataclass(eq=False)
class SharedRead:
    """A binary result in shared memory, leased to this connection until it is read: a
    copy releases the lease at once, a view when its `release` is called."""

    driver: Any  # the SocketQueueDriver whose connection holds the lease
    ref: Reference

    async def read(self, *, view: bool) -> dict[str, Any]:
        ref, driver = self.ref, self.driver
        if ref.form == "json":  # a copy whatever `view` says: its values are Python's
            try:
                outcome: dict[str, Any] = driver._segments.read_json(ref)
            finally:
                await self.release()
            return outcome
        if not view:
            try:
                value = driver._segments.read_value(ref)
            finally:
                await self.release()
            return {"result": value}
        try:
            await driver.call("shm_view", ref.name, ref.generation)
            value, memory = view_value(ref, driver._segments.owner)
        except BaseException:
            await self.release()
            raise

        async def release_view() -> None:
            # Unmapped only if nothing views it any more; else the supervisor never
            # rewrites the segment (a view used after its release still reads its result).
            try:
                memory.close()
            except BufferError:
                await self.release(view_closed=False)
            else:
                await self.release(view_closed=True)

        return {"result": value, "$lease": release_view}

    async def release(self, view_closed: bool | None = None) -> None:
        args = [self.ref.name, self.ref.generation]
        if view_closed is not None:
            args.append(view_closed)
        with contextlib.suppress(SupervisorUnavailableError):
            await self.driver.call("shm_release", *args)
