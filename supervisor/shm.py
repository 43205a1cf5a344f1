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

`multiprocessing.shared_memory.SharedMemory` registers every attach with a resource
tracker that unlinks the segment when the *attaching* process exits (Python < 3.13), which
would destroy results the supervisor owns; so segments are opened with the same
`_posixshmem` calls it uses, without the tracker.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import hashlib
import mmap
import os
import secrets
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from queryqueue.engine.binary import FORMS, BinaryResult, from_bytes, read_binary
from queryqueue.engine.errors import InvalidCommandError, StoreError

DEFAULT_THRESHOLD = 1024 * 1024
# Caps on segments in use (written, stored or being read): in all, and leased to one
# connection (writing or reading), so one client cannot take every other's room.
DEFAULT_MAX_TOTAL = 4 * 1024 * 1024 * 1024
DEFAULT_MAX_CONNECTION = 1024 * 1024 * 1024
MIN_SEGMENT = 1024 * 1024
HEADER = struct.Struct("<8sQ")  # magic, generation
MAGIC = b"qqresult"
# The same segment once delivered to a reader: a supervisor that adopts segments after a
# crash leaves these (whoever waited has it), so a read result never outlives its reader.
MAGIC_READ = b"qqresred"
REFERENCE_MARK = '{"$shm":'
SHM_DIR = Path("/dev/shm")


class SharedResultError(StoreError):
    """A shared-memory result could not be written or read (segment gone or reused)."""


class SharedMemoryFullError(SharedResultError):
    """No segment for this result: /dev/shm is full, or a cap on shared memory (per
    connection, in total) would be passed. The writer sends the result through the socket."""


def _free_bytes() -> int:
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def name_prefix(socket_path: str | Path) -> str:
    """Segments of the supervisor serving `socket_path` start with this (no leading /)."""
    digest = hashlib.sha1(str(Path(socket_path).resolve()).encode()).hexdigest()[:10]
    return f"qq{digest}_"


