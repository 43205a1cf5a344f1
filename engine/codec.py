"""A query's result as JSON that keeps its Python types: the result codec.

A result travels as Cube's outcome, `{"result": value}`, where `value` is the JSON any Cube
client reads. A value JSON has no word for is written the way Cube's own drivers write it
(a Decimal as its digits in a string, a date as ISO text), and its type is recorded beside
the result in `"$types"`, a key Cube clients never look at: a tree that follows the result
down to each tagged value and no further. A Python caller decoding with the same codecs
gets its types back.

    Python value               in "result"                       tag
    Decimal                    "1.50"                            decimal
    datetime (naive or tz)     "2026-01-02T03:04:05+01:00"       datetime
    date, time                 ISO text                          date, time
    UUID                       "6f1c...-..."                     uuid
    bytes, bytearray           base64 text                       bytes
    set, frozenset             a list                            set, frozenset
    int past 64 bits           its digits in a string            int
    numpy scalar               a number or bool                  np:<dtype>
    numpy array                nested lists                      ndarray:<dtype>:<shape>
    a registered type          what its `encode` returns         its name
    dataclass (unregistered)   an object of its fields           (none: a dict comes back)
    tuple                      a list                            (none: a list comes back)
    Enum, str/int subclasses   its value                         (none)

Anything else fails the query with a `QueryError` naming the type and where it was.

The tree: a node is a tag, or a dict with any of "v" (a node for the value itself before
"t" is undone), "k" (children by key), "*" (one node for every item of a list), "i"
(children by list index) and "t" (a tag undone after the children). Rows of one schema
share one "*" node, NULLs and all, so a million rows with a Decimal column cost one tag.

Plain JSON (the common case) is checked by one walk and written by orjson directly.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import re
import sys
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import orjson

from queryqueue.engine.binary import LARGE_JSON, BinaryResult, binary_of, from_bytes
from queryqueue.engine.errors import InvalidCommandError, QueryError

_PLAIN = frozenset({str, int, float, bool, type(None)})
Node = str | dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Codec:
    name: str
    type: type
    encode: Callable[[Any], Any]  # the value -> JSON (which may hold more encodable values)
    decode: Callable[[Any], Any]  # that JSON, decoded -> the value


class _Unencodable(Exception):
    def __init__(self, value: Any, why: str = "") -> None:
        self.value, self.why = value, why
        self.path: list[str | int] = []  # from the value up, as the walk unwinds


class Codecs:
    """The codecs of one queue (an app registers its own types on its QueueApp, so every
    process that imports the app encodes and decodes alike)."""

    def __init__(self) -> None:
        self._by_type: dict[type, Codec] = {}
        self._by_name: dict[str, Codec] = {}
        for codec in _BUILT_IN:
            self._add(codec)

    def register(
        self,
        cls: type,
        name: str | None = None,
        *,
        encode: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> None:
        """Encode `cls` with `encode` (to JSON, which may hold other encodable values) and
        give it back with `decode`. A dataclass needs neither: its fields, then `cls(**)`."""
        name = name or f"{cls.__module__}.{cls.__qualname__}"
        if ":" in name or (name in self._by_name and self._by_name[name].type is not cls):
            raise ValueError(f"codec name {name!r} is taken or has a ':'")
        if encode is None or decode is None:
            if not dataclasses.is_dataclass(cls):
                raise ValueError(f"a codec for {cls.__qualname__} needs encode and decode")
            encode = encode or _fields
            decode = decode or (lambda fields: cls(**fields))
        self._add(Codec(name, cls, encode, decode))

    def _add(self, codec: Codec) -> None:
        self._by_type[codec.type] = codec
        self._by_name[codec.name] = codec

    # Encoding ------------------------------------------------------------------------------

    def encode_outcome(self, value: Any) -> str | BinaryResult:
        """What a successful query's ACK carries: a binary result (bytes, Arrow, a DataFrame, an array)
        as it is, a large JSON one as its bytes (a driver with shared memory writes them
        there as they are: no text made of them), anything else as its outcome text."""
        binary = binary_of(value)
        if binary is not None:
            return binary
        data = self.encode_bytes(value)
        return from_bytes("json", data) if len(data) >= LARGE_JSON else data.decode()

    def encode_value(self, value: Any, name: str) -> tuple[Any, Node | None]:
        """`value` (a query, a query key) as plain JSON, and the node that gives its types
        back (None: it is plain JSON). A value without a codec is an `InvalidCommandError`
        naming its type and where it is in `name`."""
        if _is_plain(value):
            try:
                orjson.dumps(value)
                return value, None
            except TypeError:
                pass  # an int past 64 bits: the walk below tags it
        try:
            return self._walk(value)
        except _Unencodable as exc:
            where = name + "".join(f"[{step!r}]" for step in reversed(exc.path))
            kind = type(exc.value)
            raise InvalidCommandError(
                f"the {name} holds a {kind.__module__}.{kind.__qualname__} at {where}"
                f"{exc.why or ', which has no codec'}: pass JSON values, a type of the "
                "documented mapping, or register a codec for it (QueueApp.codec)"
            ) from None

    def encode_result(self, value: Any) -> str:
        """The outcome text of a successful query."""
        return self.encode_bytes(value).decode()

    def encode_bytes(self, value: Any) -> bytes:
        """The outcome text of a successful query, as UTF-8."""
        if _is_plain(value):
            try:
                return orjson.dumps({"result": value})
            except TypeError:
                pass  # an int past 64 bits: the walk below tags it
        try:
            plain, node = self._walk(value)
        except _Unencodable as exc:
            where = "result" + "".join(f"[{step!r}]" for step in reversed(exc.path))
            kind = type(exc.value)
            raise QueryError(
                f"query result holds a {kind.__module__}.{kind.__qualname__} at {where}"
                f"{exc.why or ', which has no codec'}: return JSON values, a type of the "
                "documented mapping, or register a codec for it (QueueApp.codec)"
            ) from None
        outcome: dict[str, Any] = {"result": plain}
        if node is not None:
            outcome["$types"] = node
        return orjson.dumps(outcome)

    def _walk(self, value: Any) -> tuple[Any, Node | None]:
        kind = type(value)
        if kind in _PLAIN:
            if kind is int and not -(2**63) <= value < 2**64:
                return str(value), "int"
            return value, None
        if kind is list or kind is tuple:
            return self._walk_list(value)
        if kind is dict:
            return self._walk_dict(value)
        codec = self._codec_of(value)
        if codec is None:
            return self._walk_other(value)
        try:
            encoded = codec.encode(value)
        except Exception as exc:
            raise _Unencodable(value, f", whose codec {codec.name!r} failed: {exc!r}") from None
        plain, inner = self._walk(encoded)
        name = codec.name
        if codec.type is _NDARRAY_MARK:
            name = f"ndarray:{value.dtype.str}:{','.join(map(str, value.shape))}"
        elif codec.type is _NPSCALAR_MARK:
            name = f"np:{value.dtype.str}"
        if inner is None:
            return plain, name
        if isinstance(inner, dict) and "t" not in inner:
            return plain, {**inner, "t": name}  # its children first, then the tag
        return plain, {"v": inner, "t": name}

    def _walk_other(self, value: Any) -> tuple[Any, Node | None]:
        if isinstance(value, enum.Enum):
            return self._walk(value.value)
        for base in (str, int, float):
            if isinstance(value, base):
                return self._walk(base(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return self._walk(_fields(value))
        if isinstance(value, (list, tuple)):
            return self._walk_list(value)
        if isinstance(value, dict):
            return self._walk_dict(value)
        raise _Unencodable(value)

    def _walk_dict(self, value: dict[Any, Any]) -> tuple[Any, Node | None]:
        plain: dict[str, Any] = {}
        children: dict[str, Node] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _Unencodable(key, ", a dict key (JSON keys are strings)")
            try:
                plain[key], node = self._walk(item)
            except _Unencodable as exc:
                exc.path.append(key)
                raise
            if node is not None:
                children[key] = node
        return plain, ({"k": children} if children else None)

    def _walk_list(self, value: Any) -> tuple[Any, Node | None]:
        plain: list[Any] = []
        nodes: list[Node | None] = []
        for index, item in enumerate(value):
            try:
                encoded, node = self._walk(item)
            except _Unencodable as exc:
                exc.path.append(index)
                raise
            plain.append(encoded)
            nodes.append(node)
        tagged = [(i, n) for i, n in enumerate(nodes) if n is not None]
        if not tagged:
            return plain, None
        first = tagged[0][1]
        if len(tagged) == len(nodes) and all(n == first for _, n in tagged):
            return plain, {"*": first}
        union = _union_of([n for _, n in tagged])
        if union is not None and all(
            nodes[i] == union or _covers(item, union, nodes[i]) for i, item in enumerate(plain)
        ):
            return plain, {"*": union}
        return plain, {"i": {str(i): n for i, n in tagged}}

    def _codec_of(self, value: Any) -> Codec | None:
        kind = type(value)
        codec = self._by_type.get(kind)
        if codec is not None:
            return codec
        numpy = sys.modules.get("numpy")  # a numpy value means numpy is imported
        if numpy is not None:
            if isinstance(value, numpy.ndarray):
                return _NDARRAY
            if isinstance(value, numpy.generic):
                return _NPSCALAR
        for base in kind.__mro__[1:-1]:
            codec = self._by_type.get(base)
            if codec is not None:
                return codec
        return None

    # Decoding ------------------------------------------------------------------------------

    def decode(self, result: Any, node: Any) -> Any:
        """A decoded outcome's `result`, its `$types` undone. A tag builds only a type of
        the mapping or a registered codec's, and a tree that does not fit its result is a
        `QueryError` naming the problem, whoever wrote it."""
        if node is None:
            return result
        try:
            return self._apply(node, result)
        except QueryError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
            raise QueryError(f"the result's $types do not fit its values: {exc!r}") from None
        except RecursionError:
            raise QueryError("the result's $types nest deeper than this reader follows") from None

    def _apply(self, node: Any, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(node, dict):
            return self._undo(node, value)
        inner = node.get("v")
        if inner is not None:
            value = self._apply(inner, value)
        children = node.get("k")
        if children and isinstance(value, dict):
            for key, child in children.items():
                if key in value:
                    value[key] = self._apply(child, value[key])
        every = node.get("*")
        if every is not None and isinstance(value, list):
            value = [self._apply(every, item) for item in value]
        by_index = node.get("i")
        if by_index and isinstance(value, list):
            for index, child in by_index.items():
                value[int(index)] = self._apply(child, value[int(index)])
        tag = node.get("t")
        return value if tag is None else self._undo(tag, value)

    def _undo(self, tag: Any, value: Any) -> Any:
        if not isinstance(tag, str):
            raise QueryError(f"the result's $types hold {tag!r} where a tag belongs")
        name, _, arg = tag.partition(":")
        if name == "ndarray":
            return _ndarray_back(arg, value)
        if name == "np":
            return _numpy().dtype(_dtype_text(arg)).type(value)
        codec = self._by_name.get(name)
        if codec is None:
            raise QueryError(
                f"the result holds a value tagged {tag!r}, and no codec of that name is "
                "registered in this process (register it on the QueueApp every process imports)"
            )
        try:
            return codec.decode(value)
        except Exception as exc:
            raise QueryError(
                f"the result's value tagged {name!r} did not decode: {exc!r}"
            ) from None


def _is_plain(value: Any) -> bool:
    """JSON as it is: orjson writes it, and decoding it gives it back unchanged."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is list or kind is tuple:
        for item in value:  # noqa: SIM110 - a loop is faster than all() of a generator
            if type(item) not in _PLAIN and not _is_plain(item):
                return False
        return True
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or (type(item) not in _PLAIN and not _is_plain(item)):
                return False
        return True
    return False


