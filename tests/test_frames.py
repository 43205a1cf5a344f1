"""The supervisor's frame reader (driver_socket/frames.py), driven byte by byte: a fake
transport records what the reader asks of it, a sink records what it is handed."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from queryqueue.driver_socket.client import SocketQueueDriver
from queryqueue.driver_socket.frames import FrameReader
from queryqueue.driver_socket.protocol import FrameError
from tests.supervisor_util import start_supervisor


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


class Transport:
    def __init__(self) -> None:
        self.reading = True
        self.closing = False
        self.limits: int | None = None

    def set_write_buffer_limits(self, high: int) -> None:
        self.limits = high

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def is_reading(self) -> bool:
        return self.reading

    def close(self) -> None:
        self.closing = True


class Sink:
    def __init__(self, hold_after: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.errors: list[str] = []
        self.events: list[str] = []
        self.hold_after = hold_after  # held back once this many frames were taken

    def opened(self, reader: FrameReader) -> None:
        self.events.append("opened")

    def received(self, body: bytes) -> None:
        self.bodies.append(body)

    def held_back(self) -> bool:
        return self.hold_after is not None and len(self.bodies) >= self.hold_after

    def refused(self, error: FrameError) -> None:
        self.errors.append(str(error))

    def ending(self) -> None:
        self.events.append("ending")

    def lost(self) -> None:
        self.events.append("lost")


async def _reader(sink: Sink, max_frame: int = 1 << 20) -> tuple[FrameReader, Transport]:
    reader = FrameReader(sink, max_frame, high_water=1234)
    transport = Transport()
    reader.connection_made(transport)  # type: ignore[arg-type]
    return reader, transport


async def test_frames_are_cut_wherever_the_bytes_break() -> None:
    bodies = [b'{"id":%d}' % i for i in range(20)] + [b"x" * 5000, b""]
    stream = b"".join(frame(b) for b in bodies)
    for step in (1, 3, 7, 4096, len(stream)):
        sink = Sink()
        reader, transport = await _reader(sink)
        assert transport.limits == 1234
        for at in range(0, len(stream), step):
            reader.data_received(stream[at : at + step])
        assert sink.bodies == bodies, step
        assert reader.eof_received() is True
        assert transport.is_closing() and sink.events == ["opened", "ending"] and not sink.errors


async def test_a_held_back_client_is_not_read_and_loses_nothing() -> None:
    sink = Sink(hold_after=2)
    reader, transport = await _reader(sink)
    reader.data_received(b"".join(frame(b"%d" % i) for i in range(5)) + frame(b"56")[:3])
    assert sink.bodies == [b"0", b"1"] and not transport.is_reading()
    reader.resume()  # still held back: nothing more
    assert sink.bodies == [b"0", b"1"] and not transport.is_reading()
    sink.hold_after = None
    reader.resume()
    assert sink.bodies == [b"0", b"1", b"2", b"3", b"4"] and transport.is_reading()
    reader.data_received(frame(b"56")[3:])
    assert sink.bodies[-1] == b"56"


async def test_frames_held_back_at_the_clients_end_are_still_taken_then_it_hangs_up() -> None:
    sink = Sink(hold_after=1)
    reader, transport = await _reader(sink)
    reader.data_received(frame(b"a") + frame(b"b"))
    assert reader.eof_received() is True
    assert sink.bodies == [b"a"] and not transport.is_closing()
    sink.hold_after = None
    reader.resume()
    assert sink.bodies == [b"a", b"b"] and transport.is_closing()
    assert sink.events == ["opened", "ending"]


@pytest.mark.parametrize(
    ("tail", "message"),
    [(b"\x00\x00", "truncated frame header (2 of 4 bytes)"), (frame(b"abcdef")[:7], "3 of 6")],
)
async def test_a_stream_cut_short_is_refused_naming_what_is_missing(
    tail: bytes, message: str
) -> None:
    sink = Sink()
    reader, transport = await _reader(sink)
    reader.data_received(frame(b"whole") + tail)
    reader.eof_received()
    assert sink.bodies == [b"whole"]
    assert len(sink.errors) == 1 and message in sink.errors[0]
    assert transport.is_closing() and sink.events == ["opened", "ending"]


async def test_a_frame_over_the_limit_is_refused_and_nothing_after_it_is_read() -> None:
    sink = Sink()
    reader, transport = await _reader(sink, max_frame=10)
    reader.data_received(frame(b"ok") + frame(b"y" * 11) + frame(b"after"))
    reader.data_received(frame(b"later"))
    assert sink.bodies == [b"ok"]
    assert sink.errors == ["frame of 11 bytes is over the limit of 10 bytes"]
    assert transport.is_closing()


async def test_writes_paused_by_the_transport_hold_the_client_until_they_resume() -> None:
    class Writes(Sink):
        def __init__(self, reader_of: list[FrameReader]) -> None:
            super().__init__()
            self.reader_of = reader_of

        def held_back(self) -> bool:
            return self.reader_of[0].writing_paused

    box: list[FrameReader] = []
    sink = Writes(box)
    reader, transport = await _reader(sink)
    box.append(reader)
    reader.pause_writing()
    reader.data_received(frame(b"1"))
    assert sink.bodies == [] and not transport.is_reading()
    reader.resume_writing()
    assert sink.bodies == [b"1"] and transport.is_reading()


async def test_losing_the_connection_tells_the_sink_and_settles_closed() -> None:
    sink = Sink()
    reader, _ = await _reader(sink)
    reader.connection_lost(ConnectionResetError())
    await asyncio.wait_for(reader.closed, 1)
    reader.data_received(frame(b"late"))
    assert sink.bodies == [] and sink.events == ["opened", "lost"]


def test_a_driver_never_closed_hangs_up_as_its_loop_ends(workdir: Path) -> None:
    """Its link has no reader task for asyncio.run to cancel: its keeper hangs up, so no
    transport is left open to warn as it is collected."""
    supervisor = start_supervisor(workdir / "queue.db", workdir / "s.sock")
    try:

        async def use() -> SocketQueueDriver:
            driver = SocketQueueDriver(supervisor.socket_path)
            assert await driver.ping() == "pong"
            return driver  # and never closed

        driver = asyncio.run(use())
        link = driver.connection.link
        assert link is not None and link.transport is not None
        assert link.transport.is_closing() and not link.alive
    finally:
        assert supervisor.stop() == 0
