"""One command table: the store declares each QUEUE command once, and the server, the
client and every store read it (issue: "adding a command means about eight edits")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from queryqueue import MemoryQueueStore, QueueStore
from queryqueue.driver_postgres.store import PostgresQueueStore
from queryqueue.driver_socket import link, protocol
from queryqueue.engine.commands import served, table
from queryqueue.supervisor.core import requests

T = TypeVar("T")


def test_every_served_command_is_a_store_method_with_a_decoder() -> None:
    commands = served()
    assert {"add", "add_and_retrieve", "retrieve", "ack", "result", "cancel", "to_cancel"} <= set(
        commands
    )
    for name in commands:
        assert callable(getattr(QueueStore, name)), name
        assert name in protocol.DECODERS, name
    assert commands == requests.COMMANDS
    assert not table()["describe"].served


def test_the_client_resends_only_what_the_table_allows() -> None:
    assert link.retry_safe("add", ["p:k", "{}"], {})  # a re-ADD joins the same item
    assert not link.retry_safe("add_and_retrieve", ["p:k", "{}", 2], {})
    assert not link.retry_safe("ack", ["p:k", "{}"], {})  # by path: it might act twice
    assert link.retry_safe("ack", [17, "{}"], {})
    assert link.retry_safe("result", ["p:k"], {"consumer": "read-1"})
    assert not link.retry_safe("truncate", [], {})


def test_the_postgres_store_overrides_one_hook_and_no_command() -> None:
    mro = PostgresQueueStore.__mro__
    own = mro[: mro.index(QueueStore)]  # the store and the bases it is made of
    overridden = {name for cls in own for name in vars(cls)} & set(table())
    assert overridden == {"result_blocking"}  # it waits on NOTIFY; the rest are the base's
    assert "_run_command" in vars(PostgresQueueStore)


def test_every_synchronous_command_runs_through_the_stores_hook() -> None:
    ran: list[str] = []

    class Counting(MemoryQueueStore):
        def _run_command(self, run: Callable[[], T]) -> T:
            ran.append("command")
            return run()

    store = Counting()
    added = store.add("p:k", "{}")
    store.retrieve(added.id, concurrency=1)
    store.ack(added.id, '{"ok": 1}')
    store.list_items("p")
    assert len(ran) == 4
    described: Any = store.describe()
    assert described["prefixes"] == [] and len(ran) == 5
