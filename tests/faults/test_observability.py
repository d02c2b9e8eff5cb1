"""A live relay scraped over HTTP (issue 6): metrics move as events flow, the oldest-age
gauge rises while the broker is unreachable and falls after, readiness fails while the
database is down, and /healthz only fails for a pipeline stuck with its dependencies up."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from tests.fixtures.broker import create_topic
from tests.fixtures.outbox import insert_rows, migrated, relay_cmd, relay_env, wait_drained
from tests.fixtures.procs import free_port, wait_until


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def sample(port: int, name: str, labels: str = "") -> float:
    _, text = get(port, "/metrics")
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels) if labels else ''}(\{{[^}}]*\}})? (\S+)$",
                         re.MULTILINE)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def wake_lines(port: int) -> str:
    return "; ".join(line for line in get(port, "/metrics")[1].splitlines()
                     if line.startswith(("outbox_relay_wakeups_total", "outbox_relay_sleeping")))


def asleep_and_listening(port: int) -> None:
    """Wait until the relay sleeps and has run its claim after taking the wake-up lock (rows
    committed before that claim are its, announced or not: "poll")."""
    wait_until(lambda: sample(port, "outbox_relay_sleeping") == 1, timeout_s=30,
               message="the idle relay never said it sleeps")
    claims = sample(port, "outbox_relay_claim_duration_seconds_count")
    wait_until(lambda: sample(port, "outbox_relay_claim_duration_seconds_count") > claims, timeout_s=30,
               message="no claim after the relay fell asleep")
    assert sample(port, "outbox_relay_sleeping") == 1


def test_metrics_move_and_the_oldest_age_rises_while_the_broker_is_cut(
        outbox_db, proxied_broker, topic_name, spawn):
    tansu, proxy = proxied_broker
    topic = topic_name("observed")
    create_topic(tansu.bootstrap, topic)
    port = free_port()
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        outbox_db, tansu.bootstrap, metrics_port=port, metrics_host="127.0.0.1"))
    wait_until(lambda: get(port, "/readyz")[0] == 200, timeout_s=30, message="never ready")
    insert_rows(outbox_db, topic, 500, keys=10)
    wait_drained(outbox_db)
    wait_until(lambda: sample(port, "outbox_relay_events_published_total") == 500, timeout_s=10)
    assert sample(port, "outbox_relay_batch_size_rows_count") >= 1
    assert sample(port, "outbox_relay_commit_to_ack_seconds_count") == 500

    proxy.cut()
    insert_rows(outbox_db, topic, 100, keys=10, start=500)
    wait_until(lambda: sample(port, "outbox_relay_oldest_pending_age_seconds") >= 3, timeout_s=30,
               message="the oldest-age gauge did not rise while the broker was cut")
    assert sample(port, "outbox_relay_pending_rows") == 100
    wait_until(lambda: get(port, "/readyz")[0] == 503, timeout_s=30)
    assert json.loads(get(port, "/readyz")[1])["broker"] is False
    assert get(port, "/healthz")[0] == 200  # an outage is not a stuck pipeline: no restart loop

    proxy.restore()
    wait_drained(outbox_db, timeout_s=60)
    wait_until(lambda: sample(port, "outbox_relay_oldest_pending_age_seconds") == 0, timeout_s=30,
               message="the oldest-age gauge did not fall after the broker came back")
    wait_until(lambda: get(port, "/readyz")[0] == 200, timeout_s=30)
    assert sample(port, "outbox_relay_events_published_total") == 600
    relay.sigterm()
    assert relay.wait(30) == 0


def test_a_relay_that_starts_while_kafka_is_cut_passes_its_startup_probe(outbox_db, proxied_broker, spawn):
    # The sidecar's startupProbe was /readyz, which asks for Kafka: every application pod that
    # started during a Kafka outage stayed out of its Service, and its relay was killed at the
    # probe's threshold (a review of deploy/).  /startupz asks for the database and the schema.
    tansu, proxy = proxied_broker
    proxy.cut()
    port = free_port()
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        outbox_db, tansu.bootstrap, metrics_port=port, metrics_host="127.0.0.1"))
    wait_until(lambda: get(port, "/startupz")[0] == 200, timeout_s=30, message="never started")
    wait_until(lambda: get(port, "/readyz")[0] == 503, timeout_s=30, message="ready with Kafka cut")
    status, body = get(port, "/startupz")
    assert status == 200 and json.loads(body) == {"ok": True, "database": True, "schema": True, "broker": False}
    proxy.restore()
    relay.sigterm()
    assert relay.wait(30) == 0


def test_readiness_fails_while_the_database_is_down(own_db_dsn, own_pg_running, broker, topic, spawn):
    dsn = migrated(own_db_dsn)
    port = free_port()
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        dsn, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1"))
    wait_until(lambda: get(port, "/readyz")[0] == 200, timeout_s=30, message="never ready")
    own_pg_running.stop()
    wait_until(lambda: get(port, "/readyz")[0] == 503, timeout_s=30,
               message="/readyz stayed green with the database down")
    assert json.loads(get(port, "/readyz")[1])["database"] is False
    assert sample(port, "outbox_relay_database_up") == 0
    own_pg_running.start()
    wait_until(lambda: get(port, "/readyz")[0] == 200, timeout_s=60,
               message="/readyz did not recover with the database")
    relay.sigterm()
    assert relay.wait(30) == 0


def test_healthz_fails_when_rows_are_pending_and_nothing_moves(outbox_db, broker, spawn):
    """Every lease held by a peer that went silent for an hour: rows pending, database and
    broker up, nothing published: /healthz goes red so the orchestrator notices."""
    port = free_port()
    # A peer holds every lease for a long time and is never heard from again.
    import psycopg

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("UPDATE outbox_relay_shards SET owner = 'ghost', token = token + 1, "
                     "lease_until = now() + interval '1 hour'")
        conn.execute("INSERT INTO outbox_relay_replicas (owner, seen_until) "
                     "VALUES ('ghost', now() + interval '1 hour')")
    insert_rows(outbox_db, "stuck-topic", 5, keys=1)
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        outbox_db, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1",
        stuck_after_s=2))
    wait_until(lambda: get(port, "/readyz")[0] == 200, timeout_s=30, message="never ready")
    wait_until(lambda: get(port, "/healthz")[0] == 503, timeout_s=30,
               message="/healthz stayed green with rows pending and nothing published")
    detail = json.loads(get(port, "/healthz")[1])
    assert detail["pending"] == 5
    relay.sigterm()
    assert relay.wait(30) == 0


def test_the_relay_says_when_it_sleeps_and_what_woke_it(outbox_db, broker, topic, spawn):
    """Asleep, writers notify the relay; rows that no notification announced (the trigger
    disabled here) wake it only at the poll, and ``outbox_relay_wakeups_total{reason="poll"}``
    is how an SRE sees writers waiting up to --poll-interval-s for it."""
    import psycopg

    port = free_port()
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        outbox_db, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1",
        poll_interval_s=2))
    asleep_and_listening(port)
    assert sample(port, "outbox_relay_wakeups_total", '{reason="notify"}') == 0
    assert sample(port, "outbox_relay_wakeups_total", '{reason="poll"}') == 0

    insert_rows(outbox_db, topic, 20, keys=4)
    wait_drained(outbox_db)
    wait_until(lambda: sample(port, "outbox_relay_wakeups_total", '{reason="notify"}') == 1,
               timeout_s=10, message=lambda: "a notified wake-up was not counted: " + wake_lines(port))
    assert sample(port, "outbox_relay_wakeups_total", '{reason="poll"}') == 0

    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify_insert")
    asleep_and_listening(port)
    insert_rows(outbox_db, topic, 20, keys=4, start=20)
    wait_drained(outbox_db)
    wait_until(lambda: sample(port, "outbox_relay_wakeups_total", '{reason="poll"}') == 1,
               timeout_s=10, message=lambda: "a wake-up at the poll was not counted: " + wake_lines(port))
    assert sample(port, "outbox_relay_wakeups_total", '{reason="notify"}') == 1
    assert sample(port, "outbox_relay_events_published_total") == 40
    relay.sigterm()
    assert relay.wait(30) == 0


def _shared_out(held: list[float]) -> bool:
    return min(held) > 0 and max(held) - min(held) <= 1


def test_beside_a_sleeping_replica_an_idle_one_claims_once_per_poll_interval(outbox_db, broker, spawn):
    """One replica holds the wake-up lock, so writers notify both; the other, refused the
    lock, waits on LISTEN until its poll.  It used to claim and try the lock at its pace
    instead, every 80 ms: 12.4 claims and 26.5 statements a second while nothing happened
    (two relays idle side by side, 2026-12-05); this test failed on that code."""
    import time

    ports = [free_port(), free_port()]
    relays = [spawn(relay_cmd("run"), name=f"relay-{n}", env=relay_env(
        outbox_db, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1",
        owner=f"idle-{n}", poll_interval_s=1)) for n, port in enumerate(ports)]
    # Measured once the shards are shared out: a lease moving inside the window makes a claim.
    wait_until(lambda: _shared_out([sample(port, "outbox_relay_leases_held") for port in ports]),
               timeout_s=30, message="the replicas did not share the shards")
    wait_until(lambda: sum(sample(port, "outbox_relay_sleeping") for port in ports) == 1, timeout_s=30,
               message="neither replica sleeps")
    awake = next(port for port in ports if sample(port, "outbox_relay_sleeping") == 0)
    claims, started = sample(awake, "outbox_relay_claim_duration_seconds_count"), time.monotonic()
    wait_until(lambda: sample(awake, "outbox_relay_claim_duration_seconds_count") >= claims + 5,
               timeout_s=30, message="the awake replica stopped claiming")
    assert time.monotonic() - started >= 3.0, "five claims in under 3 s: it claims at its pace, not its poll"
    assert sum(sample(port, "outbox_relay_sleeping") for port in ports) == 1
    for relay in relays:
        relay.sigterm()
        assert relay.wait(30) == 0
