"""A request as the supervisor's core sees it: parsed, checked, and ordered in a batch.

Plain data and pure functions (no asyncio, sockets or clock): what a client asked, the
shape its arguments must have, and the orderings a batch keeps (a worker's ACK before the
commands its freed slot serves, an ADD's pipelined long poll with its ADD).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from queryqueue.engine.commands import Command, served
from queryqueue.engine.errors import (
    InvalidCommandError,
    QueueError,
    UnknownHandlerError,
    UnknownQueueError,
)
from queryqueue.engine.responses import AddAndRetrieveResponse, QueueId
from queryqueue.supervisor.core import sqltext

# The QUEUE commands a client may call, as the store declares them.
COMMANDS = served()
# How many argument shapes found fine a command keeps (`Shape.fine`).
SHAPES_KEPT = 64
# A stream query's handler: it runs in the process that asked for it (`check_served`).
STREAM = "stream"
# The commands whose concurrency is the pool's budget for its own queue (`apply_budget`).
BUDGETED = frozenset({"add_and_retrieve", "retrieve"})


def acks_first(batch: list[Request]) -> list[Request]:
    """A batch on the loop with the commands of connections that sent an ACK (its workers)
    before all the others, each connection's in the order they came: the slots the ACKs
    free are filled, and their workers sent their next, before the rest runs
    (`BatchTransaction.hand_off_early`). As in `acks_last`, commands of different connections that
    arrived together have no order between them to keep."""
    acking, others = acking_apart(batch)
    if not (acking and others) or all(a is b for a, b in zip(acking, batch, strict=False)):
        return batch
    return acking + others


def acking_end(batch: list[Request]) -> int:
    """Where the leading commands of a batch's ACKing connections end (`acks_first`):
    -1 when none lead, or nothing follows them."""
    acking = {id(r.connection) for r in batch if r.method == "ack"}
    if not acking:
        return -1
    for i, request in enumerate(batch):
        if id(request.connection) not in acking:
            return i if i else -1
    return -1


def acked_ids(batch: list[Request], answers: list[tuple[bool, Any]]) -> list[QueueId]:
    """The queue ids of a batch's answered ACKs (read on a lane too: nothing of the
    pool's, which is the loop's)."""
    return [
        request.args[0]
        for request, (ok, _) in zip(batch, answers, strict=True)
        if ok and request.method == "ack" and type(request.args[0]) is int
    ]


@dataclass(frozen=True)
class Shape:
    """The arguments a store method takes: checked per request without Signature.bind,
    which cost 3% of the supervisor's time."""

    names: tuple[str, ...]  # positional-or-keyword, in order
    required: frozenset[str]
    keywords: frozenset[str]
    # Argument counts and keyword names (in the order sent) found fine: a client sends
    # the same few shapes again and again. Bounded: a client cannot grow it for long.
    fine: set[tuple[int, tuple[str, ...]]] = field(default_factory=set, compare=False)

    @classmethod
    def of(cls, method: Callable[..., Any]) -> Shape:
        params = list(inspect.signature(method).parameters.values())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(
            names=tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD),
            required=frozenset(p.name for p in named if p.default is p.empty),
            keywords=frozenset(p.name for p in named),
        )

    def check(self, args: list[Any], kwargs: dict[str, Any]) -> str | None:
        sent = (len(args), tuple(kwargs))
        if sent in self.fine:
            return None
        problem = self._problem(args, kwargs)
        if problem is None and len(self.fine) < SHAPES_KEPT:
            self.fine.add(sent)
        return problem

    def _problem(self, args: list[Any], kwargs: dict[str, Any]) -> str | None:
        if len(args) > len(self.names):
            return f"takes at most {len(self.names)} positional arguments, got {len(args)}"
        unknown = kwargs.keys() - self.keywords
        if unknown:
            return f"unexpected keyword argument {sorted(unknown)[0]!r}"
        by_position = self.names[: len(args)]
        twice = set(by_position) & kwargs.keys()
        if twice:
            return f"multiple values for argument {sorted(twice)[0]!r}"
        missing = self.required - set(by_position) - kwargs.keys()
        if missing:
            return f"missing required argument {sorted(missing)[0]!r}"
        return None


@dataclass(eq=False)
class Request:
    connection: Any  # the shell's: answered through, never read here (but for its id)
    id: Any
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    rows: Callable[[Any], list[sqltext.Row]] | None  # set for SQL text: answer as rows
    received: float
    refused: QueueError | None = None  # refused before it reached the store
    dispatch: bool = False  # ADD_AND_RETRIEVE: hand what it retrieves to the pool
    # An ADD sent with the RESULT_BLOCKING that follows it (its request id, its timeout):
    # the long poll waits on the id the ADD answers.
    then_wait: tuple[int, int] | None = None
    follows: Request | None = None  # that long poll: the ADD it follows
    added_id: int | None = None  # the ADD's answered id, once it ran
    started_ms: int | None = None  # the fast track: startQueryTime, recorded in its batch
    checked: bool = False  # by `Runner.take_batch`, once
    pool_step: bool = False  # a worker's step of a pool job (`Runner.note_acks`): not held


