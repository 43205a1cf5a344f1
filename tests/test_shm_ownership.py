"""Shared memory is its owner's: a file another user plants under a supervisor's segment
names is never adopted, written or read; a segment of the wrong owner, mode or kind is
refused by every reader; names carry a part no other user can guess; a new segment is
0600 whatever the umask."""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from queryqueue import MemoryQueueStore, SocketQueueDriver
from queryqueue.driver_socket.segments import (
    HEADER,
    MAGIC,
    SHM_DIR,
    ForeignSegmentError,
    SegmentMaps,
    create,
    name_prefix,
    parse_reference,
    unlink,
)
from queryqueue.engine.binary import binary_of
from queryqueue.supervisor.server import QueueServer
from queryqueue.supervisor.shm import SegmentPool

MiB = 1024 * 1024
PLANTED = b"planted by another user"


@pytest.fixture
def prefix(workdir: Path) -> Iterator[str]:
    value = name_prefix(workdir / "s.sock")
    yield value
    for path in SHM_DIR.glob(value + "*"):
        path.unlink()  # what a test planted (root may remove another user's file)


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("planting a file as another user needs a root test runner")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("this machine has no user 'nobody' to plant files as")


def _plant_as(uid: int, name: str, mode: int = 0o666) -> Path:
    """A segment-shaped file (our header, a generation, a payload) made by `uid` itself,
    with the shell's tools (that user may not read this interpreter's directory)."""
    path = SHM_DIR / name
    header = "qqresult\\007" + "\\000" * 7
    script = f'umask 0; set -e; printf "{header}%s" "$2" > "$1"; chmod {mode:o} "$1"; truncate -s 1M "$1"'
    subprocess.run(
        ["/bin/sh", "-c", script, "plant", str(path), PLANTED.decode()],
        user=uid,
        cwd="/",
        check=True,
        timeout=60,
    )
    assert path.stat().st_uid == uid and path.read_bytes()[: HEADER.size] == HEADER.pack(MAGIC, 7)
    return path


def _own_file(name: str, mode: int) -> Path:
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, HEADER.pack(MAGIC, 3) + b"x" * 64)
    finally:
        os.close(fd)
    return path


def test_a_file_planted_by_another_user_is_not_adopted_reused_or_read(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    planted = _plant_as(_nobody(), prefix + "planted")
    before = planted.read_bytes()
    pool, maps = SegmentPool(prefix), SegmentMaps()
    try:
        with caplog.at_level(logging.WARNING, logger="queryqueue.supervisor.shm"):
            assert pool.adopt() == 0
        warnings = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
        assert (
            len(warnings) == 1
            and "planted" in warnings[0]
            and "not the supervisor's" in warnings[0]
        )
        result = binary_of(b"secret result " * MiB)
        assert result is not None
        ref = maps.write_binary(pool.alloc(result.size, "worker"), result)
        parsed = parse_reference(ref)
        assert parsed is not None and parsed.name != planted.name
        pool.acked(ref, success=True)
        with pytest.raises(ForeignSegmentError, match="not the supervisor's"):
            maps.read(parsed._replace(name=planted.name))
    finally:
        maps.close()
        pool.close()
    assert planted.read_bytes() == before, "the planted file was written"


async def test_a_supervisor_starting_over_a_planted_file_never_uses_it(
    workdir: Path, prefix: str
) -> None:
    planted = _plant_as(_nobody(), prefix + "planted")
    before = planted.read_bytes()
    server = QueueServer(MemoryQueueStore(), workdir / "s.sock")
    await server.start()
    writer = SocketQueueDriver(server.socket_path, shm_threshold=1024)
    try:
        assert server.segments.describe()["segments"] == 0
        added = await writer.add("p:big", "{}")
        result = binary_of(b"secret result " * MiB)
        assert result is not None
        assert (await writer.ack(added.id, result)).success
        stored = server.store.result(added.id)
        assert stored is not None and stored.payload is not None
        ref = parse_reference(stored.payload)
        assert ref is not None and ref.name != planted.name
    finally:
        await writer.close()
        await server.stop()
    assert planted.exists() and planted.read_bytes() == before


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o400])
def test_a_reader_refuses_a_segment_of_another_mode(prefix: str, mode: int) -> None:
    path = _own_file(prefix + "loose", mode)
    maps = SegmentMaps()
    try:
        ref = parse_reference(f'{{"$shm": "{path.name}", "gen": 3, "size": 8}}')
        assert ref is not None
        with pytest.raises(ForeignSegmentError, match=f"mode {mode:o}"):
            maps.read(ref)
    finally:
        maps.close()


def test_a_reader_refuses_a_segment_of_another_owner_or_kind(prefix: str) -> None:
    path = _own_file(prefix + "ours", 0o600)
    ref = parse_reference(f'{{"$shm": "{path.name}", "gen": 3, "size": 8}}')
    assert ref is not None
    other = SegmentMaps(owner=os.geteuid() + 1)  # a supervisor of another uid
    with pytest.raises(ForeignSegmentError, match=r"not the supervisor's \(uid"):
        other.read(ref)
    link = SHM_DIR / (prefix + "link")
    link.symlink_to(path)
    mine = SegmentMaps()
    try:
        with pytest.raises(ForeignSegmentError, match=link.name):
            mine.read(ref._replace(name=link.name))
        assert mine.read(ref) == "x" * 8  # the same file, opened as itself, is read
    finally:
        mine.close()


def test_a_segment_is_created_0600_whatever_the_umask_and_never_over_a_file(
    prefix: str,
) -> None:
    old = os.umask(0o277)
    try:
        memory = create(prefix + "new", MiB)
    finally:
        os.umask(old)
    memory.close()
    assert (SHM_DIR / (prefix + "new")).stat().st_mode & 0o777 == 0o600
    path = _own_file(prefix + "taken", 0o600)
    before = path.read_bytes()
    with pytest.raises(ForeignSegmentError, match="exists already"):
        create(path.name, MiB)
    assert path.read_bytes() == before
    unlink(prefix + "new")


def test_two_supervisors_on_one_socket_name_their_segments_apart(prefix: str) -> None:
    first, second = SegmentPool(prefix), SegmentPool(prefix)
    try:
        a, b = first.alloc(MiB, "w")["name"], second.alloc(MiB, "w")["name"]
        assert a.startswith(prefix) and b.startswith(prefix) and a != b
        # the part after the prefix is random, not a count anyone could run through
        assert len(a[len(prefix) :].split("_")[0]) == 16
    finally:
        first.close()
        second.close()
