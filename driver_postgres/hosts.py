"""Hosts sharing a queue: each supervisor's lease on the items it runs.

Every item a supervisor's store activates names that store (`items.owner`: its origin),
and the supervisor renews the store's row in `hosts` every tenth of the lease
(`HostLease.beat`). An active item whose owner's row is older than the lease's timeout
belongs to a host that died, or lost the database: any other host's reconcile reaps it
as stalled then, within seconds, whatever the items' own heartbeat interval (whose
timeout is minutes).
A host never reaps its own items for its lease (it knows which of them live), and when
its connection comes back it refreshes the heartbeats of its own items only: another
host's, dead meanwhile, still go at their time. A store with no lease (a process using
the store directly) leaves `owner` empty: its items live by their heartbeats alone.

Times are each host's own clock (as the items' heartbeats are): hosts sharing a queue
keep their clocks within a fraction of the timeout of each other (NTP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A host's lease on its items lasts this long after its last beat (the supervisor's
# --pg-host-timeout): ten beats, so that a loaded host or a slow round trip never loses it,
# and a host cut off stops its queries only after half of it (lease_watch.py): an outage
# of a few seconds (a restart) is ridden out.
HOST_TIMEOUT_S = 10.0
# A row not renewed for this long is deleted by the next host's beat: its host is gone.
FORGET_HOST_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class HostLease:
    owner: str
    timeout_ms: int

    def beat(self, conn: Any, now: int) -> int:
        """Renew this host's lease; forget hosts gone for a day. The other hosts whose
        leases hold: those that could reap this host's items."""
        conn.execute(
            "INSERT INTO hosts (owner, seen) VALUES (%s, %s)"
            " ON CONFLICT (owner) DO UPDATE SET seen = EXCLUDED.seen",
            (self.owner, now),
        )
        conn.execute("DELETE FROM hosts WHERE seen < %s", (now - FORGET_HOST_MS,))
        row = conn.execute(
            "SELECT count(*) FROM hosts WHERE owner <> %s AND seen >= %s",
            (self.owner, now - self.timeout_ms),
        ).fetchone()
        return int(row[0]) if row else 0

    def leave(self, conn: Any) -> None:
        conn.execute("DELETE FROM hosts WHERE owner = %s", (self.owner,))

    def stalled_clause(self, now: int) -> tuple[str, tuple[Any, ...]]:
        """The SQL (and its parameters) of an active item whose owner's lease ran out:
        another host's, unseen for longer than the timeout."""
        return (
            "(owner IS NOT NULL AND owner <> %s AND NOT EXISTS (SELECT 1 FROM hosts h"
            " WHERE h.owner = items.owner AND h.seen >= %s))",
            (self.owner, now - self.timeout_ms),
        )


def lease_of(owner: str, host_timeout: float | None) -> HostLease | None:
    """The lease a store with `host_timeout` (seconds) holds (None: no timeout, none)."""
    if host_timeout is None:
        return None
    if not host_timeout > 0:
        raise ValueError(f"host_timeout must be positive seconds, got {host_timeout!r}")
    return HostLease(owner, round(host_timeout * 1000))


def owner_of(lease: HostLease | None) -> str | None:
    """What an item this store activates names as its owner (None: no lease)."""
    return None if lease is None else lease.owner


MIGRATION = [
    "ALTER TABLE items ADD COLUMN owner text",
    "CREATE TABLE hosts (owner text PRIMARY KEY, seen bigint NOT NULL)",
]
