"""The benchmarks' meter (benchmarks/measure.py): the process tree it measures is found
through the tree's own /proc entries, and it is the tree psutil finds by scanning every
process on the machine."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from benchmarks import measure
from tests.waiting import wait_until_sync

# A child that starts a grandchild, which starts a great-grandchild; each sleeps until
# killed. The grandchild is started from a thread of the child that lives on: Linux lists
# a child under the thread that started it (under the main thread only once that one
# has ended).
_CHILD = """
import subprocess, sys, threading, time
def start():
    subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        "time.sleep(600)"])
    time.sleep(600)
threading.Thread(target=start, daemon=True).start()
time.sleep(600)
"""


@contextmanager
def _tree_of_three() -> Iterator[psutil.Process]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD])
    root = psutil.Process(child.pid)
    try:
        wait_until_sync(
            lambda: len(root.children(recursive=True)) == 2,
            within=60,
            what="the grandchildren started",
        )
        yield root
    finally:
        below = root.children(recursive=True)
        for process in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        child.kill()
        child.wait(timeout=30)
        # Not our children: once their parents are gone, init reaps them.
        wait_until_sync(lambda: not any(_alive(process) for process in below), within=60)


def _alive(process: psutil.Process) -> bool:
    try:
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _pids(processes: list[psutil.Process]) -> set[int]:
    return {process.pid for process in processes}


@pytest.mark.skipif(not measure.lists_children(), reason="/proc lists no children here")
def test_the_tree_is_found_through_proc_as_psutil_finds_it() -> None:
    with _tree_of_three() as root:
        expected = {root.pid, *(p.pid for p in root.children(recursive=True))}
        assert len(expected) == 3
        assert measure.descendants(root.pid) is not None
        assert _pids(measure.tree(root)) == expected


def test_without_proc_children_the_tree_is_psutils(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "lists_children", lambda: False)
    with _tree_of_three() as root:
        assert measure.descendants(root.pid) is None
        expected = {root.pid, *(p.pid for p in root.children(recursive=True))}
        assert _pids(measure.tree(root)) == expected and len(expected) == 3


def test_a_process_gone_is_no_error() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert measure.descendants(child.pid) in ([], None)


def test_the_meter_counts_a_tree_started_inside_it() -> None:
    """CPU of processes the measuring process starts (and reaps) inside the window."""
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    with measure.TreeMeter(interval=0.01) as meter:
        done = threading.Event()

        def run() -> None:
            subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert done.is_set()
    assert meter.cpu_s >= 0.3
    assert meter.peak_rss > 0
