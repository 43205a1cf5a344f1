"""Binary results: bytes, Arrow tables and pickled objects, never turned into JSON.

A handler that returns `bytes`/`bytearray`/`memoryview`, a `pyarrow.Table` or
`RecordBatch`, or `Pickled(obj)` makes a `BinaryResult`: its size is known before a byte
is written, so a worker on the supervisor writes it once, straight into a shared-memory
segment, and the caller reads it without JSON (`read_binary`). Where there is no shared
memory (an in-process store, a store other hosts read, a small result) it is stored as
`{"$binary": form, "data": base64}`.

    form     written as                                   read back as
    bytes    the bytes                                    bytes (a view: a read-only memoryview)
    arrow    an Arrow IPC stream                          a pyarrow.Table (a view: over the segment)
    pickle   pickle protocol 5, out-of-band buffers after  the object; buffers over the segment
             it (64-byte aligned)                           in a view

A pickled result is unpickled only into classes of the modules its queue allows
(`Codecs.pickle_modules`: numpy, pandas, pyarrow and the standard library's value types by
default), so a result is never a way to run code in its reader.
"""

from __future__ import annotations

import base64
import io
import pickle
import struct
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import orjson

from queryqueue.engine.errors import QueryError

FORMS = ("bytes", "arrow", "pickle")
# JSON outcomes of at least this many bytes stay bytes on their way to a driver: one with
# shared memory writes them there without ever making text of them.
LARGE_JSON = 256 * 1024
INLINE_MARK = '{"$binary"'
_ALIGN = 64
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
DEFAULT_PICKLE_MODULES = frozenset(
    {"numpy", "pandas", "pyarrow", "datetime", "decimal", "uuid", "collections", "zoneinfo"}
)
_SAFE_BUILTINS = frozenset(
    {"set", "frozenset", "bytearray", "bytes", "complex", "slice", "range", "list", "dict"}
    | {"tuple", "int", "float", "str", "bool", "object"}
)


@dataclass(frozen=True, slots=True)
class Pickled:
    """Return `Pickled(obj)` from a handler to send `obj` pickled (protocol 5): a DataFrame,
    numpy arrays, your own classes (allow their module on the caller's side)."""

    value: Any


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
    if isinstance(value, Pickled):
        return _pickle_result(value.value)
    if type(value).__module__.startswith("pyarrow"):
        import pyarrow as pa

        if isinstance(value, pa.Table | pa.RecordBatch):
            return _arrow_result(value)
    return None


def _bytes_result(value: bytes | bytearray | memoryview) -> BinaryResult:
    data = memoryview(value).cast("B")

    def write(target: memoryview) -> None:
        target[: data.nbytes] = data

    return BinaryResult("bytes", data.nbytes, write)


def _arrow_result(value: Any) -> BinaryResult:
    import pyarrow as pa

    sink = pa.MockOutputStream()  # the stream's size, without writing it
    with pa.ipc.new_stream(sink, value.schema) as writer:
        writer.write(value)

    def write(target: memoryview) -> None:
        out = pa.FixedSizeBufferWriter(pa.py_buffer(target))
        with pa.ipc.new_stream(out, value.schema) as writer:
            writer.write(value)

    return BinaryResult("arrow", sink.size(), write)


def _pickle_result(value: Any) -> BinaryResult:
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception as exc:
        raise QueryError(f"query result could not be pickled: {exc!r}") from None
    raws = [b.raw() for b in buffers]
    header = _COUNT.size + _LENGTH.size * (1 + len(raws))
    offsets, offset = [], _aligned(header + len(data))
    for raw in raws:
        offsets.append(offset)
        offset = _aligned(offset + raw.nbytes)
    size = offsets[-1] + raws[-1].nbytes if raws else header + len(data)

    def write(target: memoryview) -> None:
        _COUNT.pack_into(target, 0, len(raws))
        for i, length in enumerate([len(data), *(r.nbytes for r in raws)]):
            _LENGTH.pack_into(target, _COUNT.size + i * _LENGTH.size, length)
        target[header : header + len(data)] = data
        for start, raw in zip(offsets, raws, strict=True):
            target[start : start + raw.nbytes] = raw

    return BinaryResult("pickle", size, write)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def read_binary(
    form: str, data: memoryview, *, view: bool = False, pickle_modules: Collection[str] = ()
) -> Any:
    """The value of a binary result. `view`: over `data` itself (read-only), else a copy."""
    if form == "bytes":
        return data.toreadonly() if view else bytes(data)
    if form == "arrow":
        try:
            import pyarrow as pa
        except ImportError:
            raise QueryError(
                "this result is an Arrow table: install pyarrow (queryqueue[arrow]) to read it"
            ) from None
        source = pa.py_buffer(data.toreadonly() if view else bytes(data))
        with pa.ipc.open_stream(source) as reader:
            return reader.read_all()
    if form == "pickle":
        return _unpickle(data.toreadonly() if view else memoryview(bytearray(data)), pickle_modules)
    raise QueryError(f"unknown binary result form {form!r}")


def _unpickle(data: memoryview, modules: Collection[str]) -> Any:
    (count,) = _COUNT.unpack_from(data, 0)
    lengths = [
        _LENGTH.unpack_from(data, _COUNT.size + i * _LENGTH.size)[0] for i in range(count + 1)
    ]
    start = _COUNT.size + _LENGTH.size * (count + 1)
    pickled = data[start : start + lengths[0]]
    buffers, offset = [], _aligned(start + lengths[0])
    for length in lengths[1:]:
        buffers.append(data[offset : offset + length])
        offset = _aligned(offset + length)
    return _Unpickler(io.BytesIO(pickled), buffers, frozenset(modules)).load()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: list[memoryview], modules: frozenset[str]):
        super().__init__(file, buffers=buffers)
        self.modules = modules

    def find_class(self, module: str, name: str) -> Any:
        root = module.partition(".")[0]
        if (module == "builtins" and name in _SAFE_BUILTINS) or (
            module == "copyreg" and name == "_reconstructor"
        ):
            return super().find_class(module, name)
        if root in self.modules and root != "builtins":
            return super().find_class(module, name)
        raise QueryError(
            f"the pickled result holds {module}.{name}, and {root!r} is not among the modules "
            f"this queue unpickles ({', '.join(sorted(self.modules))}): allow it with "
            "QueueApp(pickle_modules=...)"
        )


def parse_inline(decoded: dict[str, Any]) -> tuple[str, bytes]:
    """(form, bytes) of a decoded `{"$binary": form, "data": base64}` outcome."""
    form, data = decoded.get("$binary"), decoded.get("data")
    if not isinstance(form, str) or not isinstance(data, str):
        raise QueryError("a binary result's outcome is malformed")
    return form, base64.b64decode(data)


def decode_inline(decoded: dict[str, Any], pickle_modules: Collection[str]) -> Any:
    """The value of a `{"$binary": form, "data": base64}` outcome."""
    form, data = parse_inline(decoded)
    return read_binary(form, memoryview(data), pickle_modules=pickle_modules)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
