"""RetrievedQuery: what `process_query` hands to `send_process_message_fn`.

Plain, picklable data on purpose: a custom hand-off may serialize it and let another
process run `execute_query`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from queryqueue.engine.responses import QueueId


@dataclass(frozen=True, slots=True)
class RetrievedQuery:
    query_key_hash: str
    queue_id: QueueId
    processing_id: QueueId  # the queue id: one retrieval per item generation, no separate locks
    queue_size: int
    query: dict[str, Any]  # the query definition: payload merged with extra
    # The retriever recorded startQueryTime (ms) in the transaction that retrieved it, as
    # Cube's processQuery does right after RETRIEVE: the executor need not send it again.
    started_ms: int | None = None

    @property
    def persistent(self) -> bool:
        """Stream queries carry `@<processUid>` and must run in the process that retrieved them."""
        return "@" in self.query_key_hash
