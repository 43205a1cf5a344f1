"""Imports flow one way: engine <- drivers (SQLite, PostgreSQL, the socket) <- the app
(`queryqueue/app.py`) <- the supervisor <- the command line and the demo. Leaves import
nothing of ours, the engine never imports a driver, a driver never imports another driver,
the app, or the supervisor, and the app never imports the supervisor."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = {"driver_sqlite", "driver_postgres", "driver_socket"}
OURS = {"engine", *DRIVERS, "app", "supervisor", "benchmarks", "queryqueue"}
# package (a folder, or a module of queryqueue/) -> packages of ours it may import
ALLOWED = {
    "engine": {"engine"},
    "driver_sqlite": {"engine", "driver_sqlite"},
    "driver_postgres": {"engine", "driver_postgres"},
    "driver_socket": {"engine", "driver_socket"},
    "app": {"engine", "driver_socket"},
    "supervisor": {"engine", *DRIVERS, "app", "supervisor"},
}
# queryqueue/'s own modules: the app is a layer of its own, the rest (the command line,
# the demo, the public names) sit on top of everything.
TOP = ROOT / "queryqueue"
# queryqueue/'s modules callers import: the app and the thin client, on the drivers.
APP_LAYER = [TOP / "app.py", TOP / "client.py"]
LEAVES = {"engine/errors.py", "engine/clock.py", "engine/responses.py"}


def _package(module: str) -> str:
    """`queryqueue.engine.queue` -> `engine`: our subpackages by their folder's name."""
    parts = module.split(".")
    if parts[0] == "queryqueue" and len(parts) > 1:
        return parts[1]
    return parts[0]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(_package(node.module))
    return found & OURS


def _modules() -> list[Path]:
    folders = [p for package in ALLOWED.keys() - {"app"} for p in (ROOT / package).rglob("*.py")]
    return sorted([*folders, *APP_LAYER])


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(module: Path) -> None:
    relative = module.relative_to(ROOT).as_posix()
    package = "app" if module in APP_LAYER else relative.split("/")[0]
    imported = _imports(module)
    if relative in LEAVES:
        assert imported - {"engine"} == set()
        assert not any(
            name.startswith("queryqueue.engine.")
            and name not in {"queryqueue.engine.errors", "queryqueue.engine.responses"}
            for name in _full_imports(module)
        ), f"{relative} is a leaf and must not import the engine's other modules"
    assert imported <= ALLOWED[package], f"{relative} imports {imported - ALLOWED[package]}"


def _full_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_public_package_imports_its_subpackages_by_their_folder_names() -> None:
    """Every module imports ours as `queryqueue.X`: a bare `import engine` would load a
    second copy of the module from the checkout (and does not exist once installed)."""
    bare = {"engine", *DRIVERS, "supervisor"}
    offenders = []
    for path in _checkout_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in bare
            ]
    assert offenders == []


def _checkout_sources() -> list[Path]:
    """The checkout's own Python files, in its folders: not hidden ones (a virtualenv, the
    benchmark peers' virtualenvs under benchmarks/.peers: tens of thousands of files) nor
    `queryqueue/`, whose subpackages link to the folders walked already."""
    found: list[Path] = []
    for folder in sorted(ROOT.iterdir()):
        if not folder.is_dir() or folder.name.startswith(".") or folder.name == "queryqueue":
            continue
        for parent, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            found += [Path(parent, name) for name in files if name.endswith(".py")]
    return sorted(found)


# The supervisor's core decides; the shell around it does the I/O. Its modules import
# no event loop, socket, process, thread or clock, and nothing of the shell.
SHELL_ONLY = {"asyncio", "socket", "selectors", "subprocess", "multiprocess", "threading", "time"}


@pytest.mark.parametrize(
    "module",
    sorted((ROOT / "supervisor" / "core").glob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_supervisors_core_does_no_io(module: Path) -> None:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
    assert not {name.split(".")[0] for name in imported} & SHELL_ONLY
    ours = {name for name in imported if name.startswith("queryqueue.supervisor")}
    assert all(name.startswith("queryqueue.supervisor.core") for name in ours), ours
