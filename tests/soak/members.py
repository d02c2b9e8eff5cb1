"""The soak's load and processes: :class:`Member` (a relay, consumer or worker process
that survives restarts under one name, with its scraped metrics) and :class:`Writers`
(the threads that commit the events)."""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from consumer_sdk import OutboxEvent, write_events
from tests.fixtures.procs import Proc, free_port
from tests.soak.config import ROOT, STOP_TIMEOUT_S, TOPIC

# ---------------------------------------------------------------------------------------
# processes


class Member:
    """A relay, consumer or worker process under a name that survives restarts (r1, c1, w1).

    ``expected_down`` is set before the soak kills it, so the monitor can tell a crash of
    its own (an unexpected exit, restarted and reported) from a fault.
    """

    def __init__(self, name: str, role: str, build: Callable[[Member], tuple[list[str], dict[str, str]]],
                 log_path: Path) -> None:
        self.name, self.role, self._build, self.log_path = name, role, build, log_path
        self.lock = threading.RLock()
        self.proc: Proc | None = None
        self.incarnation = 0
        self.expected_down = True
        self.frozen = False
        self.port: int | None = None  # relays: metrics port of the current incarnation
        self.scrapes: dict[int, dict[str, float]] = {}
        self.unexpected_exits: list[str] = []

    def start(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.alive:
                return
            if self.proc is not None:
                self.proc.close()
            self.incarnation += 1
            self.port = free_port() if self.role == "relay" else None
            cmd, env = self._build(self)
            self.proc = Proc(cmd, env=env, log_path=self.log_path, cwd=ROOT, name=self.name)
            self.expected_down = False
            self.frozen = False

    def kill(self) -> None:
        """SIGKILL (the process tree); scraped first so its counters are not lost."""
        with self.lock:
            self.scrape()
            self.expected_down = True
            if self.proc is not None:
                self.proc.close()

    def freeze(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.alive:
                self.scrape()
                self.proc.sigstop()
                self.frozen = True

    def thaw(self) -> None:
        with self.lock:
            if self.proc is not None and self.frozen:
                self.proc.sigcont()
            self.frozen = False

    def check(self) -> str | None:
        """Restart a process that exited on its own; returns a description of the exit."""
        with self.lock:
            if self.proc is None or self.expected_down or self.proc.alive:
                return None
            text = (f"{self.name} (incarnation {self.incarnation}) exited with {self.proc.returncode}: "
                    f"{self.proc.log_tail(600)!r}")
            self.unexpected_exits.append(text)
            self.start()
            return text

    def scrape(self, timeout_s: float = 0.5) -> None:
        """Read the relay's counters (kept per incarnation: a restart starts from zero)."""
        if self.port is None or self.proc is None or not self.proc.alive or self.frozen:
            return
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError:
            return
        self.scrapes[self.incarnation] = parse_metrics(text)

    def counter(self, name: str) -> float:
        return sum(values.get(name, 0.0) for values in self.scrapes.values())

    def stop(self) -> int | None:
        """SIGTERM (after SIGCONT) and wait; the exit code, None when it had to be killed."""
        with self.lock:
            proc = self.proc
            if proc is None or not proc.alive:
                return proc.returncode if proc is not None else 0
            self.scrape()
            self.expected_down = True
            if self.frozen:
                proc.sigcont()
                self.frozen = False
            proc.sigterm()
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except TimeoutError:
            return None
        finally:
            proc.close()

    def close(self) -> None:
        with self.lock:
            self.expected_down = True
            if self.proc is not None:
                self.proc.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: the sum of every sample of each metric name."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if match:
            try:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
            except ValueError:
                pass
    return values


# ---------------------------------------------------------------------------------------
# writers


class Writers:
    """Threads committing transactions of 1-5 events over 1-2 keys at ``rate`` events/s in all."""

    def __init__(self, dsn: str, *, keys: Sequence[str], rate: float, threads: int, seed: int) -> None:
        self.dsn, self.keys, self.rate = dsn, list(keys), rate
        self._seed = seed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0.0
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"soak-writer-{i}", daemon=True)
                         for i in range(threads)]
        self.events = 0
        self.transactions = 0
        self.failed = 0
        self.unknown = 0
        self.windows: Counter[int] = Counter()  # events committed per 10 s window
        self.started_at = 0.0
        self.stopped_at = 0.0

    def start(self) -> None:
        self.started_at = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        self.stopped_at = time.monotonic()

    def _pace(self, n: int) -> None:
        """Reserve ``n`` events' worth of the rate; an outage is not made up with a burst."""
        with self._lock:
            now = time.monotonic()
            at = max(now, self._next)
            self._next = at + n / self.rate
        if at > now:
            self._stop.wait(at - now)

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        conn: psycopg.Connection[Any] | None = None
        failures = 0
        while not self._stop.is_set():
            n = rng.randint(1, 5)
            keys = sorted(rng.sample(self.keys, 2 if n > 1 and rng.random() < 0.3 else 1))
            self._pace(n)
            committing = False
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3,
                                           application_name=f"soak-writer-{index}")
                with conn.transaction():
                    events = self._events(conn, rng, keys, n, index)
                    write_events(conn, events)
                    committing = True
                with self._lock:
                    self.events += n
                    self.transactions += 1
                    self.windows[int((time.monotonic() - self.started_at) // 10)] += n
                failures = 0
            except psycopg.Error:
                with self._lock:
                    if committing:
                        self.unknown += 1  # the commit itself failed: it may or may not have happened
                    else:
                        self.failed += 1
                if conn is not None:
                    conn.close()
                conn = None
                failures += 1
                self._stop.wait(min(1.0, 0.05 * 2 ** min(failures, 5)))
        if conn is not None:
            conn.close()

    def _events(self, conn: psycopg.Connection[Any], rng: random.Random, keys: list[str], n: int,
                index: int) -> list[OutboxEvent]:
        # The keys' locks first, in one statement and a fixed (hash) order: no deadlock.
        conn.execute("SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT hashtext(k) AS h "
                     "FROM unnest(%s::text[]) AS k ORDER BY h) AS locks", (keys,))
        counts = [n] if len(keys) == 1 else [(first := rng.randint(1, n - 1)), n - first]
        events: list[OutboxEvent] = []
        for key, count in zip(keys, counts, strict=True):
            row = conn.execute("UPDATE soak_writer_keys SET seq = seq + %s WHERE key = %s RETURNING seq",
                               (count, key)).fetchone()
            assert row is not None
            for seq in range(int(row[0]) - count + 1, int(row[0]) + 1):
                events.append(OutboxEvent(topic=TOPIC, key=key, payload={"key": key, "seq": seq, "w": index}))
        return events

    def slowest_window(self) -> float:
        """Events/s of the slowest complete 10 s window."""
        full = int((self.stopped_at - self.started_at) // 10)
        return min((self.windows.get(i, 0) / 10.0 for i in range(full)), default=0.0)
