"""Either side of a connection to the supervisor: frames cut from the bytes as they arrive.

A reader task per connection (StreamReader.readexactly, twice a frame) woke a task and
resolved a future for every burst a client sent: a caller's ADD with its long poll, a
worker's ACK, each a loop turn more in the supervisor before the frame reached its batch.
Here `data_received` cuts every complete frame out of what arrived and hands it on in the
same turn. Reading pauses (the transport stops reading the socket, the kernel's buffer
fills, the client's writes block) while its owner says the client must wait (`held_back`).
The client driver's links read their answers the same way (a sink that never holds back).
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from queryqueue.driver_socket.protocol import HEADER, FrameError, cut_short, over_limit


class FrameSink(Protocol):
    """What a connection's frames go to."""

    def opened(self, reader: FrameReader) -> None: ...

    def received(self, body: bytes) -> None: ...

    def held_back(self) -> bool:
        """True while no more of this client's frames should be taken."""
        ...

    def refused(self, error: FrameError) -> None:
        """The bytes are not frames (too large, cut short): answer; the reader hangs up."""
        ...

    def ending(self) -> None:
        """About to hang up: what this client was answered must be written now."""
        ...

    def lost(self) -> None:
        """The connection is gone."""
        ...


class FrameReader(asyncio.Protocol):
    def __init__(self, sink: FrameSink, max_frame: int, *, high_water: int | None = None) -> None:
        self.sink = sink
        self.max_frame = max_frame
        self.high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.writing_paused = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()  # an incomplete frame, or frames held back
        self._reading = True
        self._eof = False  # the client has sent its last byte
        self._done = False  # nothing more is taken
        self._closing = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports have asyncio.Transport's methods, not its class.
        self.transport = cast(asyncio.Transport, transport)
        if self.high_water is not None:  # else the transport's own
            self.transport.set_write_buffer_limits(high=self.high_water)
        self.sink.opened(self)
        if self._closing:  # closed while it was connecting
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        if self._buffer:
            self._buffer += data
            self._take_buffered()
            return
        # The common case: nothing left over, so frames are cut from `data` itself.
        taken = self._take(data)
        if taken < len(data):
            self._buffer += memoryview(data)[taken:]

    def eof_received(self) -> bool:
        self._eof = True
        self._finish()
        return True  # the frames held back are still answered; `close` hangs up

    def connection_lost(self, exc: Exception | None) -> None:
        self._done = True
        self.sink.lost()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.resume()

    # -- flow -------------------------------------------------------------------------------

    def resume(self) -> None:
        """Take what was held back, if the client may go on now (its answers have left)."""
        if self._done or self._reading:
            return
        if self._buffer:
            self._take_buffered()
        if not self._done and not self.sink.held_back() and self.transport is not None:
            self._reading = True
            if self._eof:
                self._finish()
            else:
                self.transport.resume_reading()

    def close(self) -> None:
        """Hang up once what was answered has been written."""
        if self._closing:
            return
        self._done = self._closing = True
        self.sink.ending()
        if self.transport is None:
            if not self.closed.done():  # it never connected: nothing will end
                self.closed.set_result(None)
        elif not self.transport.is_closing():
            self.transport.close()

    def _finish(self) -> None:
        """At the end of the client's bytes, once nothing is held back: hang up."""
        if self._closing or not self._reading:
            return
        if self._buffer:
            self._refuse(cut_short(self._buffer))
        else:
            self.close()

    def _take_buffered(self) -> None:
        taken = self._take(self._buffer)
        if taken:
            del self._buffer[:taken]

    def _take(self, data: bytes | bytearray) -> int:
        """Hand on the complete frames at the start of `data`; returns the bytes taken."""
        at, end_of_data = 0, len(data)
        sink = self.sink
        while not self._done:
            if sink.held_back():
                self._pause()
                break
            if end_of_data - at < HEADER.size:
                break
            (size,) = HEADER.unpack_from(data, at)
            if size > self.max_frame:
                self._refuse(over_limit(size, self.max_frame))
                break
            end = at + HEADER.size + size
            if end > end_of_data:
                break
            body = bytes(data[at + HEADER.size : end])
            at = end
            sink.received(body)
        return at

    def _pause(self) -> None:
        if self._reading and self.transport is not None:
            self._reading = False
            self.transport.pause_reading()

    def _refuse(self, error: FrameError) -> None:
        self._done = True
        self._buffer.clear()
        self.sink.refused(error)
        self.close()
