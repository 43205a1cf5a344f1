"""Responses of the QUEUE commands, shaped exactly like Cube Store's TypeScript types.

Field names and meanings follow Cube Store's responses.
`QueueId` is an int; JSON text travels as `str` and is never decoded by the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

QueueId = int
# Items are addressed by path (`prefix:queryKeyHash`) or by their integer queue id.
QueueKey = str | int
ItemStatus = Literal["pending", "active"]


class ResultStatus(StrEnum):
    SUCCESS = "success"


@dataclass(frozen=True, slots=True)
class AddToQueueResponse:
    """QUEUE ADD."""

    id: QueueId
    added: bool  # False when the path was already in the queue; `id` is then the existing item's
    pending: int  # pending items of the prefix after the operation


@dataclass(frozen=True, slots=True)
class AddAndRetrieveResponse:
    """QUEUE ADD_AND_RETRIEVE: an AddToQueueResponse plus the retrieval."""

    id: QueueId
    added: bool
    pending: int
    active: str | None  # comma separated keys of the prefix's active items, None when empty
    payload: str | None  # None means "the item was not retrieved"
    extra: str | None
    # Our extension: a supervisor asked to (`dispatch`) has handed the retrieved item to
    # its worker pool itself, so the caller has nothing to hand off.
    dispatched: bool = False

    @property
    def fast_tracked(self) -> bool:
        """It retrieved the item it added: handed back, or (no payload) to the pool."""
        return self.payload is not None or self.dispatched


@dataclass(frozen=True, slots=True)
class NextRetrieved:
    """One item `retrieve_next` moved to active: its key and queue id, its payload and its
    extra as they were before the retrieving write, the prefix's pending count after it."""

    key: str
    id: QueueId
    payload: str
    extra: str | None
    pending: int


@dataclass(frozen=True, slots=True)
class RetrieveResponse:
    """QUEUE RETRIEVE EXTENDED. A failed retrieval has `payload` and `id` set to None."""

    payload: str | None
    extra: str | None
    pending: int
    active: str | None
    id: QueueId | None


@dataclass(frozen=True, slots=True)
class ListResponse:
    """QUEUE LIST / PENDING / ACTIVE. `id` is the item's key within its prefix, not its QueueId."""

    id: str
    queue_id: QueueId
    status: ItemStatus
    extra: str | None
    payload: str | None = None  # only with WITH_PAYLOAD


@dataclass(frozen=True, slots=True)
class ToCancelResponse:
    """QUEUE TO_CANCEL / STALLED / ORPHANED."""

    id: str
    queue_id: QueueId


@dataclass(frozen=True, slots=True)
class QueryDefResponse:
    """QUEUE GET / CANCEL."""

    payload: str
    extra: str | None


@dataclass(frozen=True, slots=True)
class AckResponse:
    """QUEUE ACK."""

    success: bool


@dataclass(frozen=True, slots=True)
class ResultResponse:
    """QUEUE RESULT / RESULT_BLOCKING. `payload` is None when the item was acked with NULL."""

    payload: str | None
    type: ResultStatus
    id: QueueId
    external_id: str | None
    # Our extension: a binary result still in shared memory, which its reader copies or
    # views (`await read(view=...)`: the decoded outcome, a view's
    # lease in "$lease"); `payload` is then its reference. Set by the socket client only.
    shared: Any = None
