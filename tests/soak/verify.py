"""The end of a soak: wait for the drain, read the topics back and check every event,
effect, job and dead letter against the outbox (the part of :class:`~tests.soak.run.Soak`
that fills most of the :class:`~tests.soak.config.SoakReport`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from tests.fixtures.broker import KafkaRecord
from tests.soak.config import (
    _KAFKA_LOG,
    DLQ_TOPIC,
    GROUP,
    JOB_EVERY,
    TOPIC,
    _scalar,
)
from tests.soak.state import SoakState


class Verification(SoakState):
    """Mixin of :class:`~tests.soak.run.Soak`: drain, verify, report."""

    if TYPE_CHECKING:
        def _progress(self, phase: str) -> None: ...

        def _status(self) -> dict[str, int] | None: ...

        def _watch(self) -> None: ...

    def _drain(self) -> None:
        """Wait until every written event is published and applied (and every job done)."""
        started = time.monotonic()
        deadline = started + self.cfg.drain_timeout_s
        next_progress = started + 10
        while True:
            self._watch()
            st = self._status()
            if st is not None and st["pending"] == 0 and st["effects"] >= st["written"] \
                    and st["poison_left"] == 0 and st["jobs_open"] == 0:
                self.report.drained = True
                break
            if time.monotonic() >= deadline:
                break
            if time.monotonic() >= next_progress:
                next_progress += 10
                self._progress("draining")
            time.sleep(0.5)  # noqa: TID251 - polling interval of the drain condition
        self.report.drain_s = time.monotonic() - started
        self.say(f"drained={self.report.drained} after {self.report.drain_s:.1f} s")

    def _verify(self) -> None:
        r = self.report
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            written = {str(e): (k, int(s)) for e, k, s in conn.execute(
                "SELECT event_id, key, (payload->>'seq')::bigint FROM outbox WHERE key LIKE 'k%%'")}
            r.written = len(written)
            r.published = _scalar(conn, "SELECT count(*) FROM outbox WHERE key LIKE 'k%%' "
                                        "AND published_at IS NOT NULL")
            effects: dict[str, int] = dict(
                conn.execute("SELECT event_id::text, count(*) FROM soak_effects GROUP BY 1").fetchall())
            self._applied = effects.keys() & written.keys()
            r.effects_applied = len(self._applied)
            r.effect_duplicates = len([n for n in effects.values() if n > 1])
            r.effects_unknown = len(effects.keys() - written.keys())
            r.effect_order_violations = int(_scalar(conn, "SELECT coalesce(sum(regressions), 0) FROM soak_keys"))
            r.duplicates_dropped = _scalar(conn, "SELECT count(*) FROM soak_dups")
            dead = conn.execute("SELECT event_id::text, reason FROM outbox_dead_letters").fetchall()
            poison = set(self.poison_ids)
            r.poison_rows = len(poison)
            r.poison_dead_lettered = sum(1 for e, _ in dead if e in poison)
            r.good_rows_dead_lettered = sum(1 for e, _ in dead if e not in poison)
            if self.jobs_enabled:
                self._verify_jobs(conn, written)
        records = self._read_topic(TOPIC)
        first_seq: dict[str, int] = {}
        partitions: dict[str, set[int]] = {}
        delivered: set[str] = set()
        for rec in records:
            if "soak_bad" in rec.headers:
                continue
            r.kafka_records += 1
            event_id = rec.headers.get("event_id", b"").decode()
            if event_id in delivered:
                r.duplicates_delivered += 1
                continue
            delivered.add(event_id)
            body = json.loads(rec.value or b"{}")
            key, seq = body.get("key"), body.get("seq")
            if event_id not in written:
                r.unknown_delivered += 1
                if len(r.unknown_sample) < 10:
                    r.unknown_sample.append(f"{event_id} {key} seq {seq} (p{rec.partition}@{rec.offset})")
                continue
            partitions.setdefault(key, set()).add(rec.partition)
            if seq <= first_seq.get(key, 0):
                r.order_violations += 1
                if len(r.order_samples) < 10:
                    r.order_samples.append(f"{key}: seq {seq} after {first_seq[key]} (p{rec.partition}@{rec.offset})")
            first_seq[key] = max(seq, first_seq.get(key, 0))
        r.delivered_unique = len(delivered & written.keys())
        missing = written.keys() - delivered
        r.lost = len(missing)
        r.lost_sample = sorted(missing)[:10]
        if missing:
            self._diagnose_lost(missing, records)
        unapplied = written.keys() - self._applied
        if unapplied:
            self._diagnose_unapplied(unapplied, records)
        r.keys_on_several_partitions = sum(1 for p in partitions.values() if len(p) > 1)
        self._verify_dead_letters()

    def _diagnose_lost(self, missing: set[str], records: list[KafkaRecord]) -> None:
        """Where the consumers read each lost event (the inbox keeps the position of the
        applied copy) and what the topic holds there now: tells a relay that never
        published from a broker that lost or overwrote an acknowledged record."""
        at = {(rec.partition, rec.offset): rec for rec in records}
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT o.event_id::text, o.key, o.payload->>'seq', o.published_at, i.kafka_partition, "
                "i.kafka_offset, i.received_at FROM outbox o LEFT JOIN outbox_inbox i "
                "ON i.event_id = o.event_id AND i.consumer = %s WHERE o.event_id = ANY(%s::uuid[]) "
                "ORDER BY i.kafka_partition, i.kafka_offset", (GROUP, sorted(missing))).fetchall()
        lines = []
        for event_id, key, seq, published_at, partition, offset, received_at in rows:
            now = at.get((partition, offset))
            there = ("nothing" if now is None else
                     f"{now.headers.get('event_id', b'?').decode()} key {now.key!r}")
            lines.append(f"{event_id} {key} seq {seq} published {published_at}: applied from "
                         f"p{partition}@{offset} at {received_at}; the topic holds {there} there now")
        self.report.lost_detail = lines[:50]
        (self.workdir / "lost.txt").write_text("\n".join(lines) + "\n")

    def _diagnose_unapplied(self, unapplied: set[str], records: list[KafkaRecord]) -> None:
        """Where the events no consumer applied sit in the topic, against the group's
        committed offsets: offsets committed past them (skipped) or not (never consumed)."""
        where: dict[int, list[int]] = {}
        seen: set[str] = set()
        for rec in records:
            event_id = rec.headers.get("event_id", b"").decode()
            if event_id in unapplied and event_id not in seen:
                seen.add(event_id)
                where.setdefault(rec.partition, []).append(rec.offset)
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": GROUP, "logger": _KAFKA_LOG,
                             "enable.auto.commit": False})
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(
                [TopicPartition(TOPIC, p) for p in range(self.cfg.partitions)], timeout=30)}
        except Exception as exc:  # noqa: BLE001 - a diagnosis only
            committed = {}
            self.say(f"committed offsets unavailable: {exc}")
        finally:
            consumer.close()
        lines = [f"{len(unapplied)} written events have no effect; {len(unapplied) - len(seen)} of them are not "
                 f"in the topic at all"]
        for partition, offsets in sorted(where.items()):
            lines.append(f"p{partition}: {len(offsets)} unapplied at offsets {min(offsets)}..{max(offsets)}; "
                         f"group {GROUP!r} committed offset {committed.get(partition)}; "
                         f"{self._polled_by(partition, offsets)}")
        self.report.unapplied_detail = lines
        (self.workdir / "unapplied.txt").write_text("\n".join(lines) + "\n")

    def _polled_by(self, partition: int, offsets: list[int]) -> str:
        """Which consumer members' polls returned these offsets (their ``soak_polled`` lines):
        none means the broker never served them to the group."""
        wanted, found, jumps = set(offsets), [], []
        for log in sorted(self.workdir.glob("c*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if '"soak_polled"' not in line and '"soak_offset_jump"' not in line:
                    continue
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "soak_offset_jump":
                    if entry.get("partition") == partition and entry["after"] < min(wanted) and entry["to"] > max(wanted):
                        jumps.append(f"{log.stem} received offset {entry['to']} right after {entry['after']} "
                                     f"at {entry.get('timestamp')}")
                    continue
                for span in entry.get("offsets", {}).get(f"p{partition}", []):
                    low, high = (int(x) for x in span.split("-"))
                    if wanted & set(range(low, high + 1)):
                        found.append(f"{log.stem} at {entry.get('timestamp')} ({span})")
        said = "polled by " + ", ".join(found) if found else "no member's poll returned them"
        if jumps:
            said += "; the broker served later offsets first: " + ", ".join(jumps)
        return said

    def _verify_jobs(self, conn: psycopg.Connection[Any], written: dict[str, tuple[str, int]]) -> None:
        r = self.report
        r.jobs_enabled = True
        r.jobs_expected = sum(1 for _k, s in written.values() if s % JOB_EVERY == 0)
        rows = conn.execute(
            "SELECT j.id, j.status, (SELECT count(*) FROM soak_job_effects e WHERE e.job_id = j.id) "
            "FROM jobs j WHERE j.queue = 'soak'").fetchall()
        r.jobs_enqueued = len(rows)
        r.jobs_not_succeeded = sum(1 for _i, status, _n in rows if status != "succeeded")
        r.job_effects_duplicated = sum(1 for _i, _s, n in rows if n > 1)
        r.job_effects_missing = sum(1 for _i, _s, n in rows if n == 0)
        r.jobs_completed_once = sum(1 for _i, status, n in rows if status == "succeeded" and n == 1)
        r.jobs_dead_lettered = _scalar(conn, "SELECT count(*) FROM job_dead_letters WHERE queue = 'soak'")

    def _read_topic(self, topic: str, quiet_s: float = 3.0, timeout_s: float = 600.0) -> list[KafkaRecord]:
        """Every record of ``topic``, through the proxy, ordered by (partition, offset).

        Reads each partition from the beginning (assign, no group) until every partition
        reported its end and nothing new came for ``quiet_s``: the topic is quiet by now,
        and unlike a count or a high watermark taken beforehand this cannot stop short
        (a stale watermark is reported in ``watermark_mismatches``).
        """
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "logger": _KAFKA_LOG,
                             "group.id": f"soak-verify-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False,
                             "enable.partition.eof": True, "fetch.wait.max.ms": 50,
                             "auto.offset.reset": "earliest"})
        records: list[KafkaRecord] = []
        try:
            parts = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
            marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
            at_end: set[int] = set()
            deadline = time.monotonic() + timeout_s
            last_new = time.monotonic()
            while time.monotonic() < deadline:
                batch = consumer.consume(num_messages=1000, timeout=0.2)
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            at_end.add(msg.partition() or 0)
                        continue
                    at_end.discard(msg.partition() or 0)
                    last_new = time.monotonic()
                    raw = msg.headers() or []
                    pairs: list[tuple[str, Any]] = list(raw.items() if isinstance(raw, dict) else raw)
                    records.append(KafkaRecord(
                        topic=topic, partition=msg.partition() or 0, offset=msg.offset() or 0, key=msg.key(),
                        value=msg.value(), timestamp_ms=None,
                        headers={k: (v.encode() if isinstance(v, str) else (v or b"")) for k, v in pairs}))
                if at_end == set(parts) and time.monotonic() - last_new >= quiet_s:
                    break
            else:
                raise RuntimeError(f"reading {topic} did not reach the end within {timeout_s} s")
        finally:
            consumer.close()
        records.sort(key=lambda rec: (rec.partition, rec.offset))
        ends: dict[int, int] = {}
        for rec in records:
            ends[rec.partition] = max(ends.get(rec.partition, 0), rec.offset + 1)
        for p, high in marks.items():
            if ends.get(p, 0) != high:
                self.report.watermark_mismatches.append(
                    f"{topic}[{p}]: high watermark {high} before reading, last offset read + 1 = {ends.get(p, 0)}")
        if topic == TOPIC:
            self.report.partition_records = {f"p{p}": sum(1 for r in records if r.partition == p) for p in parts}
        return records

    def _verify_dead_letters(self) -> None:
        r = self.report
        r.bad_messages_sent = len(self.bad_messages)
        letters = self._read_topic(DLQ_TOPIC)
        seen: set[str] = set()
        for rec in letters:
            bad_id = rec.headers.get("soak_bad")
            if bad_id is None:
                r.good_events_dead_lettered += 1
                continue
            key = bad_id.decode()
            if self.bad_messages.get(key) == rec.headers.get("dlq_reason", b"").decode():
                seen.add(key)
            else:
                r.bad_input_failures.append(f"bad message {key}: dead-lettered with "
                                            f"{rec.headers.get('dlq_reason')!r}, expected {self.bad_messages.get(key)!r}")
        r.bad_messages_dead_lettered = len(seen)

    def _finish_report(self) -> None:
        r, w = self.report, self.writers
        assert w is not None
        r.written_tx = w.transactions
        r.writer_failed_tx = w.failed
        r.writer_unknown_outcome_tx = w.unknown
        write_s = max(1e-9, w.stopped_at - w.started_at)
        r.events_per_s_held = r.written / write_s
        r.slowest_window_events_per_s = w.slowest_window()
        r.peak_backlog = self.peak_backlog
        r.faults_by_kind = dict(sorted(self.faults.items()))
        r.bad_inputs_by_kind = dict(sorted(self.bad_inputs.items()))
        r.jobs_enabled = self.jobs_enabled
        r.jobs_note = self.jobs_note
        r.unexpected_exits = [e for m in self.members.values() for e in m.unexpected_exits]
        r.wall_s = time.monotonic() - self.t0
        r.fault_log = sorted(self.fault_log)
        (self.workdir / "faults.txt").write_text("\n".join(r.fault_log) + "\n")