def _open(name: str, size: int | None, *, populate: bool = True) -> mmap.mmap:
    """Map segment `name`; create it with `size` bytes when `size` is given. `populate`:
    map every page now (a writer's or reader's mapping: no page faults in its copy)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
            try:
                # Make every page now: touching a page tmpfs has no room for kills the
                # toucher with SIGBUS, and a later write into it costs no allocation.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                _unlink(name)
                raise SharedMemoryFullError(
                    f"no room in {SHM_DIR} for a {size}-byte segment ({exc.strerror}): "
                    f"{_free_bytes()} bytes free there"
                ) from None
        length = os.fstat(fd).st_size
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, length, flags=flags)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


class Reference(NamedTuple):
    name: str
    generation: int
    size: int
    form: str  # "json": the outcome's text; else a binary result's form (engine/binary.py)


def reference(name: str, generation: int, size: int, form: str = "json") -> str:
    shape: dict[str, Any] = {"$shm": name, "gen": generation, "size": size}
    if form != "json":
        shape["form"] = form
    return orjson.dumps(shape).decode()


def parse_reference(text: Any) -> Reference | None:
    """The reference `text` is, or None when it is not one."""
    if not isinstance(text, str) or not text.startswith(REFERENCE_MARK) or len(text) > 512:
        return None
    try:
        data = orjson.loads(text)
        name, generation, size = data["$shm"], data["gen"], data["size"]
        form = data.get("form", "json")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not (isinstance(name, str) and isinstance(generation, int) and isinstance(size, int)):
        return None
    if form != "json" and form not in FORMS:
        return None
    return Reference(name, generation, size, form)


# -- the supervisor's side -------------------------------------------------------------------


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
        self._token = secrets.token_hex(3)
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
        name = f"{self.prefix}{self._token}{self._serial}"
        memory = _open(name, capacity, populate=False)  # nothing of ours writes it in bulk
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

    def adopt(self, directory: Path = SHM_DIR) -> int:
        """Take over the segments a crashed supervisor on this socket left behind."""
        adopted = 0
        if not directory.is_dir():
            return 0
        for path in directory.glob(self.prefix + "*"):
            try:
                memory = _open(path.name, None)
            except OSError:
                continue
            magic, generation = HEADER.unpack_from(memory, 0)
            if magic != MAGIC or generation <= 0:  # free, being written, or read already
                memory.close()
                _unlink(path.name)
                continue
            segment = _Segment(path.name, len(memory), memory, generation, "stored")
            segment.stored_at = self.clock()
            self._segments[path.name] = segment
            self._generation = max(self._generation, generation)
            adopted += 1
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
        _unlink(segment.name)


# -- the client's side --------------------------------------------------------------------------


class SegmentMaps:
    """A process's mappings of segments, kept while they are reused (bounded)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def _map(self, name: str) -> mmap.mmap:
        memory = self._maps.pop(name, None)
        if memory is None:
            try:
                memory = _open(name, None)
            except FileNotFoundError:
                raise SharedResultError(f"shared-memory segment {name} is gone") from None
        self._maps[name] = memory
        while len(self._maps) > self.keep:
            _, old = self._maps.popitem(last=False)
            old.close()
        return memory

    def write(self, slot: dict[str, Any], data: bytes) -> str:
        """Write `data` into the segment `shm_alloc` gave; the reference to ACK with."""
        return self.write_binary(slot, from_bytes("json", data))

    def write_binary(self, slot: dict[str, Any], result: BinaryResult) -> str:
        """Write `result` (once, in place) into the segment `shm_alloc` gave; the
        reference to ACK with."""
        name, generation = slot["name"], slot["gen"]
        memory = self._map(name)
        if result.size > len(memory) - HEADER.size or _generation(memory) != generation:
            raise SharedResultError(f"shared-memory segment {name} is not ours to write")
        with memoryview(memory) as whole, whole[HEADER.size : HEADER.size + result.size] as target:
            result.write_into(target)
        return reference(name, generation, result.size, result.form)

    def read(self, ref: Reference) -> str:
        """A JSON result's text, decoded straight out of its segment: one copy."""
        text: str = self._read(ref, lambda data: str(data, "utf-8"))
        return text

    def read_json(self, ref: Reference) -> Any:
        """A JSON result, parsed straight out of its segment."""
        return self._read(ref, orjson.loads)

    def read_value(self, ref: Reference, pickle_modules: Collection[str]) -> Any:
        """A binary result, copied out of its segment."""
        return self._read(
            ref, lambda data: read_binary(ref.form, data, pickle_modules=pickle_modules)
        )

    def _read(self, ref: Reference, read: Callable[[memoryview], Any]) -> Any:
        # The generation before and after: a segment reused meanwhile is an error, never
        # another result's bytes.
        memory = self._map(ref.name)
        if _generation(memory) != ref.generation or ref.size > len(memory) - HEADER.size:
            raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
        with memoryview(memory) as whole, whole[HEADER.size : HEADER.size + ref.size] as data:
            value = read(data)
        if _generation(memory) != ref.generation:
            raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
        return value

    def close(self) -> None:
        for memory in self._maps.values():
            memory.close()
        self._maps.clear()


def view_value(ref: Reference, pickle_modules: Collection[str]) -> tuple[Any, mmap.mmap]:
    """A binary result read in place, and the mapping of its own it is read from (which
    cannot close while the value, or anything made of it, is still referenced)."""
    try:
        memory = _open(ref.name, None)
    except FileNotFoundError:
        raise SharedResultError(f"shared-memory segment {ref.name} is gone") from None
    if _generation(memory) != ref.generation or ref.size > len(memory) - HEADER.size:
        memory.close()
        raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
    data = memoryview(memory)[HEADER.size : HEADER.size + ref.size]
    return read_binary(ref.form, data, view=True, pickle_modules=pickle_modules), memory


def _generation(memory: mmap.mmap) -> int:
    magic, generation = HEADER.unpack_from(memory, 0)
    return int(generation) if magic in (MAGIC, MAGIC_READ) else -1
