"""Which of a pipelined batch's ADDs may have their reads sent with its first statements.

An ADD reads what its path holds (the item, its external id's owner, an unread result)
and takes its id if it will insert (`_ID_IF_INSERTED`). Sent as the ADD runs, each ADD of
a batch waits a round trip of its own for them; sent with the batch's first statements
(after its prefix lock, with its ACKs' items and its pool's head), the batch waits once
for all of them. They are then read before any of the batch's commands ran, so they are
what the ADD would read in its turn only when nothing run before it could have changed
them: the commands before it are ADDs of other paths and other external ids (an ADD
changes its own path's rows, and takes its external id everywhere), their own long
polls, and commands by path of other paths (an ACK or a CANCEL also frees the external
id of the item it removes: no ADD naming one is read ahead after it). The first command
by queue id, or any other (a RETRIEVE_NEXT activates items of any path), ends the ADDs
read ahead: a supervisor's batch puts its workers' ACKs last (`acks_last`), so its ADDs
come before them. So does the first ADD that may insert but is not read ahead (its
path's or external id's rows changed before it, or another prefix's): the ids read ahead
are taken in the order of the batch, and one taken in its turn after them would put its
item behind later ones.

Decide here (pure), act in the store (`PostgresQueueStore.expect`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from queryqueue.engine import validation as v
from queryqueue.engine.errors import InvalidCommandError
from queryqueue.engine.records import new_item

# An ADD's positional arguments (ADD_AND_RETRIEVE's concurrency third) and its keywords.
_ADDS = {"add": 2, "add_and_retrieve": 3}
ADD_KEYWORDS = frozenset(
    {"priority", "orphaned", "external_id", "exclusive", "process_id", "if_no_result", "max_age_ms"}
)
ADD_AND_RETRIEVE_KEYWORDS = ADD_KEYWORDS | {"start_query_time", "list_active"}
# Commands whose key, a path, is the only path whose rows they read or change; those
# that remove its item free its external id too.
_BY_PATH = frozenset(
    {"retrieve", "ack", "cancel", "result", "result_blocking", "get", "heartbeat", "merge_extra"}
)
_REMOVING = frozenset({"ack", "cancel"})


@dataclass(frozen=True, slots=True)
class AddAhead:
    """An ADD whose reads go with the batch's first statements."""

    prefix: str
    key: str
    external_id: str | None
    if_no_result: bool
    max_age_ms: int | None = None

    @property
    def path(self) -> str:
        return f"{self.prefix}:{self.key}"


def adds_read_ahead(commands: Iterable[Sequence[Any]], prefix: str) -> list[AddAhead]:
    """The ADDs of `commands` (name, positional arguments, keywords; in the batch's
    order; the batch holds `prefix`'s lock) whose reads, made before any of them runs,
    are what they would read in their turn. An ADD told without its keywords (name and
    arguments only) may name any external id: it ends them. An ADD whose arguments are
    bad is not read for: it fails before it reads, and the id read ahead for it would be
    a gap in the ids."""
    found: list[AddAhead] = []
    paths: set[str] = set()
    external_ids: set[str] = set()
    freed = False  # an external id may have been freed by then
    for command in commands:
        method, args = command[0], command[1]
        key = args[0] if args else None
        if method in _ADDS:
            if len(command) < 3 or not isinstance(key, str):
                break
            kwargs = command[2]
            external_id = kwargs.get("external_id")
            if external_id is not None and not isinstance(external_id, str):
                break
            ahead = _ahead(method, args, kwargs)
            if ahead is not None:  # else refused before it reads or inserts
                if (
                    key in paths
                    or external_id in external_ids
                    or (freed and external_id is not None)
                    or ahead.prefix != prefix
                ):
                    break
                found.append(ahead)
            paths.add(key)
            if external_id is not None:
                external_ids.add(external_id)
        elif method == "result_blocking" and key is None:
            continue  # an ADD's own long poll (`then_wait`): its ADD's path, seen already
        elif method in _BY_PATH and isinstance(key, str):
            paths.add(key)
            freed = freed or method in _REMOVING
        else:
            break
    return found


def _ahead(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> AddAhead | None:
    """The ADD's reads, if its arguments are those of a command that will read them."""
    keywords = ADD_KEYWORDS if method == "add" else ADD_AND_RETRIEVE_KEYWORDS
    if len(args) != _ADDS[method] or not kwargs.keys() <= keywords:
        return None  # refused by its call, before it reads
    try:
        if method == "add_and_retrieve":
            v.check_concurrency(args[2])
            v.check_non_negative_ms(
                "start_query_time", kwargs.get("start_query_time"), nullable=True
            )
        max_age_ms = v.check_non_negative_ms("max_age_ms", kwargs.get("max_age_ms"), nullable=True)
        item = new_item(
            args[0],
            args[1],
            kwargs.get("priority", 0),
            kwargs.get("orphaned"),
            kwargs.get("external_id"),
            kwargs.get("exclusive", False),
            kwargs.get("process_id"),
            0,
        )
    except InvalidCommandError:
        return None
    # As the command reads it: any true value asks for an unread result.
    return AddAhead(
        item.prefix, item.key, item.external_id, bool(kwargs.get("if_no_result")), max_age_ms
    )
