"""Results on a store several hosts share: kept in the database, up to a limit; a larger
one fails its query at once with an error naming the limit, its shared memory freed."""

from __future__ import annotations

from pathlib import Path

import pytest

from queryqueue import QueryError, SocketQueueDriver
from queryqueue.driver_socket.segments import SHM_DIR, name_prefix
from tests.pool_util import ask
from tests.postgres_util import pg_host
from tests.trace import read_trace

MiB = 1024 * 1024


async def test_a_result_past_the_shared_limit_fails_its_query_naming_the_limit(
    workdir: Path, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.apps.pool_app import app, big_text

    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    host = pg_host(
        workdir, "a", schema, "--app", "tests.apps.pool_app:app", "--workers", "2",
        "--max-shared-result", "2",
    )  # fmt: skip
    driver = SocketQueueDriver(host.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=5.0)
    try:
        # Over the 1 MiB shared-memory threshold, under the limit: kept and read whole.
        fits = await ask(queue, "big", "fits", {"key": "fits", "size": int(1.5 * MiB)})
        assert fits == big_text(int(1.5 * MiB), "fits")
        with pytest.raises(QueryError, match=r"3\.0 MiB; .* up to 2 MiB \(--max-shared-result\)"):
            await ask(queue, "big", "large", {"key": "large", "size": 3 * MiB})
        # It ran once, failed for its callers, and holds nothing: no item, and its segment
        # free again (the pool reuses it: the supervisor's stop removes them all).
        assert [t[1] for t in read_trace(workdir) if t[0] == "end"].count("large") == 1
        assert await driver.list_items("pool") == []
        segments = (await driver.stats())["shared_memory"]
        assert segments["writing"] == 0 and segments["stored"] == 0 and segments["free"] >= 1
    finally:
        await queue.shutdown(grace=0)
        await driver.close()
        assert host.stop() == 0
    assert list(SHM_DIR.glob(name_prefix(host.socket_path) + "*")) == []
