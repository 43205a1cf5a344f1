"""Cube Store SQL text: parsed as Cube's driver formats it, answered in Cube Store's rows."""

from __future__ import annotations

import pytest

from queryqueue import InvalidCommandError, MemoryQueueStore
from queryqueue.engine.clock import ManualClock
from queryqueue.supervisor.core import sqltext


def run(store: MemoryQueueStore, text: str, process_id: str | None = None) -> list[sqltext.Row]:
    parsed = sqltext.parse(text)
    if process_id is not None:
        parsed.kwargs["process_id"] = process_id  # what the server does for a connection's id
    answer = getattr(store, parsed.method)(*parsed.args, **parsed.kwargs)
    return parsed.rows(answer)


@pytest.fixture
def store() -> MemoryQueueStore:
    return MemoryQueueStore(clock=ManualClock())


def test_mysql_string_literals_are_unescaped() -> None:
    parsed = sqltext.parse(r"""QUEUE ADD PRIORITY 1 'p:k' '{\"a\":\"it\'s \\ \n\0\Z\"}'""")
    assert parsed.args == ["p:k", '{"a":"it\'s \\ \n\0\x1a"}']
    doubled = sqltext.parse("queue get 'it''s:k'")
    assert doubled.method == "get" and doubled.args == ["it's:k"]
    assert sqltext.parse('QUEUE GET "p:k";').args == ["p:k"]


def test_cube_fast_track_command_round_trip(store: MemoryQueueStore) -> None:
    rows = run(
        store,
        r"""QUEUE ADD_AND_RETRIEVE PRIORITY 10 'a1#sql:649e' '{\"queryHandler\":\"foo\",\"priority\":10}' 2""",
    )
    assert rows == [
        {
            "id": "1",
            "added": "true",
            "pending": "0",
            "active": "649e",
            "payload": '{"queryHandler":"foo","priority":10}',
            "extra": None,
        }
    ]


def test_every_command_answers_cube_store_rows(store: MemoryQueueStore) -> None:
    assert run(
        store, "QUEUE ADD EXCLUSIVE PRIORITY -5 ORPHANED 60 EXTERNAL_ID 'req' 'p:a' '{}'", "p1"
    ) == [{"id": "1", "added": "true", "pending": "1"}]
    assert run(store, "QUEUE ADD PRIORITY 0 'p:b' '[1]'") == [
        {"id": "2", "added": "true", "pending": "2"}
    ]
    assert run(store, "QUEUE RETRIEVE EXTENDED CONCURRENCY 2 'p:b'") == [
        {"payload": "[1]", "extra": None, "pending": "1", "active": "b", "id": "2"}
    ]
    assert run(store, "QUEUE RETRIEVE CONCURRENCY 1 'p:zz'") == []
    assert run(store, "QUEUE RETRIEVE EXTENDED CONCURRENCY 1 'p:zz'") == [
        {"payload": None, "extra": None, "pending": "1", "active": "b", "id": None}
    ]
    assert run(store, "QUEUE HEARTBEAT 2") == []
    assert run(store, """QUEUE MERGE_EXTRA 2 '{"n":1}'""") == []
    assert run(store, "QUEUE LIST 'p'") == [
        {"id": "b", "queue_id": "2", "status": "active", "extra": '{"n":1}'}
    ]
    assert run(store, "QUEUE PENDING WITH_PAYLOAD 'p'") == []  # 'a' is EXCLUSIVE to p1
    assert run(store, "QUEUE PENDING WITH_PAYLOAD 'p'", "p1") == [
        {"id": "a", "queue_id": "1", "status": "pending", "extra": None, "payload": "{}"}
    ]
    assert run(store, "QUEUE ACTIVE 'p'") == [
        {"id": "b", "queue_id": "2", "status": "active", "extra": '{"n":1}'}
    ]
    assert run(store, "QUEUE GET 'p:b'") == [{"payload": "[1]", "extra": '{"n":1}'}]
    assert run(store, "QUEUE TO_CANCEL 120000 2000 'p'") == []
    assert run(store, "QUEUE STALLED 120000 'p'") == []
    assert run(store, "QUEUE ORPHANED 2000 'p'") == []
    assert run(store, """QUEUE ACK 2 '{"result":1}'""") == [{"success": "true"}]
    assert run(store, "QUEUE ACK 2 NULL") == [{"success": "false"}]
    assert run(store, "QUEUE RESULT 2") == [
        {"payload": '{"result":1}', "type": "success", "id": "2", "external_id": None}
    ]
    assert run(store, "QUEUE RESULT EXTERNAL_ID 'req' 'p:a'") == []
    assert run(store, "QUEUE CANCEL 'p:a'") == [{"payload": "{}", "extra": None}]
    assert run(store, "QUEUE TRUNCATE") == []


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("SELECT 1", "only QUEUE commands"),
        ("", "empty command"),
        ("QUEUE", "missing the command name"),
        ("QUEUE FLY 'p:k'", "unknown command QUEUE FLY"),
        ("QUEUE ADD 'p:k'", "QUEUE ADD: missing payload"),
        ("QUEUE ADD PRIORITY high 'p:k' '{}'", "PRIORITY must be an integer"),
        ("QUEUE ADD 'p:k' '{}' 'extra'", "unexpected a string after the command"),
        ("QUEUE RETRIEVE CONCURRENCY 'p:k'", "CONCURRENCY must be an integer"),
        ("QUEUE ACK 1.5 NULL", "key must be a quoted path or an integer id"),
        ("QUEUE GET 'p:k", "cannot parse the command"),
        ("QUEUE TO_CANCEL 1 'p'", "orphaned timeout must be an integer"),
        ("QUEUE LIST p", "prefix must be a quoted string"),
    ],
)
def test_bad_text_is_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(InvalidCommandError, match=named):
        sqltext.parse(text)