def moves_pool(command: Command | None, full: bool) -> bool:
    """Whether a command, done, may give the pool something to retrieve: it frees a slot,
    or adds work while the pool has one (an ADD alone changes nothing while the pool
    holds its budget, `WorkerPool.full`)."""
    return command is not None and (command.frees_slot or (command.adds and not full))


def ends_or_waits(request: Request) -> bool:
    """A command by queue id that a worker's ACK comes after: the ACK itself, or one it
    waits for the answer of before it ACKs (the cancel handler's extra). Not a
    heartbeat: a worker beats on its own, and ACKs without waiting for the beat."""
    return request.method != "heartbeat" and bool(request.args) and isinstance(request.args[0], int)


def coming(*queued: Iterable[Request]) -> set[QueueId]:
    """The queue ids whose worker's ACK is among `queued`, or comes after a command there
    that the worker waits for (`ends_or_waits`): a linger does not wait for those."""
    return {r.args[0] for requests in queued for r in requests if ends_or_waits(r)}


def acks_last(batch: list[Request]) -> list[Request]:
    """A lane's batch with the commands of connections that sent an ACK after all the
    others, each connection's in the order they came. ACKs by queue id have their items
    read ahead with the batch's lock (`expect`), while an ADD reads as it runs: run first,
    the ADD's read waits for the ACKs' reads too (one round trip where ACK-then-ADD took
    two). Commands of different connections that arrived together have no order between
    them (they could as well have been read from their sockets the other way round)."""
    acking, others = acking_apart(batch)
    return others + acking if acking and others else batch


def acking_apart(batch: list[Request]) -> tuple[list[Request], list[Request]]:
    """(The commands of the connections that sent an ACK in `batch`, the others), each
    in the order they came."""
    acking = {id(r.connection) for r in batch if r.method == "ack"}
    if not acking:
        return [], batch
    return [r for r in batch if id(r.connection) in acking], [
        r for r in batch if id(r.connection) not in acking
    ]


def then_wait_of(value: Any) -> tuple[int, int] | None:
    """ADD's `then_wait`: [the request id of the RESULT_BLOCKING to run next, its timeout]."""
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or value[1] < 0
    ):
        raise InvalidCommandError(
            "then_wait: takes [a request id, a timeout in ms >= 0] for the RESULT_BLOCKING "
            "of the id the ADD answers"
        )
    return value[0], value[1]


def follow_up(add: Request) -> Request:
    """The RESULT_BLOCKING sent with `add` (`then_wait`): its key is the id the ADD
    answers, filled in by `follow_key` once the ADD has run."""
    assert add.then_wait is not None
    wait_id, timeout_ms = add.then_wait
    return Request(
        add.connection, wait_id, "result_blocking", [None, timeout_ms], {}, None, add.received,
        follows=add,
    )  # fmt: skip


def follow_key(request: Request) -> None:
    add = request.follows
    if add is None:
        return
    if add.added_id is None:
        raise InvalidCommandError("result_blocking: the ADD it follows failed")
    request.args[0] = add.added_id


def poll_args(request: Request) -> tuple[Any, int]:
    """RESULT_BLOCKING's key and timeout, however the client passed them (checked by the
    store when the request first ran)."""
    args, kwargs = request.args, request.kwargs
    key = args[0] if args else kwargs["key"]
    timeout_ms = args[1] if len(args) > 1 else kwargs["timeout_ms"]
    return key, int(timeout_ms)


