"""Large results through shared memory: the worker writes, the store keeps a reference.

A result of at least `threshold` bytes does not travel through the socket. The worker
asks the supervisor for a segment (`shm_alloc`), writes the result into it once (its JSON
as UTF-8, or a binary result as it is: engine/binary.py) and ACKs with a small reference,
`{"$shm": name, "gen": g, "size": n}` (plus `"form"` for a binary one), which is all the
store holds. Whoever reads the result gets the reference and copies the bytes out, or
views a binary one in place (`shm_view`).

The supervisor owns every segment (`SegmentPool`), so a crash of either side never leaks
one:

* a segment being written is leased to the writer's connection: if it hangs up before
  its ACK, the segment goes back to the pool;
* each delivery of a reference (a RESULT answer, or every parked RESULT_BLOCKING of a
  deduplicated query) is a read lease of the reader's connection, released by the reader
  after its copy or by its hang-up; a delivered segment returns to the pool once no
  lease is left and a short grace (a re-sent read) has passed;
* a result nobody reads is dropped with the store's result TTL;
* after a supervisor crash the segments are still in /dev/shm: the next supervisor on
  the same socket adopts those of acknowledged results nobody has read yet (the header
  carries the generation, and marks a delivered one) so they stay readable, and unlinks
  the rest; a graceful stop unlinks every segment.

Segments are reused (power-of-two size classes, the last freed first): a new segment
costs the kernel's zeroing of its pages (posix_fallocate, ~35 ms for 128 MiB) and every
process's first mapping of it (MAP_POPULATE), a reused one neither, as writers and readers
keep their mappings. Every reuse bumps the generation written in the header, and a reader
checks it before and after its copy, so a stale reference is an error, never wrong data.
A segment viewed in place is never rewritten while a view may remain: a view released
with nothing referring to it lets its segment be reused; one still referenced, or whose
reader hung up, leaves it to be unlinked once free (its pages live as long as the view).

A segment is its owner's alone (`shm_segment.py`): names no other user can guess, mode
0600, and every open checks the descriptor's owner and mode, adoption included.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from queryqueue.driver_socket.segments import (
    HEADER,
    MAGIC,
    MAGIC_READ,
    SHM_DIR,
    ForeignSegmentError,
    Reference,
    SharedMemoryFullError,
    SharedResultError,
    create,
    open_owned,
    parse_reference,
    unlink,
)
from queryqueue.engine.binary import from_bytes
from queryqueue.engine.errors import InvalidCommandError

_log = logging.getLogger(__name__)
# Caps on segments in use (written, stored or being read): in all, and leased to one
# connection (writing or reading), so one client cannot take every other's room.
DEFAULT_MAX_TOTAL = 4 * 1024 * 1024 * 1024
DEFAULT_MAX_CONNECTION = 1024 * 1024 * 1024
MIN_SEGMENT = 1024 * 1024


@dataclass(eq=False)
class _Segment:
    name: str
    capacity: int
    memory: mmap.mmap
    generation: int = 0
    state: str = "free"  # free | writing | stored
    writer: object | None = None
    stored_at: float = 0.0
    delivered_at: float | None = None  # last delivery or lease end
    grace: float = 0.0  # how long after `delivered_at`, with no lease left, it is kept
    freed_at: float = 0.0
    readers: Counter[object] = field(default_factory=Counter)
    views: Counter[object] = field(default_factory=Counter)  # open views, by reader
    # A view may outlive its lease (still referenced at its release, or its reader hung
    # up): the segment is never rewritten, and unlinked once free (the view's mapping
    # keeps its pages until its reader lets go of it).
    pinned: bool = False


class SegmentPool:
    """Every shared-memory segment of one supervisor, and who may still touch each one."""

    def __init__(
        self,
        prefix: str,
        *,
        result_ttl: float = 300.0,
        reread_grace: float = 0.5,
        release_grace: float = 0.0,
        max_free_bytes: int = 256 * 1024 * 1024,
        max_segment: int = 2 * 1024 * 1024 * 1024,
        max_total_bytes: int = DEFAULT_MAX_TOTAL,
        max_connection_bytes: int = DEFAULT_MAX_CONNECTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.max_total_bytes = max_total_bytes
        self.max_connection_bytes = max_connection_bytes
        self.result_ttl = result_ttl
        # Kept after the last lease ends, for a read still on its way: a reader that hung
        # up may reconnect and send its read again (reread_grace); one that released has
        # its copy (release_grace: none by default, so the next result reuses the segment
        # whose pages every process has mapped already).
        self.reread_grace = reread_grace
        self.release_grace = release_grace
        self.max_free_bytes = max_free_bytes
        self.max_segment = max_segment
        self.clock = clock
        self._segments: dict[str, _Segment] = {}
        # This start's own part of every name: no other user can guess a name to plant a
        # file under before this supervisor creates it.
        self._token = secrets.token_hex(8)
        self.owner = os.geteuid()
        self._serial = 0
        self._generation = 0
        self.created = 0
        self.reused = 0

    # Writers ------------------------------------------------------------------------------

    def alloc(self, size: Any, writer: object) -> dict[str, Any]:
        """A segment for a result of `size` bytes, leased to `writer` until its ACK."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidCommandError("shm_alloc: size must be a positive integer")
        if size + HEADER.size > self.max_segment:
            raise InvalidCommandError(
                f"shm_alloc: a result of {size} bytes is over the limit of {self.max_segment}"
            )
        capacity = max(MIN_SEGMENT, 1 << (size + HEADER.size - 1).bit_length())
        leased = self.leased_bytes(writer)
        if leased + capacity > self.max_connection_bytes:
            raise SharedMemoryFullError(
                f"shm_alloc: this connection holds {leased} bytes of shared memory; "
                f"{capacity} more would pass its cap of {self.max_connection_bytes}"
            )
        # The smallest free segment that fits: reused pages are already touched.
        segment = self._free_fitting(capacity)
        if segment is None:
            self._return_unread()  # one whose grace is over, not yet swept, will do
            segment = self._free_fitting(capacity)
        if segment is None:
            in_use = sum(s.capacity for s in self._segments.values())
            if in_use + capacity > self.max_total_bytes:
                self.trim(capacity)
                in_use = sum(s.capacity for s in self._segments.values())
            if in_use + capacity > self.max_total_bytes:
                raise SharedMemoryFullError(
                    f"shm_alloc: {in_use} bytes of shared memory in use; {capacity} more "
                    f"would pass the cap of {self.max_total_bytes}"
                )
            segment = self._create(capacity)
        else:
            self.reused += 1
        self._generation += 1
        segment.generation = self._generation
        HEADER.pack_into(segment.memory, 0, MAGIC, segment.generation)
        segment.state, segment.writer = "writing", writer
        segment.delivered_at, segment.readers = None, Counter()
        return {"name": segment.name, "gen": segment.generation, "capacity": capacity}

    def _create(self, capacity: int) -> _Segment:
        self._serial += 1
        name = f"{self.prefix}{self._token}_{self._serial}"
        memory = create(name, capacity)  # not populated: nothing of ours writes it in bulk
        segment = self._segments[name] = _Segment(name, capacity, memory)
        self.created += 1
        return segment

    def acked(self, result: Any, success: bool) -> None:
        """An ACK carrying a reference committed (`success`) or found no item."""
        found = self._find(result)
        if found is None:
            return
        if success:
            found.state, found.writer, found.stored_at = "stored", None, self.clock()
        else:
            self._free(found)  # nothing will ever read it

    def check_ack(self, result: Any) -> None:
        """Before an ACK runs: its reference must name a segment holding that result."""
        parsed = parse_reference(result)
        if parsed is not None and self._find(result) is None:
            raise SharedResultError(
                f"the shared-memory segment of this result ({parsed[0]}, generation "
                f"{parsed[1]}) is gone: its writer hung up before the ACK"
            )

    def take(self, result: Any) -> str:
        """The result a reference names as the outcome text to store, and its segment back
        to the pool: for a store other hosts read, which must hold the result itself."""
        ref, data = self.copy_out(result)
        segment = self._find(result)
        if segment is not None:
            self._free(segment)
        if ref.form == "json":
            return str(data, "utf-8")
        return from_bytes(ref.form, data).inline_text()

    def copy_out(self, result: Any) -> tuple[Reference, bytes]:
        """The bytes a reference names, copied (the supervisor's own read)."""
        segment = self._find(result)
        parsed = parse_reference(result)
        if segment is None or parsed is None:
            raise SharedResultError(f"no shared-memory segment holds {result!r}")
        with memoryview(segment.memory) as whole:
            return parsed, bytes(whole[HEADER.size : HEADER.size + parsed.size])

    def mark_viewed(self, name: Any, generation: Any, reader: object) -> None:
        """`reader`, holding a lease, reads the segment in place until its release."""
        segment = self._segments.get(name) if isinstance(name, str) else None
        if segment is None or segment.generation != generation or not segment.readers[reader]:
            raise SharedResultError(
                f"shared-memory result {name}#{generation} is not leased to this connection"
            )
        segment.views[reader] += 1

    # Readers ------------------------------------------------------------------------------

    def lease(self, result: Any, reader: object) -> bool:
        """A reference is about to be delivered to `reader`: False if it is stale."""
        segment = self._find(result)
        if segment is None or segment.state != "stored":
            return False
        segment.readers[reader] += 1
        segment.delivered_at, segment.grace = self.clock(), self.reread_grace
        HEADER.pack_into(segment.memory, 0, MAGIC_READ, segment.generation)
        return True

    def release(self, name: Any, generation: Any, reader: object, view_closed: Any = None) -> None:
        """`reader` is done with its read; a view's release says whether the view is
        gone (`view_closed`: its reader unmapped it) or may still be used."""
        segment = self._segments.get(name) if isinstance(name, str) else None
        if segment is None or segment.generation != generation or not segment.readers[reader]:
            return
        if view_closed is not None and segment.views[reader]:
            segment.views[reader] -= 1
            if not segment.views[reader]:
                del segment.views[reader]
            segment.pinned = segment.pinned or view_closed is not True
        segment.readers[reader] -= 1
        if not segment.readers[reader]:
            del segment.readers[reader]
            segment.delivered_at = self.clock()  # the grace starts now
            segment.grace = min(segment.grace, self.release_grace)

    def drop_owner(self, owner: object) -> None:
        """`owner`'s connection closed: its write and read leases end."""
        for segment in list(self._segments.values()):
            if segment.state == "writing" and segment.writer is owner:
                self._free(segment)
            elif segment.readers.pop(owner, None):
                segment.delivered_at, segment.grace = self.clock(), self.reread_grace
                if segment.views.pop(owner, None):
                    segment.pinned = True  # it may have hung up alive, its view mapped

    # Housekeeping -------------------------------------------------------------------------

    def sweep(self) -> None:
        """Return to the pool what nobody can read any more; trim the pool. A lease ends
        with the result TTL too (its segment is then unlinked, never rewritten)."""
        self._return_unread()
        free = [s for s in self._segments.values() if s.state == "free"]
        excess = sum(s.capacity for s in free) - self.max_free_bytes
        for segment in sorted(free, key=lambda s: s.capacity, reverse=True):
            if excess <= 0:
                break
            excess -= segment.capacity
            self._destroy(segment)

    def _free_fitting(self, capacity: int) -> _Segment | None:
        """The smallest free segment that fits, the last freed first: its pages are made,
        and writers and readers likely still have it mapped."""
        return min(
            (s for s in self._segments.values() if s.state == "free" and s.capacity >= capacity),
            key=lambda s: (s.capacity, -s.freed_at),
            default=None,
        )

    def _return_unread(self) -> None:
        now = self.clock()
        for segment in list(self._segments.values()):
            if segment.state != "stored":
                continue
            if segment.readers:
                if (
                    segment.delivered_at is not None
                    and now - segment.delivered_at >= self.result_ttl
                ):
                    segment.pinned = True  # a reader may still be in it
                    self._free(segment)
                continue
            if segment.delivered_at is not None:
                if now - segment.delivered_at >= segment.grace:
                    self._free(segment)
            elif now - segment.stored_at >= self.result_ttl:
                self._free(segment)

    def trim(self, wanted: int) -> None:
        """Destroy free segments (largest first) until `wanted` more bytes fit the cap."""
        in_use = sum(s.capacity for s in self._segments.values())
        free = sorted(
            (s for s in self._segments.values() if s.state == "free"),
            key=lambda s: s.capacity,
            reverse=True,
        )
        for segment in free:
            if in_use + wanted <= self.max_total_bytes:
                return
            in_use -= segment.capacity
            self._destroy(segment)

    def leased_bytes(self, owner: object) -> int:
        """Shared memory `owner` holds: segments it writes or is reading."""
        return sum(
            s.capacity
            for s in self._segments.values()
            if (s.state == "writing" and s.writer is owner) or owner in s.readers
        )

    def adopt(self) -> int:
        """Take over the segments a crashed supervisor on this socket left behind: only
        files of this uid, mode 0600, with a header of ours; any other file under the
        prefix is left alone, and named in one warning."""
        adopted, foreign = 0, []
        for path in SHM_DIR.glob(self.prefix + "*") if SHM_DIR.is_dir() else ():
            try:
                memory = open_owned(path.name, self.owner)
            except ForeignSegmentError as exc:
                foreign.append(str(exc))
                continue
            except SharedResultError:
                continue  # gone meanwhile
            magic, generation = HEADER.unpack_from(memory, 0)
            if magic != MAGIC or generation <= 0:  # free, being written, or read already
                memory.close()
                unlink(path.name)
                continue
            segment = _Segment(path.name, len(memory), memory, generation, "stored")
            segment.stored_at = self.clock()
            self._segments[path.name] = segment
            self._generation = max(self._generation, generation)
            adopted += 1
        if foreign:
            _log.warning(
                "left alone %d file(s) under this supervisor's segment names: %s",
                len(foreign),
                "; ".join(foreign),
            )
        return adopted

    def close(self, *, keep_stored: bool = False) -> None:
        """At shutdown: unlink every segment. `keep_stored` keeps stored results nobody has
        read, for a supervisor that will adopt them (a test of adoption does)."""
        for segment in list(self._segments.values()):
            if keep_stored and segment.state == "stored":
                segment.memory.close()
                continue
            self._destroy(segment)
        self._segments.clear()

    def describe(self) -> dict[str, Any]:
        states = Counter(s.state for s in self._segments.values())
        return {
            "segments": len(self._segments),
            "free": states["free"],
            "writing": states["writing"],
            "stored": states["stored"],
            "leased": sum(1 for s in self._segments.values() if s.readers),
            "bytes": sum(s.capacity for s in self._segments.values()),
            "created": self.created,
            "reused": self.reused,
        }

    def _find(self, result: Any) -> _Segment | None:
        parsed = parse_reference(result)
        if parsed is None:
            return None
        name, generation, size, _ = parsed
        segment = self._segments.get(name)
        if (
            segment is None
            or segment.generation != generation
            or segment.state == "free"
            or size > segment.capacity - HEADER.size
        ):
            return None
        return segment

    def _free(self, segment: _Segment) -> None:
        if segment.pinned or segment.views:
            self._destroy(segment)
            return
        segment.freed_at = self.clock()
        segment.state, segment.writer = "free", None
        segment.readers, segment.delivered_at = Counter(), None
        self._generation += 1  # readers of the old content see a different generation
        segment.generation = self._generation
        HEADER.pack_into(segment.memory, 0, MAGIC, 0)

    def _destroy(self, segment: _Segment) -> None:
        self._segments.pop(segment.name, None)
        segment.memory.close()
        unlink(segment.name)
