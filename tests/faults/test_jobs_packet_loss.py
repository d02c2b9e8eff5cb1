"""A partition that drops packets between a worker pool and PostgreSQL: the pool's TCP settings
end its statements, and stop() keeps its bound.

The fault proxy's blackhole (tests/fixtures/proxy.py) holds the bytes in a process whose
kernel still acknowledges them: TCP never times out through it.  Here the pool's
connections cross a veth pair into a network namespace, and a ``blackhole`` queueing
discipline on both ends drops every packet, as a partition does:

    pool --TCP--> [netns] forwarder 10.a.b.2:P --> [host] TcpProxy 10.a.b.1:Q --> PostgreSQL
           (the veth pair: both ends drop everything during the fault)

Needs root (CAP_NET_ADMIN), ``ip`` and ``tc`` with veth and the blackhole qdisc; skips
and says why otherwise.  Before: no keep-alive settings and no ``tcp_user_timeout``: the
heartbeat's statement waited for the kernel's 15 retransmissions (about 15 minutes), the
listener for a reply that never came, and stop() for each of them (an audit of the pool).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from consumer_sdk.jobs import NewJob, WorkerConfig, WorkerPool, enqueue
from consumer_sdk.jobs.worker import STOP_GRACE_S
from tests.fixtures.procs import wait_until
from tests.fixtures.proxy import TcpProxy
from tests.integration.jobs._support import migrate_jobs_db, recording_logger, rows

ROOT = Path(__file__).resolve().parents[2]
LEASE_S = 3.0
#: The forwarder inside the namespace: a TcpProxy listening on the namespace's address.
FORWARDER = """
import sys, threading
sys.path.insert(0, {root!r})
from tests.fixtures.proxy import TcpProxy
proxy = TcpProxy({target!r}, {port})
proxy.listen_host = {listen!r}
proxy.start()
print(proxy.port, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def jobs_db(db_dsn: str) -> str:  # as tests/faults/test_jobs_faults.py: the jobs schema, a fresh database
    return migrate_jobs_db(db_dsn)


@pytest.fixture
def conn(jobs_db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(jobs_db, autocommit=True) as c:
        yield c


@dataclass
class Link:
    """Where to connect to reach PostgreSQL across the veth pair, and the fault."""

    host: str
    port: int
    drop: Callable[[], None]
    heal: Callable[[], None]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def veth_link(target_host: str, target_port: int) -> Iterator[Link]:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs root, ip and tc (a network namespace, a veth pair, the blackhole qdisc)")
    tag = f"{random.randrange(16**6):06x}"  # noqa: S311 - a name, not a secret
    ns, here, there = f"ojt{tag}", f"oj{tag}a", f"oj{tag}b"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"  # noqa: S311
    proxy: TcpProxy | None = None
    forwarder: subprocess.Popen[str] | None = None
    try:
        try:
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            _run("ip", "link", "set", there, "netns", ns)
            _run("ip", "addr", "add", f"{net}.1/30", "dev", here)
            _run("ip", "link", "set", here, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/30", "dev", there)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
            _run("tc", "qdisc", "add", "dev", here, "root", "blackhole")  # the fault can be set up
            _run("tc", "qdisc", "del", "dev", here, "root")
        except RuntimeError as exc:
            pytest.skip(f"cannot build the partition: {exc}")
        proxy = TcpProxy(target_host, target_port)
        proxy.listen_host = f"{net}.1"
        proxy.start()
        forwarder = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c",
             FORWARDER.format(root=str(ROOT), target=f"{net}.1", port=proxy.port, listen=f"{net}.2")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert forwarder.stdout is not None
        port = int(forwarder.stdout.readline())

        def drop() -> None:
            _run("tc", "qdisc", "add", "dev", here, "root", "blackhole")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", there, "root", "blackhole")

        def heal() -> None:
            _run("tc", "qdisc", "del", "dev", here, "root")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", there, "root")

        yield Link(host=f"{net}.2", port=port, drop=drop, heal=heal)
    finally:
        if forwarder is not None:
            forwarder.kill()
            forwarder.wait(10)
        if proxy is not None:
            proxy.stop()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)  # takes the pair along
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=20)


def test_a_partition_that_drops_packets_ends_the_pools_statements_and_stop_keeps_its_bound(conn, jobs_db) -> None:
    info = conninfo_to_dict(jobs_db)
    started, release = threading.Event(), threading.Event()
    events: list[dict[str, Any]] = []

    def work(ctx: Any) -> str:
        started.set()
        while not release.is_set():
            ctx.sleep(0.05)  # raises LeaseLost once cancelled
        return "ok"

    with veth_link(str(info.get("host") or "127.0.0.1"), int(str(info["port"]))) as link:
        pool = WorkerPool(WorkerConfig(dsn=make_conninfo(jobs_db, host=link.host, port=str(link.port)),
                                       max_concurrency=1, lease_duration_s=LEASE_S, heartbeat_interval_s=1.0,
                                       poll_interval_s=0.2, reconcile_interval_s=0.5, drain_timeout_s=1.0),
                          {"work": work}, log=recording_logger(events))
        pool.start()
        stopped = False
        try:
            enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="work", payload={})])
            assert started.wait(20)
            wait_until(lambda: pool.listening, timeout_s=10, message="listening")
            wait_until(lambda: rows(jobs_db, "SELECT heartbeat_at > started_at FROM jobs") == [(True,)],
                       timeout_s=10, message="a heartbeat renewed the lease")  # its connection is up
            link.drop()
            dropped = time.monotonic()
            # The heartbeat's next statement (within a second) and the dispatcher's next round
            # get no acknowledgement: they fail one lease (tcp_user_timeout) later.  The
            # listener's quiet connection is probed after a second idle and ends about a
            # lease after its last answer.
            for name in ("heartbeat_failed", "dispatch_failed", "listen_failed"):
                wait_until(lambda name=name: [e for e in events if e["event"] == name and e["at"] > dropped],
                           timeout_s=LEASE_S + 3.0,
                           message=lambda name=name: f"no {name} ({[e['event'] for e in events[-5:]]})")
            began = time.monotonic()
            pool.stop()
            stopped = True
            assert time.monotonic() - began <= 1.0 + STOP_GRACE_S + 0.75
        finally:
            release.set()
            link.heal()
            if not stopped:
                pool.stop()
    assert rows(jobs_db, "SELECT status FROM jobs") in ([("running",)], [("queued",)])  # left to its lease
