"""Query-key hashes are Cube's: MD5 of JavaScript's JSON.stringify, plus @processUid."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queryqueue import InvalidCommandError, hash_query_key
from queryqueue.engine.hashing import js_json_stringify, stringified


def test_string_key_matches_cube_store_driver() -> None:
    # Cube's driver hashes a string key as the MD5 of its JSON text, quotes included
    assert hash_query_key("string") == "095d71cf12556b9d5e330ad575b3df5d"


def test_sql_key_is_md5_of_compact_json() -> None:
    key = ["SELECT * FROM orders WHERE id = ?", [42, "é"]]
    compact = '["SELECT * FROM orders WHERE id = ?",[42,"é"]]'
    assert js_json_stringify(key) == compact
    assert hash_query_key(key) == hashlib.md5(compact.encode()).hexdigest()


def test_persistent_key_carries_the_owner_process() -> None:
    uid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert hash_query_key("x", persistent=True, process_uid=uid) == f"{hash_query_key('x')}@{uid}"
    with pytest.raises(ValueError, match="process_uid"):
        hash_query_key("x", persistent=True)


@pytest.mark.parametrize(
    ("value", "javascript"),
    [
        (1.0, "1"),
        (1.5, "1.5"),
        (-0.0, "0"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1e-7, "1e-7"),
        (0.00001, "0.00001"),
        (2.5e-10, "2.5e-10"),
        (float("nan"), "null"),
        (True, "true"),
        (None, "null"),
        ({"b": 1, "2": 2, "a": None, "1": "\n"}, '{"1":"\\n","2":2,"b":1,"a":null}'),
        ("\u2028\x01", '"\u2028\\u0001"'),
    ],
)
def test_serialization_follows_javascript(value: object, javascript: str) -> None:
    assert js_json_stringify(value) == javascript


def test_unserializable_key_is_a_clear_error() -> None:
    with pytest.raises(InvalidCommandError, match="holds a set, which has no JSON form"):
        hash_query_key({1, 2})
    with pytest.raises(InvalidCommandError, match="holds a date"):
        hash_query_key(["report", dt.date(2026, 12, 1)])


_KEY_PARTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(
            st.text(max_size=3) | st.sampled_from(["0", "7", "01", "-1"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)


@given(_KEY_PARTS)
def test_the_fast_serialization_is_javascripts(value: object) -> None:
    """orjson serializes a plain key (no float, no array-index key, 64-bit integers) and
    our writer the rest; either way the bytes are JSON.stringify's."""
    try:
        expected = js_json_stringify(value).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8, either way
        with pytest.raises(UnicodeEncodeError):
            stringified(value)
        return
    assert stringified(value) == expected
