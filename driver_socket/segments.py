"""One shared-memory segment: its file, whose it is, its header, the reference to it, and a
reader's mappings of segments (the supervisor's pool of them is `shm.py`).

A segment is a file in /dev/shm that only its owner may touch: it is created with
`O_CREAT | O_EXCL` and mode 0600 whatever the umask, under a name with a random part no
other user can guess, and every open (the supervisor adopting segments after a crash, a
worker writing a result, a caller reading one) uses `O_NOFOLLOW` and then checks the open
descriptor itself: a regular file, owned by the supervisor's uid, mode 0600. A file that
another user planted under the supervisor's name prefix is therefore never adopted,
written or read, whatever it holds.

`multiprocessing.shared_memory.SharedMemory` registers every attach with a resource
tracker that unlinks the segment when the *attaching* process exits (Python < 3.13), which
would destroy results the supervisor owns; so segments are opened here directly, without
the tracker.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from queryqueue.engine.binary import BinaryResult, from_bytes, read_binary
from queryqueue.engine.errors import StoreError
from queryqueue.engine.result_rules import SHARED_REFERENCE_MARK as REFERENCE_MARK

DEFAULT_THRESHOLD = 1024 * 1024
HEADER = struct.Struct("<8sQ")  # magic, generation
MAGIC = b"qqresult"
# The same segment once delivered to a reader: a supervisor that adopts segments after a
# crash leaves these (whoever waited has it), so a read result never outlives its reader.
MAGIC_READ = b"qqresred"
SHM_DIR = Path("/dev/shm")
MODE = 0o600


class SharedResultError(StoreError):
    """A shared-memory result could not be written or read (segment gone or reused)."""


class SharedMemoryFullError(SharedResultError):
    """No segment for this result: /dev/shm is full, or a cap on shared memory (per
    connection, in total) would be passed. The writer sends the result through the socket."""


class ForeignSegmentError(SharedResultError):
    """A file under a supervisor's segment name that is not its own: another owner, another
    mode, not a regular file. Nothing of it is mapped."""


def free_bytes() -> int:
    try:
        info = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def name_prefix(socket_path: str | Path) -> str:
    """Segments of the supervisor serving `socket_path` start with this (no leading /). It
    is no secret: each supervisor start adds a random part of its own (`SegmentPool`)."""
    digest = hashlib.sha1(str(Path(socket_path).resolve()).encode()).hexdigest()[:10]
    return f"qq{digest}_"


def create(name: str, size: int) -> mmap.mmap:
    """A new segment of `size` bytes, every page made, mode 0600: an existing file of that
    name (whoever made it) is an error, never reused."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(SHM_DIR / name, flags, MODE)
    except FileExistsError:
        raise ForeignSegmentError(f"shared-memory segment {name} exists already") from None
    try:
        os.fchmod(fd, MODE)  # the umask may have taken bits away; nobody else gets any
        os.ftruncate(fd, size)
        try:
            # Make every page now: touching a page tmpfs has no room for kills the
            # toucher with SIGBUS, and a later write into it costs no allocation.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            unlink(name)
            raise SharedMemoryFullError(
                f"no room in {SHM_DIR} for a {size}-byte segment ({exc.strerror}): "
                f"{free_bytes()} bytes free there"
            ) from None
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def open_owned(name: str, owner: int, *, populate: bool = True) -> mmap.mmap:
    """Map segment `name` if it is `owner`'s own: a regular file of that uid, mode 0600,
    with room for a header (checked on the descriptor that is mapped: no race with a file
    swapped in between). `populate`: map every page now (no page faults in a copy)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SharedResultError(f"shared-memory segment {name} is gone") from None
    except OSError as exc:  # ELOOP: a symbolic link; EACCES: another user's file
        raise ForeignSegmentError(f"shared-memory segment {name}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
            raise ForeignSegmentError(
                f"shared-memory segment {name} is not the supervisor's (uid {owner}): "
                f"owned by uid {info.st_uid}, mode {stat.filemode(info.st_mode)}"
            )
        if stat.S_IMODE(info.st_mode) != MODE or info.st_size < HEADER.size:
            raise ForeignSegmentError(
                f"shared-memory segment {name} has mode {stat.S_IMODE(info.st_mode):o} and "
                f"{info.st_size} bytes: the supervisor's are 600, with a header"
            )
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, info.st_size, flags=flags)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


def generation_of(memory: mmap.mmap) -> int:
    magic, generation = HEADER.unpack_from(memory, 0)
    return int(generation) if magic in (MAGIC, MAGIC_READ) else -1


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
    if not isinstance(form, str):
        return None  # a form no reader takes is refused by the reader, naming it
    return Reference(name, generation, size, form)


class SegmentMaps:
    """A process's mappings of segments, kept while they are reused (bounded). `owner`:
    the supervisor's uid, which every segment mapped must belong to (its connection's
    peer; this process's own until it is known)."""

    def __init__(self, keep: int = 8, owner: int | None = None) -> None:
        self.keep = keep
        self.owner = os.geteuid() if owner is None else owner
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def _map(self, name: str) -> mmap.mmap:
        memory = self._maps.pop(name, None)
        if memory is None:
            memory = open_owned(name, self.owner)
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
        if result.size > len(memory) - HEADER.size or generation_of(memory) != generation:
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

    def read_value(self, ref: Reference) -> Any:
        """A binary result, copied out of its segment."""
        return self._read(ref, lambda data: read_binary(ref.form, data))

    def _read(self, ref: Reference, read: Callable[[memoryview], Any]) -> Any:
        # The generation before and after: a segment reused meanwhile is an error, never
        # another result's bytes.
        memory = self._map(ref.name)
        if generation_of(memory) != ref.generation or ref.size > len(memory) - HEADER.size:
            raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
        with memoryview(memory) as whole, whole[HEADER.size : HEADER.size + ref.size] as data:
            value = read(data)
        if generation_of(memory) != ref.generation:
            raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
        return value

    def close(self) -> None:
        for memory in self._maps.values():
            memory.close()
        self._maps.clear()


def view_value(ref: Reference, owner: int) -> tuple[Any, mmap.mmap]:
    """A binary result read in place, and the mapping of its own it is read from (which
    cannot close while the value, or anything made of it, is still referenced)."""
    memory = open_owned(ref.name, owner)
    if generation_of(memory) != ref.generation or ref.size > len(memory) - HEADER.size:
        memory.close()
        raise SharedResultError(f"shared-memory result {ref.name}#{ref.generation} was reused")
    data = memoryview(memory)[HEADER.size : HEADER.size + ref.size]
    try:
        return read_binary(ref.form, data, view=True), memory
    except BaseException:
        data.release()
        with contextlib.suppress(BufferError):  # a frame of the error may still hold a slice
            memory.close()
        raise
