"""Memory is bounded by bytes, not rows (issue 15, item 1).

Six rows of 20 MB in a backlog of 100,000 ordinary rows, the relay in a memory cgroup of
256 MiB, as in deploy/k8s: the big rows are dead-lettered by their size without their
payload ever reaching the relay, everything else is published, and the process's peak
RSS stays under 150 MB.  (Before: a 7-row batch carried 120 MB of payload; the pod was
killed before it could dead-letter anything, and so was every replica after it.)
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.fixtures.broker import read_all
from tests.fixtures.outbox import insert_rows, relay_cmd, relay_env, scalar, wait_drained
from tests.fixtures.procs import wait_until

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
LIMIT_BYTES = 256 << 20
BIG_ROWS, BIG_BYTES, BACKLOG = 6, 20_000_000, 100_000
REPLAY_ROWS, REPLAY_BYTES = 600, 600_000  # published rows under the producer's 1 MB limit


@pytest.fixture
def memory_cgroup():
    """A cgroup-v1 memory cgroup limited to 256 MiB (needs root and a writable hierarchy)."""
    group = CGROUP_ROOT / f"outbox_test_{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
    except OSError as exc:
        reason = f"no writable memory cgroup at {CGROUP_ROOT}: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
        except OSError:
            pass


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def relay_in(memory_cgroup: Path, spawn: Any, dsn: str, bootstrap: str, **env: Any) -> Any:
    """A relay that joins the cgroup before it execs, so every byte it ever maps counts."""
    cmd = ["sh", "-c", f'echo $$ > {memory_cgroup / "cgroup.procs"} && exec "$@"', "relay",
           *relay_cmd("run")]
    return spawn(cmd, env=relay_env(dsn, bootstrap, **env), name="relay")


def stopped_with_peak_rss_mb(relay: Any) -> float:
    """The live relay's peak RSS, after which it stops cleanly."""
    assert relay.alive, relay.log_tail()
    peak = peak_rss_mb(relay.pid)
    relay.sigterm()
    assert relay.wait(30) == 0, relay.log_tail()
    print(f"relay peak RSS {peak:.1f} MB")
    return peak


def test_huge_rows_in_a_backlog_stay_under_the_memory_limit(outbox_db, broker, topic, spawn,
                                                            memory_cgroup):
    insert_rows(outbox_db, topic, BACKLOG // 2, per_tx=10_000)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for i in range(BIG_ROWS):
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES "
                         "(%s, %s, jsonb_build_object('pad', repeat('y', %s)))",
                         (topic, f"big{i}", BIG_BYTES))
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'small', %s)",
                     (topic, json.dumps({"key": "small", "seq": 0})))
    insert_rows(outbox_db, topic, BACKLOG // 2, start=BACKLOG // 2, per_tx=10_000)
    relay = relay_in(memory_cgroup, spawn, outbox_db, broker.bootstrap, max_attempts=5)
    wait_drained(outbox_db, timeout_s=180)
    peak = stopped_with_peak_rss_mb(relay)
    print(f"cgroup limit hits {int((memory_cgroup / 'memory.failcnt').read_text())}")
    assert peak < 150, peak
    dead = dict(scalar(outbox_db, "SELECT json_object_agg(key, reason) FROM outbox_dead_letters"))
    assert dead == {f"big{i}": "message_too_large" for i in range(BIG_ROWS)}
    assert scalar(outbox_db, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") == BACKLOG + 1


def test_huge_keys_and_headers_in_a_backlog_stay_under_the_memory_limit(outbox_db, broker, topic, spawn,
                                                                        memory_cgroup):
    insert_rows(outbox_db, topic, BACKLOG // 2, per_tx=10_000)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        for i in range(BIG_ROWS):
            conn.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES "
                         "(%s, %s, '{}', jsonb_build_object('pad', repeat('h', %s)))",
                         (topic, f"bighdr{i}", BIG_BYTES))
        for i in range(BIG_ROWS):
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES "
                         "(%s, %s || repeat('k', %s), '{}')", (topic, f"bigkey{i}", BIG_BYTES))
    insert_rows(outbox_db, topic, BACKLOG // 2, start=BACKLOG // 2, per_tx=10_000)
    relay = relay_in(memory_cgroup, spawn, outbox_db, broker.bootstrap, max_attempts=5)
    wait_drained(outbox_db, timeout_s=180)
    peak = stopped_with_peak_rss_mb(relay)
    assert peak < 150, peak
    dead = dict(scalar(outbox_db, "SELECT json_object_agg(left(key, 12), reason) FROM outbox_dead_letters"))
    assert dead == {**{f"bighdr{i}": "message_too_large" for i in range(BIG_ROWS)},
                    **{f"bigkey{i}".ljust(12, "k"): "message_too_large" for i in range(BIG_ROWS)}}
    assert scalar(outbox_db, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL") == BACKLOG


def test_a_replay_of_large_rows_stays_under_the_memory_limit(outbox_db, broker, topic, spawn, memory_cgroup):
    """Replays read published rows, each as large as the producer allowed.  A replay read up
    to 500 rows a batch, a batch per shard in flight, up to a second of its rate: 600 rows
    of 600 kB (360 MB) killed the relay in its 256 MiB cgroup, and every replica that took
    the replay over after it.  Now the batches in flight hold --batch-max-bytes together."""
    with psycopg.connect(outbox_db, autocommit=True) as conn:  # published an hour ago
        conn.execute("INSERT INTO outbox (topic, key, payload, created_at, published_at) "
                     "SELECT %s, 'k' || g %% 50, jsonb_build_object('n', g, 'pad', repeat('r', %s)), "
                     "now() - interval '1 hour', now() - interval '59 minutes' "
                     "FROM generate_series(1, %s) AS g", (topic, REPLAY_BYTES, REPLAY_ROWS))
    relay = relay_in(memory_cgroup, spawn, outbox_db, broker.bootstrap)
    made = subprocess.run(relay_cmd("replay", "--since", "2h", "--topic", topic, "--json"),
                          env=relay_env(outbox_db, ""), capture_output=True, text=True, timeout=60,
                          check=False)
    assert made.returncode == 0, made.stderr
    replay_id = int(json.loads(made.stdout)["id"])
    state = "SELECT state FROM outbox_relay_replays WHERE id = %(id)s"
    wait_until(lambda: scalar(outbox_db, state, {"id": replay_id}) == "done" or not relay.alive,
               timeout_s=180, message="the replay did not finish")
    peak = stopped_with_peak_rss_mb(relay)
    assert peak < 150, peak
    records = read_all(broker.bootstrap, topic, expected=REPLAY_ROWS, timeout_s=120)
    assert {r.headers.get("replay_id") for r in records} == {str(replay_id).encode()}
    assert len({r.headers["event_id"] for r in records}) == REPLAY_ROWS
