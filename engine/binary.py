"""Binary results: bytes, Arrow tables, DataFrames and numpy arrays, never turned into JSON.

A handler that returns `bytes`/`bytearray`/`memoryview`, a `pyarrow.Table` or
`RecordBatch`, a pandas `DataFrame` or a numpy array makes a `BinaryResult`: its size is
known before a byte is written, so a worker on the supervisor writes it once, straight into
a shared-memory segment, and the caller reads it without JSON (`read_binary`). Where there
is no shared memory (an in-process store, a store other hosts read, a small result) it is
stored as `{"$binary": form, "data": base64}`.

    form     written as                   read back as
    bytes    the bytes                    bytes (a view: a read-only memoryview)
    arrow    an Arrow IPC stream          a pyarrow.Table (a view: over the segment)
    pandas   an Arrow IPC stream          a pandas DataFrame (`Table.to_pandas()`)
    npy      numpy's .npy format          a numpy array (a view: read-only, over the segment)

Every form is data: reading a result never runs code its writer chose. There is no pickle
form; an `.npy` of Python objects is refused; an Arrow stream is validated before use (and
pyarrow from 14.0.1 on never unpickles an extension type it reads).
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from queryqueue.engine.errors import QueryError

FORMS = ("bytes", "arrow", "pandas", "npy")
# JSON outcomes of at least this many bytes stay bytes on their way to a driver: one with
# shared memory writes them there without ever making text of them.
LARGE_JSON = 256 * 1024
INLINE_MARK = '{"$binary"'


@dataclass(eq=False)
class BinaryResult:
    form: str  # one of FORMS, or "json": a large outcome's text as UTF-8, in `data`
    size: int
    write_into: Callable[[memoryview], None]  # writes exactly `size` bytes at the start
    data: bytes | None = None  # the bytes themselves, where they exist already

    def to_bytes(self) -> bytes:
        if self.data is not None:
            return self.data
        buffer = bytearray(self.size)
        with memoryview(buffer) as target:
            self.write_into(target)
        return bytes(buffer)

    def inline_text(self) -> str:
        """The outcome text of this result where no shared memory carries it."""
        if self.form == "json":
            return self.to_bytes().decode()
        return orjson.dumps({"$binary": self.form, "data": _b64(self.to_bytes())}).decode()


def from_bytes(form: str, data: bytes) -> BinaryResult:
    """A result of `form` whose bytes exist already (a large JSON outcome's UTF-8 text,
    a segment's content)."""

    def write(target: memoryview) -> None:
        target[: len(data)] = data

    return BinaryResult(form, len(data), write, data)


# What an ACK carries: outcome text, or a binary result its driver stores its own way.
Outcome = str | BinaryResult


class ResultView:
    """A result read in place (`QueryQueue.run(..., view=True)`): `value` is valid until
    `release()`, which ends the lease on its shared memory; `async with` releases on exit.
    A result that was not in shared memory is a private copy: releasing it does nothing."""

    def __init__(self, value: Any, release: Callable[[], Awaitable[None]] | None = None):
        self.value = value
        self._release = release

    async def release(self) -> None:
        """Let go of the value and its shared memory (the view ends here)."""
        # Ours goes first: with no reference to it left, its memory may be reused.
        release, self._release, self.value = self._release, None, None
        if release is not None:
            await release()

    async def __aenter__(self) -> Any:
        return self.value

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


def binary_of(value: Any) -> BinaryResult | None:
    """The binary result a handler's return value is, or None for a JSON one."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _bytes_result(value)
    module = type(value).__module__
    if module.startswith("pyarrow"):
        import pyarrow as pa

        if isinstance(value, pa.Table | pa.RecordBatch):
            return _arrow_result(value, "arrow")
    elif module.startswith("pandas"):
        import pandas as pd

        if isinstance(value, pd.DataFrame):
            return _arrow_result(_arrow_of_frame(value), "pandas")
    elif module == "numpy":
        from queryqueue.engine import npy

        if npy.is_array(value) and not value.dtype.hasobject:
            return _npy_result(*npy.plan(value))
    return None


def _bytes_result(value: bytes | bytearray | memoryview) -> BinaryResult:
    data = memoryview(value).cast("B")

    def write(target: memoryview) -> None:
        target[: data.nbytes] = data

    return BinaryResult("bytes", data.nbytes, write)


def _arrow_of_frame(frame: Any) -> Any:
    import pyarrow as pa

    try:
        return pa.Table.from_pandas(frame)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise QueryError(
            f"query result is a DataFrame Arrow cannot hold ({exc}): give its columns "
            "plain types (numbers, strings, dates, decimals)"
        ) from None


def _arrow_result(value: Any, form: str) -> BinaryResult:
    import pyarrow as pa

    sink = pa.MockOutputStream()  # the stream's size, without writing it
    with pa.ipc.new_stream(sink, value.schema) as writer:
        writer.write(value)

    def write(target: memoryview) -> None:
        out = pa.FixedSizeBufferWriter(pa.py_buffer(target))
        with pa.ipc.new_stream(out, value.schema) as writer:
            writer.write(value)

    return BinaryResult(form, sink.size(), write)


def _npy_result(header: bytes, data: memoryview) -> BinaryResult:
    def write(target: memoryview) -> None:
        target[: len(header)] = header
        target[len(header) : len(header) + data.nbytes] = data

    return BinaryResult("npy", len(header) + data.nbytes, write)


def read_binary(form: str, data: memoryview, *, view: bool = False) -> Any:
    """The value of a binary result. `view`: over `data` itself (read-only), else a copy."""
    if form == "bytes":
        return data.toreadonly() if view else bytes(data)
    if form in ("arrow", "pandas"):
        table = read_arrow(data, view=view)
        return table.to_pandas() if form == "pandas" else table
    if form == "npy":
        from queryqueue.engine import npy

        return npy.read(data.toreadonly() if view else data, copy=not view)
    raise QueryError(
        f"a binary result of form {form!r} is refused: results are data "
        f"({', '.join(FORMS)}), never a form whose reading could run its writer's code"
    )


def read_arrow(data: memoryview, *, view: bool = False) -> Any:
    """The Arrow table an IPC stream holds, checked whole before anyone reads a value: a
    crafted stream (offsets past its buffers) is an error, not a read out of bounds."""
    try:
        import pyarrow as pa
    except ImportError:
        raise QueryError(
            "this result is an Arrow table: install pyarrow (queryqueue[arrow]) to read it"
        ) from None
    source = pa.py_buffer(data.toreadonly() if view else bytes(data))
    try:
        with pa.ipc.open_stream(source) as reader:
            table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise QueryError(f"an Arrow result is malformed: {exc}") from None
    return table


def parse_inline(decoded: dict[str, Any]) -> tuple[str, bytes]:
    """(form, bytes) of a decoded `{"$binary": form, "data": base64}` outcome."""
    form, data = decoded.get("$binary"), decoded.get("data")
    if not isinstance(form, str) or not isinstance(data, str):
        raise QueryError("a binary result's outcome is malformed")
    try:
        return form, base64.b64decode(data, validate=True)
    except ValueError:
        raise QueryError("a binary result's outcome is malformed: its data is not base64") from None


def decode_inline(decoded: dict[str, Any]) -> Any:
    """The value of a `{"$binary": form, "data": base64}` outcome."""
    form, data = parse_inline(decoded)
    return read_binary(form, memoryview(data))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