def _as_dict(node: Node) -> dict[str, Any]:
    return {"t": node} if isinstance(node, str) else node


def _union_of(nodes: list[Node]) -> Node | None:
    """One node that does for each of `nodes` what it does (None if two disagree)."""
    union: Node | None = nodes[0]
    for node in nodes[1:]:
        union = _union(union, node) if union is not None else None
    return union


def _union(a: Node, b: Node) -> Node | None:
    if a == b:
        return a
    da, db = _as_dict(a), _as_dict(b)
    if da.get("t") != db.get("t") or "i" in da or "i" in db:
        return None
    merged: dict[str, Any] = {} if da.get("t") is None else {"t": da["t"]}
    for part in ("v", "*"):
        if part in da and part in db:
            both = _union(da[part], db[part])
            if both is None:
                return None
            merged[part] = both
        elif part in da or part in db:
            merged[part] = da.get(part, db.get(part))
    if "k" in da or "k" in db:
        keys = {**da.get("k", {})}
        for key, node in db.get("k", {}).items():
            both = _union(keys[key], node) if key in keys else node
            if both is None:
                return None
            keys[key] = both
        merged["k"] = keys
    return merged


def _covers(value: Any, union: Node, own: Node | None) -> bool:
    """Does `union` undo on `value` exactly what `own` (its own node, maybe none) does?"""
    if value is None or union == own:
        return True
    u = _as_dict(union)
    o = _as_dict(own) if own is not None else {}
    if u.get("t") != o.get("t") or ("v" in u and not _covers(value, u["v"], o.get("v"))):
        return False
    if "k" in u:
        if not isinstance(value, dict):
            return False
        own_keys = o.get("k", {})
        for key, node in u["k"].items():
            if key in value and not _covers(value[key], node, own_keys.get(key)):
                return False
    if "i" in u:
        own_items = o.get("i", {})
        for index, node in u["i"].items():
            if not isinstance(value, list) or int(index) >= len(value):
                return False
            if not _covers(value[int(index)], node, own_items.get(index)):
                return False
    if "*" in u:
        if not isinstance(value, list):
            return False
        for index, item in enumerate(value):
            mine = o["*"] if "*" in o else o.get("i", {}).get(str(index))
            if not _covers(item, u["*"], mine):
                return False
    return True


