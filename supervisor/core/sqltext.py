"""QUEUE commands as Cube Store SQL text, and Cube Store's row shapes for the answers.

Accepts what Cube's `CubeStoreQueueDriver` (1.7) sends after `sqlstring` formatting:
MySQL string literals (`'…'` or `"…"`, backslash escapes `\\0 \\b \\n \\r \\t \\Z \\\\ \\' \\"`,
doubled quotes), bare integers, `NULL`, keywords in any case. A parsed command is a call on
the queue store; its answer is turned into rows whose column names and values are Cube
Store's (numbers and booleans as strings, NULL as None).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from queryqueue.engine.errors import InvalidCommandError
from queryqueue.engine.responses import (
    AddAndRetrieveResponse,
    AddToQueueResponse,
    ListResponse,
    QueryDefResponse,
    ResultResponse,
    RetrieveResponse,
    ToCancelResponse,
)

Row = dict[str, str | None]

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<semicolon>;)
    """,
    re.VERBOSE | re.DOTALL,
)
_ESCAPES = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a"}


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # "string", "number", "word", "null"
    value: Any


@dataclass(slots=True)
class ParsedCommand:
    method: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    rows: Callable[[Any], list[Row]] = lambda answer: []


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    position = 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            snippet = text[position : position + 20]
            raise InvalidCommandError(
                f"cannot parse the command at character {position}: {snippet!r}"
            )
        position = match.end()
        kind = match.lastgroup
        raw = match.group()
        if kind == "space" or kind == "semicolon":
            continue
        if kind == "string":
            tokens.append(Token("string", _unquote(raw)))
        elif kind == "number":
            tokens.append(Token("number", float(raw) if "." in raw else int(raw)))
        elif raw.upper() == "NULL":
            tokens.append(Token("null", None))
        else:
            tokens.append(Token("word", raw.upper()))
    return tokens