def apply_budget(
    budgets: Mapping[str, int] | None, method: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    """A queue this supervisor's pools run (`budgets`: prefix -> concurrency) has its
    pool's concurrency, whatever the client's code says: a caller's own QueueApp cannot
    raise its budget."""
    key = args[0] if args else kwargs.get("key", kwargs.get("path"))
    if not budgets or not isinstance(key, str):
        return
    budget = budgets.get(key.rpartition(":")[0])
    if budget is None:
        return
    if method == "add_and_retrieve" and len(args) >= 3:
        args[2] = budget
    else:
        kwargs["concurrency"] = budget


def fast_tracked_answer(answer: AddAndRetrieveResponse) -> AddAndRetrieveResponse:
    # Without the retrieved query: the caller sent it and the pool runs the store's
    # copy, so echoing it (a query's SQL can be kilobytes) would cost every fast-tracked
    # query a copy on the wire and a parse in the caller for nothing. Built, not
    # dataclasses.replace: that walks the fields on every fast-tracked query.
    return AddAndRetrieveResponse(
        answer.id, answer.added, answer.pending, answer.active, None, None, True
    )


@dataclass(frozen=True)
class Message:
    """A request frame read: a QUEUE command (`cmd` with its arguments, or SQL text) or
    one of the server's own commands."""

    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    rows: Callable[[Any], list[sqltext.Row]] | None  # SQL text: answered as rows

    @property
    def queued(self) -> bool:
        """A QUEUE command, run in a batch (not one of the server's own)."""
        return self.method in COMMANDS


def read_message(message: dict[str, Any]) -> Message:
    if "sql" in message:
        parsed = sqltext.parse(message["sql"])
        return Message(parsed.method, parsed.args, parsed.kwargs, parsed.rows)
    cmd = message.get("cmd")
    args = message.get("args", [])
    kwargs = message.get("kwargs", {})
    if not isinstance(cmd, str):
        raise InvalidCommandError("a request needs a 'cmd' (or 'sql') string")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidCommandError(f"{cmd}: 'args' must be a list and 'kwargs' an object")
    return Message(cmd, args, kwargs, None)


def check_served(
    method: str, args: list[Any], kwargs: dict[str, Any], served: Mapping[str, Collection[str]]
) -> None:
    """A query (an ADD whose payload names its handler, as every QueryQueue sends) for a
    queue no pool here serves, or for a handler its app lacks, is refused at once: it
    would wait for a worker that never comes. Other ADDs are the store's (Cube's protocol);
    a stream query runs in the process that asked for it, whatever the app has."""
    path = args[0] if args else kwargs.get("path")
    payload = args[1] if len(args) > 1 else kwargs.get("payload")
    if not isinstance(path, str) or not isinstance(payload, str) or "queryHandler" not in payload:
        return
    try:
        name = orjson.loads(payload).get("queryHandler")
    except (orjson.JSONDecodeError, AttributeError):
        return  # not a query definition: the store's concern
    if not isinstance(name, str) or name == STREAM:
        return
    prefix = path.rpartition(":")[0]
    handlers = served.get(prefix)
    if handlers is None:
        names = ", ".join(repr(name) for name in sorted(served)) or "none yet"
        raise UnknownQueueError(
            f"{method}: no queue {prefix!r} is served by this supervisor (its pool runs"
            f" {names}): check the caller's queue name and socket"
        )
    if name not in handlers:
        raise UnknownHandlerError(
            f"{method}: queue {prefix!r} has no handler {name!r} (it has"
            f" {', '.join(repr(h) for h in sorted(handlers)) or 'none'})"
        )


class Shapes:
    """The argument shapes of a store's commands, learned from its methods once each."""

    def __init__(self, store: object) -> None:
        self._store = store
        self._shapes: dict[str, Shape] = {}

    def check(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        shape = self._shapes.get(method)
        if shape is None:
            shape = self._shapes[method] = Shape.of(getattr(self._store, method))
        problem = shape.check(args, kwargs)
        if problem is not None:
            raise InvalidCommandError(f"{method}: wrong arguments ({problem})")


def make_request(
    connection: Any,
    request_id: Any,
    message: Message,
    received: float,
    *,
    shapes: Shapes,
    process_id: str | None,
    budgets: Mapping[str, int] | None = None,
    served: Mapping[str, Collection[str]] | None = None,
) -> Request:
    """A QUEUE command as a batch runs it: the server's options taken out of its keyword
    arguments (`dispatch`, `then_wait`), the connection's process id filled in, the pool's
    budgets set for the pools' own queues (`budgets`: prefix -> concurrency), its arguments
    checked.
    `served`: the queues this supervisor's pools run (prefix -> handler names; None: it
    has no pool, and takes any queue, as Cube Store does)."""
    method, args, kwargs = message.method, message.args, message.kwargs
    if served is not None and COMMANDS[method].adds:
        check_served(method, args, kwargs, served)
    dispatch = method == "add_and_retrieve" and kwargs.pop("dispatch", False) is True
    if method in BUDGETED:
        apply_budget(budgets, method, args, kwargs)
    then_wait = then_wait_of(kwargs.pop("then_wait", None)) if COMMANDS[method].adds else None
    if COMMANDS[method].take_process_id and "process_id" not in kwargs:
        kwargs["process_id"] = process_id
    shapes.check(method, args, kwargs)
    return Request(
        connection, request_id, method, args, kwargs, message.rows, received,
        dispatch=dispatch, then_wait=then_wait,
    )  # fmt: skip
