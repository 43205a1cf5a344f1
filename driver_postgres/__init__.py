"""The queue store on PostgreSQL: one queue shared by the supervisors of several hosts.

Needs psycopg 3 (`pip install -e '.[postgres]'`); imported only when a postgresql:// store
is asked for, so the SQLite default needs nothing more."""

from driver_postgres.store import PostgresQueueStore

__all__ = ["PostgresQueueStore"]
