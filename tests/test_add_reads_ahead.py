"""Which ADDs of a PostgreSQL batch have their reads sent with its first statements
(driver_postgres/ahead.py): only those whose reads nothing run before them can change,
and none after an ADD that reads and takes its id in its own turn."""

from __future__ import annotations

import inspect
from typing import Any

from queryqueue.driver_postgres.ahead import (
    ADD_AND_RETRIEVE_KEYWORDS,
    ADD_KEYWORDS,
    adds_read_ahead,
)
from queryqueue.engine.store import QueueStore


def _paths(commands: list[tuple[Any, ...]], prefix: str = "p") -> list[str]:
    return [add.path for add in adds_read_ahead(commands, prefix)]


def test_adds_of_other_paths_and_their_long_polls_are_read_ahead_up_to_the_acks() -> None:
    commands = [
        ("add", ("p:a", "{}"), {"if_no_result": True, "max_age_ms": 5000}),
        ("result_blocking", [None, 1000], {}),  # the ADD's own long poll
        ("add_and_retrieve", ("p:b", "{}", 2), {"external_id": "e1", "priority": 10}),
        ("add", ("p:c", "{}"), {"external_id": "e2"}),
        ("ack", (7, '"r"'), {}),  # a worker's ACK by id: what comes after it is not
        ("add", ("p:d", "{}"), {}),
    ]
    assert _paths(commands) == ["p:a", "p:b", "p:c"]
    [first, second, _] = adds_read_ahead(commands, "p")
    assert (first.if_no_result, first.max_age_ms, first.external_id) == (True, 5000, None)
    assert (second.if_no_result, second.max_age_ms, second.external_id) == (False, None, "e1")


def test_an_add_whose_rows_changed_before_it_ends_the_adds_read_ahead() -> None:
    add: Any = "add"
    cases: list[tuple[list[tuple[Any, ...]], list[str]]] = [
        # The same path, or the same external id, added before it.
        ([(add, ("p:a", "{}"), {}), (add, ("p:a", "{}"), {}), (add, ("p:z", "{}"), {})], ["p:a"]),
        (
            [
                (add, ("p:a", "{}"), {"external_id": "e"}),
                (add, ("p:b", "{}"), {"external_id": "e"}),
            ],
            ["p:a"],
        ),
        # Its path's result read (consumed) or its item retrieved by path before it.
        ([("result", ("p:b",), {}), (add, ("p:a", "{}"), {}), (add, ("p:b", "{}"), {})], ["p:a"]),
        ([("retrieve", ("p:b",), {}), (add, ("p:b", "{}"), {}), (add, ("p:c", "{}"), {})], []),
        # An item removed by path frees an external id: no ADD naming one after it.
        (
            [
                ("ack", ("p:x", None), {}),
                (add, ("p:a", "{}"), {}),
                (add, ("p:b", "{}"), {"external_id": "e"}),
            ],
            ["p:a"],
        ),
        # Another prefix's ADD takes its id in its turn.
        ([(add, ("p:a", "{}"), {}), (add, ("q:a", "{}"), {}), (add, ("p:b", "{}"), {})], ["p:a"]),
        # Told without its keywords, an ADD may name any external id.
        ([(add, ("p:a", "{}"), {}), (add, ("p:b", "{}")), (add, ("p:c", "{}"), {})], ["p:a"]),
        # A command of any path, or of none.
        (
            [(add, ("p:a", "{}"), {}), ("retrieve_next", ("p",), {}), (add, ("p:b", "{}"), {})],
            ["p:a"],
        ),
        ([("cancel", (3,), {}), (add, ("p:a", "{}"), {})], []),
    ]
    for commands, read_ahead in cases:
        assert _paths(commands) == read_ahead, commands


def test_an_add_refused_for_its_arguments_is_not_read_for() -> None:
    """It fails before it reads or inserts, so those after it still are."""
    commands: list[tuple[Any, ...]] = [
        ("add", ("p:a", "{not json"), {}),
        ("add", ("p:b", "{}"), {"exclusive": True}),  # no process id
        ("add", ("p:c", "{}"), {"priority": "high"}),
        ("add", ("p:d", "{}"), {"unknown": 1}),
        ("add_and_retrieve", ("p:e", "{}", 0), {}),  # concurrency 0
        ("add", ("nocolon", "{}"), {}),
        ("add", ("p:f", "{}"), {"orphaned": 5, "exclusive": True, "process_id": "w1"}),
    ]
    assert _paths(commands) == ["p:f"]


def test_the_reads_ahead_know_every_keyword_an_add_takes() -> None:
    """An ADD with a keyword the list does not know is not read ahead: the list must be
    the command's own, or an ADD with one of its keywords would never be."""
    for method, known in (
        (QueueStore.add, ADD_KEYWORDS),
        (QueueStore.add_and_retrieve, ADD_AND_RETRIEVE_KEYWORDS),
    ):
        keywords = {
            name
            for name, parameter in inspect.signature(method).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        }
        assert keywords == known, method.__name__
