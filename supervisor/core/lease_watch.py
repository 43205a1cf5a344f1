"""When a host whose lease it cannot renew stops its own queries (decide here, act in
`supervisor/lease.py`).

Hosts sharing a queue on PostgreSQL hold a lease on the items they run (their row in
`hosts`, renewed every tenth of `--pg-host-timeout`); another host reaps the items of a
host whose lease ran out, and runs them again. A host cut off from the database cannot
tell whether it is the one that is dead to the others, so once it has failed to renew for
half its lease it stops the queries it runs (fences them) before anyone may take them
over: a query never runs on two hosts at once. What it stopped runs again, once the
database answers: here, given back, or on the host that reaped it.
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

    def renewed(self, now: float) -> bool:
        """A renewal succeeded at `now`. True: the host had fenced its queries, and may
        take work again."""
        self.renewed_at, was = now, self.fenced
        self.fenced = False
        return was

    def failed(self, now: float) -> bool:
        """A renewal failed at `now`. True, once an outage: fence the queries now."""
        if self.fenced or now - self.renewed_at < self.timeout * FENCE_AFTER:
            return False
        self.fenced = True
        return True
