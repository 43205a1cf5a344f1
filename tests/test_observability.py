"""`--http` (metrics, status JSON, the live page in a real browser), JSON logs, and
`queryqueue inspect` on a database whose supervisor was killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from queryqueue import ContinueWaitError, SocketQueueDriver
from queryqueue.supervisor.launch import SupervisorProcess, launch
from tests.supervisor_util import REPO
from tests.waiting import wait_until, wait_until_sync

APP = "tests.apps.pool_app:app"


class Site:
    def __init__(self, host: SupervisorProcess) -> None:
        self.host = host
        found: list[str] = []

        def announced() -> bool:
            found[:] = re.findall(
                r"status page on http://127\.0\.0\.1:(\d+)/", host.log.read_text()
            )
            return bool(found)

        wait_until_sync(announced, within=30, what="the status page's address in the log")
        self.base = f"http://127.0.0.1:{found[0]}"
        self.token = (
            host.socket_path.with_name(host.socket_path.name + ".token").read_text().strip()
        )

    def get(self, path: str, *, token: str | None = None) -> tuple[int, str, str]:
        request = urllib.request.Request(self.base + path)
        request.add_header("Authorization", f"Bearer {self.token if token is None else token}")
        try:
            with urllib.request.urlopen(request, timeout=20) as response:
                body = response.read().decode()
                return response.status, response.headers.get("Content-Type", ""), body
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()

    def status(self) -> dict[str, Any]:
        code, _, body = self.get("/api/status")
        assert code == 200, body
        found: dict[str, Any] = json.loads(body)
        return found


def _pool_host(workdir: Path, workers: int, *options: str) -> SupervisorProcess:
    """A supervisor running the pool test app; $POOL_TRACE is set by the caller."""
    return launch(
        workdir / "q.db",
        workdir / "q.sock",
        "--app",
        APP,
        "--workers",
        str(workers),
        *options,
        cwd=REPO,
    )


@pytest.fixture
def http_host(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SupervisorProcess]:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    # FULL: answers wait for the WAL's fsync off the loop (synced.py), end to end here.
    host = _pool_host(workdir, 2, "--http", "127.0.0.1:0", "--synchronous", "FULL")
    try:
        yield host
    finally:
        assert host.stop() == 0


@contextlib.asynccontextmanager
async def _pool_queue(host: SupervisorProcess) -> AsyncIterator[Any]:
    from tests.apps.pool_app import app

    driver = SocketQueueDriver(host.socket_path)
    queue = app.pool_queue(driver, continue_wait_timeout=5.0)
    try:
        yield queue
    finally:
        await queue.shutdown(grace=0)
        await driver.close()


async def _ask(queue: Any, key: str, seconds: float) -> Any:
    deadline = time.monotonic() + 60
    while True:
        try:
            return await queue.execute_in_queue("sql", key, {"key": key, "seconds": seconds})
        except ContinueWaitError:
            assert time.monotonic() < deadline, f"no result for {key}"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_executions_and_dedup_hits_per_prefix(
    http_host: SupervisorProcess,
) -> None:
    site = Site(http_host)
    assert site.get("/metrics", token="wrong")[0] == 401
    assert site.get("/api/status", token="")[0] == 401
    code, content_type, before_text = site.get("/metrics")
    assert code == 200 and content_type.startswith("text/plain"), before_text
    before = _samples(before_text)
    ok = ("queryqueue_executions_total", (("outcome", "ok"), ("prefix", "pool")))
    dedup = ("queryqueue_dedup_hits_total", (("prefix", "pool"),))
    assert before.get(ok, 0) == 0
    async with _pool_queue(http_host) as queue:
        # Three distinct queries, and one asked by three callers at once: it runs once.
        answers = await asyncio.gather(
            *(_ask(queue, f"m{i}", 0.05) for i in range(3)),
            *(_ask(queue, "shared", 0.5) for _ in range(3)),
        )
        # And one at priority 10 with room: the fast track retrieves it in its ADD.
        urgent = await queue.execute_in_queue(
            "sql", "urgent", {"key": "urgent", "seconds": 0.01}, priority=10
        )
        # One whose handler fails twice with a transient error: retried, answered once.
        flaky = await queue.run("flaky", "flaky", {"key": "flaky"}, timeout=60)
    assert flaky == {"key": "flaky", "attempts": 3}
    assert urgent["key"] == "urgent"
    assert [a["key"] for a in answers] == ["m0", "m1", "m2", "shared", "shared", "shared"]
    after = _samples(site.get("/metrics")[2])
    assert after[ok] == 6  # six executions, all ok
    retries = (("handler", "flaky"), ("prefix", "pool"))
    assert after[("queryqueue_retries_total", retries)] == 2
    assert after[("queryqueue_fast_track_hits_total", (("prefix", "pool"),))] == 1
    assert after[dedup] >= 2  # the two callers that joined "shared"
    assert after[("queryqueue_workers_alive", ())] == 2
    assert after[("queryqueue_budget", (("prefix", "pool"),))] == 2  # the supervisor's
    handler = (("handler", "sql"), ("prefix", "pool"))
    assert after[("queryqueue_run_seconds_count", handler)] == 5
    assert after[("queryqueue_wait_seconds_count", handler)] == 5
    assert after[("queryqueue_command_seconds_count", (("command", "ack"),))] >= 5
    assert after[("queryqueue_db_bytes", ())] > 0
    # The answers above waited for syncs of their commits (FULL, off the loop).
    assert after[("queryqueue_wal_syncs", ())] >= 1
    assert after[("queryqueue_answers_held_for_sync", ())] >= 1
    assert ("queryqueue_commits_unsynced", ()) in after
    status = site.status()
    assert [r["query_key"] for r in status["recent"]].count("shared") == 1
    assert {w["pid"] for w in status["pool"]["workers"]} == {
        w["pid"]
        for w in json.loads(_cli("status", "--json", "--socket", str(http_host.socket_path)))[
            "pool"
        ]["workers"]
    }


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "queryqueue", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    return found


def _dump_dom(browser: str, url: str, workdir: Path) -> str:
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={workdir / 'chromium'}",
            "--virtual-time-budget=4000",  # lets the page's fetch and render run
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


async def test_the_status_page_shows_a_running_query_and_its_worker_in_a_browser(
    http_host: SupervisorProcess, workdir: Path
) -> None:
    browser = _chromium()
    site = Site(http_host)
    async with _pool_queue(http_host) as queue:
        asking = asyncio.ensure_future(_ask(queue, "page-visible-key", 20.0))
        try:

            def running() -> list[dict[str, Any]]:
                workers = site.status()["pool"]["workers"]
                return [w for w in workers if w["running"]]

            await wait_until(running, within=30, what="the query running")
            (worker,) = running()
            assert worker["running"]["query_key"] == "page-visible-key"
            dom = await asyncio.to_thread(
                _dump_dom, browser, f"{site.base}/?token={site.token}", workdir
            )
            table = dom[dom.index('id="running"') :]
            table = table[: table.index("</table>")]
            assert "page-visible-key" in table, table
            assert f"<td>{worker['pid']}</td>" in table, table
            assert '<div id="error"></div>' in dom  # no failed refresh
            # Without the token the page gets nothing.
            assert site.get("/", token="nope")[0] == 401
        finally:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)


def test_json_logs_carry_the_events_fields_one_object_per_line(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POOL_TRACE", str(workdir / "trace"))
    host = _pool_host(workdir, 2, "--log-level", "debug", "--log-format", "json")
    try:
        asyncio.run(_one_query(host))

        def performed() -> list[dict[str, Any]]:
            lines = [
                json.loads(line)
                for line in host.log.read_text().splitlines()
                if line.startswith("{")
            ]
            return [line for line in lines if line.get("event") == "Performing query completed"]

        wait_until_sync(performed, within=30, what="a worker's completion in the log")
        (done,) = performed()
        assert done["queryKey"] == "logged" and done["queuePrefix"] == "pool"
        assert done["pid"] != host.pid  # a worker's, through the supervisor's stream
        assert done["level"] == "debug" and done["logger"] == "queryqueue.queue"
    finally:
        assert host.stop() == 0
    # Every line the supervisor wrote is one JSON object, its start and stop included.
    lines = [json.loads(line) for line in host.log.read_text().splitlines()]
    said = [line["message"] for line in lines if line["pid"] == host.pid]
    assert any(m.startswith("listening on ") for m in said)
    assert any(m.startswith("pool of 2 workers for queue 'pool'") for m in said)
    assert len([m for m in said if m.startswith("worker ") and m.endswith(" started")]) == 2
    assert said[-1] == "stopped"


async def _one_query(host: SupervisorProcess) -> None:
    async with _pool_queue(host) as queue:
        assert (await _ask(queue, "logged", 0.01))["key"] == "logged"


def test_inspect_reads_a_database_whose_supervisor_was_killed(workdir: Path) -> None:
    db = workdir / "q.db"
    host = launch(db, workdir / "q.sock")
    try:
        asyncio.run(_queue_two(host))
    finally:
        host.kill9()  # no checkpoint: what it wrote is in the WAL
    items = json.loads(_cli("inspect", "--db", str(db), "--format", "json"))
    assert [(i["prefix"], i["status"], i["query_key"]) for i in items] == [
        ("kept", "pending", "first"),
        ("kept", "pending", "second"),
    ]
    results = json.loads(_cli("inspect", "--db", str(db), "--results", "--format", "json"))
    assert [(r["path"], r["read"]) for r in results] == [("done:k", False)]
    table = _cli("inspect", "--db", str(db), "--prefix", "kept")
    assert "pending" in table and "first" in table and "second" in table
    csv_text = _cli("inspect", "--db", str(db), "--format", "csv").splitlines()
    assert csv_text[0].startswith("queue_id,prefix,key,status") and len(csv_text) == 3
    # Read-only: a supervisor started on it afterwards finds everything as it was.
    again = launch(db, workdir / "q2.sock")
    try:
        listed = asyncio.run(_listed(again))
        assert listed == 2
        # While it runs it holds the file (one writer, its locks held): inspect says so.
        done = subprocess.run(
            [sys.executable, "-m", "queryqueue", "inspect", "--db", str(db)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert done.returncode != 0 and "held by a running supervisor" in done.stderr
    finally:
        assert again.stop() == 0


async def _queue_two(host: SupervisorProcess) -> None:
    driver = SocketQueueDriver(host.socket_path)
    try:
        for key in ("first", "second"):
            await driver.add(f"kept:{key}", json.dumps({"queryKey": key, "queryHandler": "sql"}))
        await driver.add("done:k", "{}")
        await driver.ack("done:k", '{"result": 1}')
    finally:
        await driver.close()


async def _listed(host: SupervisorProcess) -> int:
    driver = SocketQueueDriver(host.socket_path)
    try:
        return len(await driver.list_items("kept"))
    finally:
        await driver.close()
