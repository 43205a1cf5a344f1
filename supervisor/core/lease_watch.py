"""When a host whose lease it cannot renew stops its own queries (decide here, act in
`supervisor/lease.py`).

Hosts sharing a queue on PostgreSQL hold a lease on the items they run (their row in
`hosts`, renewed every tenth of `--pg-host-timeout`); another host reaps the items of a
host whose lease ran out, and runs them again. A host cut off from the database cannot
tell whether it is the one that is dead to the others, so once it has failed to renew for
half its lease it stops the queries it runs (fences them) before anyone may take them
over: a query never runs on two hosts at once. What it stopped runs again, once the
database answers: here, given back, or on the host that reaped it. A query whose stall
timeout (four heartbeats) is shorter than the lease may be reaped sooner, by that: then
the shorter of the two is the window the host has. A host that was the only one at its
last renewal has nobody to reap its queries, and rides out any outage with them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The share of the lease a host goes without renewing before it stops its queries: the
# other half is the margin before another host may reap them (its renewals come every
# tenth of the lease, so the last one was at most that long before the outage).
FENCE_AFTER = 0.5


@dataclass
class LeaseWatch:
    """A host's lease as its renewals go: `timeout` seconds, last renewed at `renewed_at`
    (monotonic seconds), and whether its queries are fenced now."""

    timeout: float
    renewed_at: float
    fenced: bool = False
    others: int = -1  # other hosts whose leases held at the last renewal (-1: unknown)

    def renewed(self, now: float, others: int) -> bool:
        """A renewal succeeded at `now`, `others` hosts' leases holding then. True: the
        host had fenced its queries, and may take work again."""
        self.renewed_at, was = now, self.fenced
        self.fenced, self.others = False, others
        return was

    def failed(self, now: float, window: float | None = None) -> bool:
        """A renewal failed at `now`. True, once an outage: fence the queries now.
        `window`: how long after the last renewal another host may reap them, where
        shorter than the lease (their stall timeout)."""
        reaped_after = self.timeout if window is None else min(window, self.timeout)
        alone = self.others == 0  # nobody to reap its queries
        if self.fenced or alone or now - self.renewed_at < reaped_after * FENCE_AFTER:
            return False
        self.fenced = True
        return True
