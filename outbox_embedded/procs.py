"""Child processes of the embedded services: logged, signal-able, killed (with their
descendants) at exit.

`Proc` runs the embedded PostgreSQL, the tansu broker and the bench's relay process. Every
live `Proc` is killed by an atexit hook, so a crashing demo or bench does not leave servers
behind (a SIGKILL of the parent itself cannot be covered).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Proc",
    "free_port",
    "port_is_free",
    "tail",
    "descendants",
    "as_user",
]

_LIVE: set[Proc] = set()
_LIVE_LOCK = threading.Lock()


_RESERVED: dict[int, int] = {}  # port -> fd of its held lock file
_RESERVED_LOCK = threading.Lock()
_LOWEST_PORT = 15000


def free_port(host: str = "127.0.0.1") -> int:
    """Return a free TCP port on `host`, reserved for this process until it exits.

    A server started by a child (a JVM takes seconds to bind) must not lose its port in the
    meantime. A port the OS picks with bind(0) comes from the ephemeral range, where any
    outgoing connection of any process may take it as its source port and where another
    process's bind(0) may pick it again. So the port is drawn outside the ephemeral range,
    and reserved with an flock on a file in the user's directory under the temp directory,
    which every caller of this function, in every process of the user, respects; the lock
    goes away with the process.
    """
    for port in _candidate_ports():
        if port in _RESERVED:
            continue
        fd = _lock_port(port)
        if fd is None:
            continue
        if port_is_free(port, host):
            with _RESERVED_LOCK:
                _RESERVED[port] = fd
            return port
        os.close(fd)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no usable range: let the OS pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _candidate_ports(attempts: int = 200) -> list[int]:
    """Random ports between 15000 and the start of the ephemeral range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low - _LOWEST_PORT < 1000:
        return []
    return random.sample(range(_LOWEST_PORT, low), attempts)


