"""Rows that can never be published (issue 5): forced against the real broker, dead-lettered
with a readable reason, other keys flowing, the poison key's later rows after it."""

from __future__ import annotations

import json
import random
import subprocess

import psycopg

from tests.fixtures.broker import create_topic, read_all
from tests.fixtures.outbox import HeldTransaction, RelayThread, relay_cmd, scalar, wait_drained
from tests.fixtures.procs import wait_until

MAX_BYTES = 100_000  # the producer's message.max.bytes in these tests


def relay(dsn: str, bootstrap: str) -> RelayThread:
    thread = RelayThread(dsn, bootstrap, max_attempts=2, backoff_max_s=0.5, batch_size=50)
    s = thread.relay.settings
    props = dict(s.kafka_properties, **{"message.max.bytes": str(MAX_BYTES),
                                        "allow.auto.create.topics": "false",
                                        "topic.metadata.propagation.max.ms": "1000"})
    object.__setattr__(s, "kafka_properties", props)
    return thread


def write(conn: psycopg.Connection, topic: str, key: str, seq: int, *, pad: int = 0,
          headers: str = "{}") -> None:
    conn.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, %s, %s, %s)",
                 (topic, key, json.dumps({"key": key, "seq": seq, "pad": "x" * pad}), headers))


def dead_letters(dsn: str) -> list[dict]:
    out = subprocess.run(relay_cmd("dead-letters", "list", "--json", "--dsn", dsn),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_poison_rows_are_dead_lettered_and_nothing_else_waits(outbox_db, broker, topic, topic_name):
    missing_topic = topic_name("not-created")
    # A writer idle in transaction from before the first row to the end: it holds back
    # nothing but its own row, also through the back-off waits (issue 14).
    with HeldTransaction(outbox_db, topic_name("held")):
        with psycopg.connect(outbox_db, autocommit=True) as conn:
            write(conn, topic, "big", 0, pad=MAX_BYTES * 2)                  # too large
            write(conn, topic, "big", 1)                                     # the same key, fine
            write(conn, topic, "hdr", 0, headers='{"retries": 3}')           # a header that is not a string
            write(conn, topic, "hdr", 1)
            write(conn, missing_topic, "lost", 0)                            # unknown topic, no auto-create
            conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'huge', %s)",
                         (topic, json.dumps({"pad": "y" * 20_000_000})))     # 20 MB
            for seq in range(200):
                write(conn, topic, f"ok{seq % 10}", seq // 10)
        with relay(outbox_db, broker.bootstrap) as r:
            wait_drained(outbox_db, timeout_s=90)
            dead = wait_until(lambda: (d := dead_letters(outbox_db)) and len(d) == 4 and d, timeout_s=30)
            registry = r.metrics.registry
            # The counter moves just after the dead-letter move commits: wait for it.
            wait_until(lambda: registry.get_sample_value(
                "outbox_relay_dead_lettered_total", {"reason": "message_too_large"}) == 2,
                timeout_s=10, message="outbox_relay_dead_lettered_total{reason=message_too_large}")
    reasons = {d["key"]: d["reason"] for d in dead}
    assert reasons == {"big": "message_too_large", "huge": "message_too_large",
                       "hdr": "bad_headers", "lost": "unknown_topic"}
    for d in dead:  # too large: dead-lettered by its size at once, its payload never fetched
        assert d["attempts"] == (1 if d["reason"] == "message_too_large" else 2), d
        assert d["error"] and d["event_id"] and d["topic"]
    # Everything else arrived, and each poison key's later row came after it was dead-lettered.
    records = read_all(broker.bootstrap, topic, expected=202, timeout_s=60)
    keys = [json.loads(r.value)["key"] for r in records]
    assert len(records) == 202 and keys.count("big") == 1 and keys.count("hdr") == 1
    later = {json.loads(r.value)["key"]: json.loads(r.value)["seq"] for r in records
             if json.loads(r.value)["key"] in ("big", "hdr")}
    assert later == {"big": 1, "hdr": 1}
    assert scalar(outbox_db, "SELECT count(*) FROM outbox WHERE key IN ('big','hdr','lost','huge')") == 2
    # The key's later row waited for the poison row: published only once it was dead-lettered.
    waited = scalar(outbox_db, "SELECT bool_and(o.published_at >= d.dead_at) FROM outbox o "
                               "JOIN outbox_dead_letters d USING (key) WHERE o.key IN ('big', 'hdr')")
    assert waited is True


def test_requeue_republishes_with_the_same_event_id_after_the_cause_is_fixed(
        outbox_db, broker, topic_name):
    missing_topic = topic_name("created-later")
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        write(conn, missing_topic, "k", 0)
    with relay(outbox_db, broker.bootstrap):
        wait_drained(outbox_db, timeout_s=60)
        (dead,) = wait_until(lambda: dead_letters(outbox_db), timeout_s=30)
        create_topic(broker.bootstrap, missing_topic, partitions=1)
        shown = json.loads(subprocess.run(relay_cmd("dead-letters", "show", dead["event_id"], "--dsn",
                                                    outbox_db), capture_output=True, text=True,
                                          check=True).stdout)
        assert shown["reason"] == "unknown_topic" and json.loads(shown["payload"])["key"] == "k"
        # In capitals and braces, as PostgreSQL reads it too: requeued, and not said to be
        # missing after (the ids moved were told from the ones given by their text).
        given = "{" + dead["event_id"].upper() + "}"
        out = subprocess.run(relay_cmd("dead-letters", "requeue", given, "--dsn", outbox_db),
                             capture_output=True, text=True)
        assert out.returncode == 0 and "requeued 1" in out.stdout, out.stderr
        wait_drained(outbox_db, timeout_s=60)
    (record,) = read_all(broker.bootstrap, missing_topic, expected=1, timeout_s=30)
    assert record.headers["event_id"].decode() == dead["event_id"]
    assert dead_letters(outbox_db) == []
    purge = subprocess.run(relay_cmd("dead-letters", "purge", "--dsn", outbox_db),
                           capture_output=True, text=True)
    assert purge.returncode == 2 and "needs EVENT_ID arguments or --all" in purge.stderr
    # What is not there is "not found" (exit 1), as in the jobs CLI, not a usage error (2).
    gone = subprocess.run(relay_cmd("dead-letters", "show", dead["event_id"], "--dsn", outbox_db),
                          capture_output=True, text=True)
    assert gone.returncode == 1 and f"no dead letter with event_id {dead['event_id']}" in gone.stderr
    assert "Traceback" not in gone.stderr
    unknown = "6802ca8b-db27-41d2-9955-ed1884f2bd28"
    for action in ("requeue", "purge"):  # a mistyped id said "requeued 0" and exit 0
        typo = subprocess.run(relay_cmd("dead-letters", action, unknown, "--dsn", outbox_db),
                              capture_output=True, text=True)
        assert typo.returncode == 1 and f"no dead letter with event_id {unknown}" in typo.stderr
        # Python's uuid.UUID reads a "urn:uuid:" prefix that PostgreSQL's uuid input refuses.
        for bad in ("not-a-uuid", f"urn:uuid:{unknown}"):
            malformed = subprocess.run(relay_cmd("dead-letters", action, bad, "--dsn", outbox_db),
                                       capture_output=True, text=True)
            assert malformed.returncode == 2 and f"{bad!r} is not an event_id" in malformed.stderr
    cancel = subprocess.run(relay_cmd("replay", "cancel", "4242", "--dsn", outbox_db),
                            capture_output=True, text=True)
    assert cancel.returncode == 1 and "no active replay 4242" in cancel.stderr


def test_dead_letter_topic_gets_the_row_with_its_reason(outbox_db, broker, topic, topic_name):
    dlt = topic_name("dlt")
    create_topic(broker.bootstrap, dlt, partitions=1)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        write(conn, topic, "hdr", 0, headers='{"retries": 3}')
        write(conn, topic, "big", 0, pad=MAX_BYTES * 2)
        write(conn, topic, "fine", 0)
    thread = relay(outbox_db, broker.bootstrap)
    object.__setattr__(thread.relay.settings, "dead_letter_topic", dlt)
    with thread:
        wait_drained(outbox_db, timeout_s=60)
    records = {r.key: r for r in read_all(broker.bootstrap, dlt, expected=2, timeout_s=30)}
    assert set(records) == {b"hdr", b"big"}
    hdr = records[b"hdr"]
    assert hdr.headers["dlt_reason"] == b"bad_headers" and hdr.headers["dlt_topic"] == topic.encode()
    assert json.loads(hdr.headers["dlt_original_headers"]) == {"retries": 3}
    assert json.loads(hdr.value)["key"] == "hdr"  # the original value travels along
    assert records[b"big"].value is None and records[b"big"].headers["dlt_reason"] == b"message_too_large"
    assert len(dead_letters(outbox_db)) == 2  # and both are in the dead-letter table too
    # The attempts made, as the table records them: a row dead-lettered by its size at once
    # made one (the letter said max_attempts, 2 here, and so did the log).
    attempts = {d["key"]: d["attempts"] for d in dead_letters(outbox_db)}
    assert attempts == {"big": 1, "hdr": 2}
    assert {k: int(r.headers["dlt_attempts"]) for k, r in records.items()} == {b"big": 1, b"hdr": 2}


def test_a_row_over_the_limit_by_its_key_or_headers_is_dead_lettered_and_its_key_waits_for_it(
        outbox_db, broker, topic, topic_name):
    """The producer counts key and headers against message.max.bytes too.  The claim used to
    size a row by its payload alone: a row with a huge key or huge headers came whole into
    the relay (a backlog of them killed it in a 256 MiB cgroup, tests/faults/test_memory_bound.py)
    and its dead-letter record was as large.  Now it is dead-lettered by its size like a huge
    payload; a key or headers of a quarter of the limit or more stay in the database (the
    dead-letter table keeps them), and the dead-letter topic's record stays small."""
    dlt = topic_name("dlt")
    create_topic(broker.bootstrap, dlt, partitions=1)
    long_key = "k" * (MAX_BYTES * 2)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, %s, '{}')",
                     (topic, long_key))                                           # key over the limit
        write(conn, topic, "hdr", 0, headers=json.dumps({"pad": "h" * MAX_BYTES}))  # headers over it
        write(conn, topic, "hdr", 1)
        write(conn, topic, "sum", 0, pad=MAX_BYTES * 4 // 5,                     # over it together
              headers=json.dumps({"pad": "h" * (MAX_BYTES // 5)}))
        write(conn, topic, "fine", 0)
    thread = relay(outbox_db, broker.bootstrap)
    object.__setattr__(thread.relay.settings, "dead_letter_topic", dlt)
    with thread:
        wait_drained(outbox_db, timeout_s=60)
    records = read_all(broker.bootstrap, dlt, expected=3, timeout_s=30)
    assert sorted(r.headers["dlt_reason"] for r in records) == [b"message_too_large"] * 3
    assert all(r.value is None for r in records)
    by_key = {r.key: r for r in records}
    assert set(by_key) == {None, b"hdr", b"sum"}  # the long key stayed in the database
    assert "dlt_original_headers" not in by_key[b"hdr"].headers  # as did those headers
    assert json.loads(by_key[b"sum"].headers["dlt_original_headers"]) == {"pad": "h" * (MAX_BYTES // 5)}
    dead = {d["key"] if len(d["key"]) < 10 else "long": d["reason"] for d in dead_letters(outbox_db)}
    assert dead == {"long": "message_too_large", "hdr": "message_too_large", "sum": "message_too_large"}
    assert scalar(outbox_db, "SELECT length(key) FROM outbox_dead_letters WHERE left(key, 3) = 'kkk'") == len(long_key)
    published = {r.key for r in read_all(broker.bootstrap, topic, expected=2, timeout_s=30)}
    assert published == {b"hdr", b"fine"}  # hdr's second row, after its first was dead-lettered


def test_a_row_the_client_refuses_at_produce_is_dead_lettered_at_once_and_nothing_waits(
        outbox_db, broker, topic):
    """A jsonb payload stored in 25 kB whose text, every control character escaped, is about
    137 kB: the claim trusts the stored size (under half the limit), and the client refuses the
    record at produce().  That refusal was taken for a record batch's, the row sent alone
    again and again, a transient back-off each time, for ever: its key's later row waited,
    and every other key's rows waited about a second per turn (an audit with hostile rows)."""
    chars = random.Random(7)
    escaped = "".join(chr(chars.randint(1, 31)) for _ in range(25_000))
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'esc', %s)",
                     (topic, json.dumps({"key": "esc", "seq": 0, "pad": escaped})))
        write(conn, topic, "esc", 1)
        for seq in range(100):
            write(conn, topic, f"ok{seq % 10}", seq // 10)
        stored, text = conn.execute("SELECT pg_column_size(payload), octet_length(payload::text) FROM outbox "
                                    "WHERE key = 'esc' ORDER BY id LIMIT 1").fetchone()
    assert stored <= MAX_BYTES // 2 < MAX_BYTES < text, (stored, text)  # what the claim trusts, what Kafka gets
    with relay(outbox_db, broker.bootstrap) as r:
        wait_drained(outbox_db, timeout_s=60)
        failed = r.metrics.registry.get_sample_value("outbox_relay_publish_errors_total",
                                                     {"error_class": "message_too_large"})
    (dead,) = dead_letters(outbox_db)
    assert (dead["key"], dead["reason"], dead["attempts"]) == ("esc", "message_too_large", 1), dead
    assert "refused it at produce" in dead["error"]
    assert failed == 1  # refused once, not sent alone again and again
    records = read_all(broker.bootstrap, topic, expected=101, timeout_s=60)
    assert sorted(json.loads(r.value)["key"] for r in records).count("esc") == 1


def test_a_dead_letter_over_the_limit_with_its_value_goes_without_it(outbox_db, broker, topic, topic_name):
    """A row refused for its headers whose value is just under the limit: the dead letter,
    value plus the dlt_ headers, was over it, refused, and the row retried every second for
    ever (310 attempts of 3 in an audit), its key's later rows held.  The letter now goes
    without the value (the dead-letter table keeps it) and says so."""
    dlt = topic_name("dlt")
    create_topic(broker.bootstrap, dlt, partitions=1)
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        write(conn, topic, "near", 0, pad=MAX_BYTES - 300, headers='{"n": 1}')  # bad_headers
        write(conn, topic, "near", 1)
        write(conn, topic, "fine", 0)
    thread = relay(outbox_db, broker.bootstrap)
    object.__setattr__(thread.relay.settings, "dead_letter_topic", dlt)
    with thread:
        wait_drained(outbox_db, timeout_s=60)
    (letter,) = read_all(broker.bootstrap, dlt, expected=1, timeout_s=30)
    assert letter.value is None and letter.headers["dlt_reason"] == b"bad_headers"
    assert b"over message.max.bytes" in letter.headers["dlt_value_dropped"]
    (dead,) = dead_letters(outbox_db)
    assert (dead["key"], dead["reason"], dead["attempts"]) == ("near", "bad_headers", 2), dead
    assert scalar(outbox_db, "SELECT octet_length(payload::text) FROM outbox_dead_letters") > MAX_BYTES - 300
    published = [json.loads(r.value) for r in read_all(broker.bootstrap, topic, expected=2, timeout_s=30)]
    assert sorted((p["key"], p["seq"]) for p in published) == [("fine", 0), ("near", 1)]
