"""What a supervisor checks before it listens, so that nobody else can stand in for it.

* The socket's directory is ours alone (like ssh-agent's and tmux's): made 0700 when
  missing, refused when it is a symlink, owned by someone else, or open to group/others —
  whoever controls the directory could swap the socket and read every result.
* One supervisor per socket and per database: an exclusive `flock` on a lock file beside
  each, holding the owner's pid, so a second one exits naming the first.
* A path is unlinked only if it is a socket: `--socket` naming a regular file is refused.
* The TCP listener's secret lives in a 0600 file beside the socket, made on first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path

from queryqueue.engine.errors import QueueError


class UnsafePathError(QueueError):
    """A path the supervisor would listen on, or read a secret from, is not private."""


class AlreadyRunningError(QueueError):
    """Another supervisor holds this socket or database."""


def private_directory(directory: Path) -> None:
    """Make `directory` 0700 if missing; refuse it unless it is ours alone."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(f"unsafe socket directory {directory}: it is a symlink")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"unsafe socket directory {directory}: not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafePathError(
            f"unsafe socket directory {directory}: owned by uid {info.st_uid}, not "
            f"{os.geteuid()}; use a directory of your own (mode 0700)"
        )
    if info.st_mode & 0o077:
        raise UnsafePathError(
            f"unsafe socket directory {directory}: mode {stat.S_IMODE(info.st_mode):04o} "
            f"lets others in; chmod 700 it or choose another"
        )


class Lock:
    """An exclusive flock on `path`, held until `release()` (or the process's death: the
    kernel drops it, so a crash never leaves a lock behind)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunningError(
                f"another supervisor (pid {holder}) is running on {what}; stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor; the file may stay
            self._fd = None


def held(path: Path) -> bool:
    """Whether a live process holds the `Lock` on `path` (a shared flock, dropped at once,
    cannot take it); no file: nobody."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # with it goes the shared lock, if taken
    return False


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def clear_stale_socket(path: Path) -> None:
    """Remove a socket left by a supervisor that died (we hold its lock, so nobody listens
    on it); refuse anything that is not a socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafePathError(f"{path} exists and is not a socket: refusing to replace it")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers: stale
            return
    raise AlreadyRunningError(f"a process is listening on {path}; stop it first")


def socket_identity(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def unlink_if_ours(path: Path, identity: tuple[int, int] | None) -> None:
    """Unlink the socket we bound, and only it (another may have replaced it since)."""
    if identity is None:
        return
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == identity:
            path.unlink()


def token_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".token")


def load_or_create_token(path: Path) -> str:
    """The TCP listener's secret: read from `path`, which must be a 0600 file of ours, or
    made there (0600, 32 random bytes as hex) when missing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise UnsafePathError(f"auth token file {path}: not a regular file of ours")
    if info.st_mode & 0o077:
        raise UnsafePathError(
            f"auth token file {path}: mode {stat.S_IMODE(info.st_mode):04o}; chmod 600 it"
        )
    token = path.read_text().strip()
    if len(token) < 16:
        raise UnsafePathError(f"auth token file {path}: the token is shorter than 16 characters")
    return token


def parse_address(text: str, *, public: bool) -> tuple[str, int]:
    """`HOST:PORT` (or `PORT`, on 127.0.0.1), refused if HOST is not loopback and
    `public` is False."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--http takes HOST:PORT, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--http port must be 0..65535, got {port}")
    if not public and not _loopback(host):
        raise ValueError(
            f"--http {host}: not a loopback address; add --http-public to serve other hosts"
        )
    return host, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