def _lock_port(port: int) -> int | None:
    """The fd of an exclusive flock on the port's lock file, or None when another holds it."""
    # One directory per user: the processes that start servers run as one user.
    lock_dir = Path(tempfile.gettempdir()) / f"outbox-ports-{os.getuid()}"
    try:
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(lock_dir / str(port), os.O_RDONLY | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (a bind with SO_REUSEADDR succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def as_user(user: str | None) -> dict[str, Any]:
    """Popen keyword arguments that run a child as `user` with only that user's groups.

    Without `group`/`extra_groups` the child would keep root's groups, and with them the
    group permission bits of root-owned files.
    """
    if user is None:
        return {}
    import pwd

    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def tail(path: Path | str, max_chars: int = 4000) -> str:
    """The last `max_chars` characters of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_chars))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------------
# /proc helpers (Linux): PostgreSQL backends call setsid(), so a process-group kill of the
# postmaster does not reach them; we walk the parent/child tree instead.


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except FileNotFoundError:  # not Linux
        return []


def descendants(pid: int) -> list[int]:
    """PIDs of all living (non-zombie) descendants of `pid` and members of its process group."""
    children: dict[int, list[int]] = {}
    group: list[int] = []
    for p in _all_pids():
        st = _proc_stat(p)
        if st is None or st[0] == "Z":
            continue
        children.setdefault(st[1], []).append(p)
        if st[2] == pid and p != pid:
            group.append(p)
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.append(child)
                stack.append(child)
    return found + [p for p in group if p not in found]


def _alive_pid(pid: int) -> bool:
    st = _proc_stat(pid)
    if st is None:
        if not os.path.isdir("/proc"):  # not Linux: best effort
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    return st[0] != "Z"


def _signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Proc:
    """A child process started in its own session, with stdout+stderr going to `log_path`.

    The log file is opened in append mode, so a restarted server can keep one log.
    """

    def __init__(
        self,
        cmd: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
        log_path: Path | str | None = None,
        cwd: Path | str | None = None,
        user: str | None = None,
        name: str | None = None,
    ) -> None:
        self.cmd: list[str] = [os.fspath(c) for c in cmd]
        self.name: str = name or Path(self.cmd[0]).name
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
            os.close(fd)
            log_path = tmp
        self.log_path: Path = Path(log_path)
        full_env: dict[str, str] = dict(os.environ) if inherit_env else {}
        if env:
            full_env.update(env)
        self._log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 (closed in close())
        self._closed = False
        try:
            self.popen: subprocess.Popen[bytes] = subprocess.Popen(
                self.cmd,
                env=full_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **as_user(user),
            )
        except BaseException:
            self._log.close()
            raise
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __repr__(self) -> str:
        return (
            f"Proc({self.name!r}, pid={self.pid}, alive={self.alive}, log={str(self.log_path)!r})"
        )

    @property
    def path(self) -> Path:
        """Alias of `log_path`."""
        return self.log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    # -- signals ---------------------------------------------------------------------
    def send_signal(self, sig: int, group: bool = False) -> None:
        """Send `sig` to the process, or to its whole process group when `group`."""
        if self.popen.poll() is not None:
            return
        if group:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self.popen.send_signal(sig)

    def sigterm(self, group: bool = False) -> None:
        """SIGTERM to the process only (its own graceful shutdown), or its group."""
        self.send_signal(signal.SIGTERM, group)

    def sigkill(self, group: bool = True) -> None:
        """SIGKILL the process and (by default) every descendant and group member, and reap it.

        The root is SIGSTOPped first so that it cannot fork while its tree is collected.
        """
        if not group:
            self.send_signal(signal.SIGKILL)
            self.popen.wait()
            return
        self.kill_tree()

    def sigstop(self, group: bool = True) -> None:
        """Freeze the process (and by default its group), e.g. to simulate a GC pause/hang."""
        self.send_signal(signal.SIGSTOP, group)

    def sigcont(self, group: bool = True) -> None:
        """Resume after `sigstop`."""
        self.send_signal(signal.SIGCONT, group)

    def kill_tree(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the process, its descendants and group members; wait until all are gone.

        Does nothing once the process has been reaped (its PID may belong to someone else).
        """
        if self.popen.returncode is not None:
            return
        root = self.pid  # not reaped yet: a zombie still holds the PID, so this is safe
        _signal_quietly(root, signal.SIGSTOP)
        victims = descendants(root)
        _signal_quietly(root, signal.SIGKILL)
        for pid in victims:
            _signal_quietly(pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout_s
        while any(_alive_pid(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- waiting ---------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit and return the return code; TimeoutError (with log tail) on timeout."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"{self.name} (pid {self.pid}) still running after {timeout}s; "
                f"log tail:\n{self.log_tail()}"
            ) from None

    def log_text(self) -> str:
        """The whole log so far."""
        return self.log_path.read_bytes().decode("utf-8", errors="replace")

    def log_tail(self, max_chars: int = 4000) -> str:
        return tail(self.log_path, max_chars)

    def log_size(self) -> int:
        """Current size of the log in bytes: pass it as `since=` to wait for a *new* line."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_for_log(
        self,
        pattern: str | re.Pattern[str],
        timeout_s: float = 30.0,
        *,
        since: int = 0,
        interval_s: float = 0.05,
    ) -> str:
        """Poll the log (from byte `since`) until it contains `pattern`; return the matched text.

        A str is a plain substring, a compiled pattern is searched as a regex. Raises
        TimeoutError with the log tail on timeout, or as soon as the process has exited
        without having written it.
        """
        deadline = time.monotonic() + timeout_s
        buf = bytearray()
        offset = since
        while True:
            exited = self.popen.poll() is not None  # read the log *after* checking the exit
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            buf += chunk
            text = buf.decode("utf-8", errors="replace")
            if isinstance(pattern, re.Pattern):
                m = pattern.search(text)
                if m:
                    return m.group(0)
            elif pattern in text:
                return pattern
            if exited:
                raise TimeoutError(
                    f"{self.name} exited with code {self.popen.returncode} before logging "
                    f"{_pattern_text(pattern)!r}; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} did not log {_pattern_text(pattern)!r} within {timeout_s}s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(interval_s)

    # -- cleanup ---------------------------------------------------------------------
    def shutdown(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Ask the process to stop with ``sig``, wait up to ``timeout_s``, then close it
        (which kills whatever is left).  Nothing to do once it has exited."""
        if not self.alive:
            return
        self.send_signal(sig)
        try:
            self.wait(timeout_s)
        except TimeoutError:
            pass
        self.close()

    def close(self) -> None:
        """Kill the process tree if it is still alive and close the log; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.kill_tree()
        finally:
            self._log.close()
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pattern_text(pattern: str | re.Pattern[str]) -> str:
    return pattern.pattern if isinstance(pattern, re.Pattern) else pattern


@atexit.register
def _kill_all_at_exit() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        try:
            p.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