def _unquote(raw: str) -> str:
    quote, body = raw[0], raw[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
        elif char == quote and i + 1 < len(body) and body[i + 1] == quote:
            out.append(quote)
            i += 2
        else:
            out.append(char)
            i += 1
    return "".join(out)


class _Reader:
    def __init__(self, tokens: list[Token], command: str) -> None:
        self.tokens = tokens
        self.position = 0
        self.command = command

    def peek_word(self, *words: str) -> str | None:
        if self.position < len(self.tokens):
            token = self.tokens[self.position]
            if token.kind == "word" and token.value in words:
                self.position += 1
                return str(token.value)
        return None

    def _next(self, what: str) -> Token:
        if self.position >= len(self.tokens):
            raise InvalidCommandError(f"{self.command}: missing {what}")
        token = self.tokens[self.position]
        self.position += 1
        return token

    def integer(self, what: str) -> int:
        token = self._next(what)
        if token.kind != "number" or not isinstance(token.value, int):
            raise InvalidCommandError(
                f"{self.command}: {what} must be an integer, got {_show(token)}"
            )
        return int(token.value)

    def number(self, what: str) -> float:
        token = self._next(what)
        if token.kind != "number":
            raise InvalidCommandError(
                f"{self.command}: {what} must be a number, got {_show(token)}"
            )
        return float(token.value) if isinstance(token.value, float) else int(token.value)

    def string(self, what: str) -> str:
        token = self._next(what)
        if token.kind != "string":
            raise InvalidCommandError(
                f"{self.command}: {what} must be a quoted string, got {_show(token)}"
            )
        return str(token.value)

    def nullable_string(self, what: str) -> str | None:
        token = self._next(what)
        if token.kind == "null":
            return None
        if token.kind != "string":
            raise InvalidCommandError(
                f"{self.command}: {what} must be a quoted string or NULL, got {_show(token)}"
            )
        return str(token.value)

    def key(self) -> str | int:
        """A path ('prefix:hash') or a bare queue id."""
        token = self._next("key")
        if token.kind == "string":
            return str(token.value)
        if token.kind == "number" and isinstance(token.value, int):
            return int(token.value)
        raise InvalidCommandError(
            f"{self.command}: key must be a quoted path or an integer id, got {_show(token)}"
        )

    def end(self) -> None:
        if self.position < len(self.tokens):
            extra = self.tokens[self.position]
            raise InvalidCommandError(
                f"{self.command}: unexpected {_show(extra)} after the command"
            )


def _show(token: Token) -> str:
    if token.kind == "string":
        return "a string"
    if token.kind == "null":
        return "NULL"
    return repr(str(token.value))


def parse(text: str) -> ParsedCommand:
    """Parse one QUEUE command; raises InvalidCommandError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidCommandError("empty command")
    tokens = tokenize(text)
    if not tokens or tokens[0] != Token("word", "QUEUE"):
        raise InvalidCommandError("only QUEUE commands are accepted")
    if len(tokens) < 2 or tokens[1].kind != "word":
        raise InvalidCommandError("QUEUE: missing the command name")
    name = str(tokens[1].value)
    parser = _PARSERS.get(name)
    if parser is None:
        raise InvalidCommandError(f"unknown command QUEUE {name}")
    reader = _Reader(tokens[2:], f"QUEUE {name}")
    parsed = parser(reader)
    reader.end()
    return parsed


def _add_options(r: _Reader) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if r.peek_word("EXCLUSIVE"):
        options["exclusive"] = True
    while (word := r.peek_word("PRIORITY", "ORPHANED", "EXTERNAL_ID")) is not None:
        if word == "PRIORITY":
            options["priority"] = r.integer("PRIORITY")
        elif word == "ORPHANED":
            options["orphaned"] = r.number("ORPHANED")
        else:
            options["external_id"] = r.string("EXTERNAL_ID")
    return options


def _add(r: _Reader) -> ParsedCommand:
    options = _add_options(r)
    path, payload = r.string("path"), r.string("payload")
    return ParsedCommand("add", [path, payload], options, lambda a: [_add_row(a)])


def _add_and_retrieve(r: _Reader) -> ParsedCommand:
    options = _add_options(r)
    path, payload = r.string("path"), r.string("payload")
    concurrency = r.integer("concurrency")
    return ParsedCommand(
        "add_and_retrieve", [path, payload, concurrency], options, _add_and_retrieve_rows
    )


def _retrieve(r: _Reader) -> ParsedCommand:
    extended = r.peek_word("EXTENDED") is not None
    concurrency = r.integer("CONCURRENCY") if r.peek_word("CONCURRENCY") else 1
    path = r.key()
    return ParsedCommand(
        "retrieve", [path], {"concurrency": concurrency, "extended": extended}, _retrieve_rows
    )


def _ack(r: _Reader) -> ParsedCommand:
    key = r.key()
    result = r.nullable_string("result")
    return ParsedCommand("ack", [key, result], {}, lambda a: [{"success": _bool(a.success)}])


def _result(r: _Reader) -> ParsedCommand:
    kwargs: dict[str, Any] = {}
    if r.peek_word("EXTERNAL_ID"):
        kwargs["external_id"] = r.string("EXTERNAL_ID")
    return ParsedCommand("result", [r.key()], kwargs, _result_rows)


def _result_blocking(r: _Reader) -> ParsedCommand:
    timeout = r.integer("timeout")
    return ParsedCommand("result_blocking", [r.key(), timeout], {}, _result_rows)


def _keyed(method: str, rows: Callable[[Any], list[Row]]) -> Callable[[_Reader], ParsedCommand]:
    return lambda r: ParsedCommand(method, [r.key()], {}, rows)


def _merge_extra(r: _Reader) -> ParsedCommand:
    key = r.key()
    return ParsedCommand("merge_extra", [key, r.string("extra")], {}, lambda a: [])


def _listing(method: str) -> Callable[[_Reader], ParsedCommand]:
    def parse_listing(r: _Reader) -> ParsedCommand:
        with_payload = r.peek_word("WITH_PAYLOAD") is not None
        prefix = r.string("prefix")
        return ParsedCommand(
            method,
            [prefix],
            {"with_payload": with_payload},
            lambda rows: [_list_row(row, with_payload) for row in rows],
        )

    return parse_listing


def _to_cancel(r: _Reader) -> ParsedCommand:
    heartbeat, orphaned = r.integer("heartbeat timeout"), r.integer("orphaned timeout")
    return ParsedCommand("to_cancel", [heartbeat, orphaned, r.string("prefix")], {}, _id_rows)


def _stalled(r: _Reader) -> ParsedCommand:
    heartbeat = r.integer("heartbeat timeout")
    return ParsedCommand("to_cancel", [heartbeat, None, r.string("prefix")], {}, _id_rows)


def _orphaned(r: _Reader) -> ParsedCommand:
    orphaned = r.integer("orphaned timeout")
    return ParsedCommand("to_cancel", [None, orphaned, r.string("prefix")], {}, _id_rows)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _str(value: int | None) -> str | None:
    return None if value is None else str(value)


def _add_row(a: AddToQueueResponse) -> Row:
    return {"id": str(a.id), "added": _bool(a.added), "pending": str(a.pending)}


def _add_and_retrieve_rows(a: AddAndRetrieveResponse) -> list[Row]:
    return [
        {
            "id": str(a.id),
            "added": _bool(a.added),
            "pending": str(a.pending),
            "active": a.active,
            "payload": a.payload,
            "extra": a.extra,
        }
    ]


def _retrieve_rows(a: RetrieveResponse | None) -> list[Row]:
    if a is None:
        return []
    return [
        {
            "payload": a.payload,
            "extra": a.extra,
            "pending": str(a.pending),
            "active": a.active,
            "id": _str(a.id),
        }
    ]


def _result_rows(a: ResultResponse | None) -> list[Row]:
    if a is None:
        return []
    return [
        {
            "payload": a.payload,
            "type": str(a.type.value),
            "id": str(a.id),
            "external_id": a.external_id,
        }
    ]


def _def_rows(a: QueryDefResponse | None) -> list[Row]:
    return [] if a is None else [{"payload": a.payload, "extra": a.extra}]


def _list_row(row: ListResponse, with_payload: bool) -> Row:
    out: Row = {
        "id": row.id,
        "queue_id": str(row.queue_id),
        "status": row.status,
        "extra": row.extra,
    }
    if with_payload:
        out["payload"] = row.payload
    return out


def _id_rows(rows: list[ToCancelResponse]) -> list[Row]:
    return [{"id": row.id, "queue_id": str(row.queue_id)} for row in rows]


_PARSERS: dict[str, Callable[[_Reader], ParsedCommand]] = {
    "ADD": _add,
    "ADD_AND_RETRIEVE": _add_and_retrieve,
    "RETRIEVE": _retrieve,
    "ACK": _ack,
    "RESULT": _result,
    "RESULT_BLOCKING": _result_blocking,
    "GET": _keyed("get", _def_rows),
    "CANCEL": _keyed("cancel", _def_rows),
    "HEARTBEAT": _keyed("heartbeat", lambda a: []),
    "MERGE_EXTRA": _merge_extra,
    "LIST": _listing("list_items"),
    "PENDING": _listing("pending"),
    "ACTIVE": _listing("active"),
    "TO_CANCEL": _to_cancel,
    "STALLED": _stalled,
    "ORPHANED": _orphaned,
    "TRUNCATE": lambda r: ParsedCommand("truncate", [], {}, lambda a: []),
}