def _fields(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def _numpy() -> Any:
    import numpy  # only a result that holds numpy values gets here

    return numpy


# The dtypes a tag may name: numbers, booleans, dates and times, fixed-width text and bytes,
# and objects (of the JSON values given); never a structured or a sub-array dtype.
_DTYPE = re.compile(
    r"[<>=|]?(?:b1|[iu][1248]|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[mM]8(?:\[\d*[a-zA-Z]+\])?|[US]\d+|O)"
)
# A text dtype may be wider than its longest value, up to this many characters: the array's
# memory is then bounded by what the result holds, whatever its tag says.
_SLACK_WIDTH = 64


def _dtype_text(text: str) -> str:
    if not _DTYPE.fullmatch(text):
        raise QueryError(f"the result's $types name dtype {text!r}, which no tag may")
    return text


def _ndarray_back(arg: str, value: Any) -> Any:
    text, _, shape = arg.partition(":")
    dtype = _numpy().dtype(_dtype_text(text))
    dims = tuple(int(d) for d in shape.split(",") if d)
    if dtype.kind in "US":
        longest = max((len(item) for item in _leaves(value)), default=0)
        width = dtype.itemsize // (4 if dtype.kind == "U" else 1)
        if width > max(longest, _SLACK_WIDTH):
            raise QueryError(
                f"the result's $types make {width}-character text of values of at most {longest}"
            )
    # reshape refuses a shape the values do not fill: nothing is allocated for it
    return _numpy().array(value, dtype=dtype).reshape(dims)


def _leaves(value: Any) -> list[Any]:
    if not isinstance(value, list):
        return [value] if isinstance(value, (str, bytes)) else []
    return [leaf for item in value for leaf in _leaves(item)]


def _b64(value: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(value).decode()


class _NdarrayMark:
    pass


class _NpScalarMark:
    pass


class _BigIntMark:
    pass


_NDARRAY_MARK: type = _NdarrayMark
_NPSCALAR_MARK: type = _NpScalarMark
_NDARRAY = Codec("ndarray", _NDARRAY_MARK, lambda a: a.tolist(), lambda v: v)
_NPSCALAR = Codec("np", _NPSCALAR_MARK, lambda s: s.item(), lambda v: v)
_BUILT_IN = (
    Codec("int", _BigIntMark, str, int),  # only ints past 64 bits are given this tag
    Codec("decimal", Decimal, str, Decimal),
    Codec("datetime", dt.datetime, dt.datetime.isoformat, dt.datetime.fromisoformat),
    Codec("date", dt.date, dt.date.isoformat, dt.date.fromisoformat),
    Codec("time", dt.time, dt.time.isoformat, dt.time.fromisoformat),
    Codec("uuid", uuid.UUID, str, uuid.UUID),
    Codec("bytes", bytes, _b64, base64.b64decode),
    Codec("bytearray", bytearray, _b64, lambda v: bytearray(base64.b64decode(v))),
    Codec("set", set, list, set),
    Codec("frozenset", frozenset, list, frozenset),
)
