"""Fault injection: the part of :class:`~tests.soak.run.Soak` that carries out one planned
:class:`~tests.soak.plan.Fault` (``_do_<kind>``) and heals whatever is left at the end."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from confluent_kafka import Producer

from consumer_sdk import DuplicateEvent, InvalidEvent, TransactionRequired, write_event
from tests.soak.config import _KAFKA_LOG, BAD_INPUTS, POISON_PAD, TOPIC, _scalar
from tests.soak.plan import Fault
from tests.soak.state import SoakState


class FaultInjection(SoakState):
    """Mixin of :class:`~tests.soak.run.Soak`: the ``_do_<kind>`` methods, one per fault kind
    and bad input, run by ``_inject`` in a thread of their own."""

    def _inject(self, fault: Fault) -> None:
        at = time.monotonic() - self.t0
        try:
            getattr(self, f"_do_{fault.kind}")(fault)
            with self._lock:
                if fault.kind not in BAD_INPUTS:  # bad inputs are counted by variant where made
                    self.faults[fault.kind] += 1
                self.fault_log.append(f"{at:8.2f}s  {fault.describe()}")
        except Exception as exc:  # noqa: BLE001 - reported, and fails the soak
            text = f"{fault.describe()}: {type(exc).__name__}: {exc}"
            with self._lock:
                self.report.fault_errors.append(text)
            self.say(f"FAULT ERROR {text}")

    def _hold(self, seconds: float) -> None:
        self._abort.wait(seconds)  # part of the schedule, cut short on abort

    def _kill_and_restart(self, f: Fault) -> None:
        m = self.members[f.target]
        m.kill()
        self._hold(f.hold_s)
        m.start()

    def _stop_and_continue(self, f: Fault) -> None:
        m = self.members[f.target]
        m.freeze()
        self._hold(f.hold_s)
        m.thaw()

    _do_relay_sigkill = _do_consumer_sigkill = _do_worker_sigkill = _kill_and_restart
    _do_relay_sigstop = _do_consumer_sigstop = _do_worker_sigstop = _stop_and_continue

    def _proxy_fault(self, f: Fault, apply: Callable[[], None]) -> None:
        assert self.proxy is not None
        apply()
        try:
            self._hold(f.hold_s)
        finally:
            self.proxy.restore()

    def _do_broker_cut(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, self.proxy.cut)

    def _do_broker_delay(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, lambda: self.proxy.set_delay(f.param))  # type: ignore[union-attr]

    def _do_broker_blackhole(self, f: Fault) -> None:
        assert self.proxy is not None
        self._proxy_fault(f, self.proxy.blackhole)

    def _db_outage(self, f: Fault, down: Callable[[], None]) -> None:
        assert self.pg is not None
        down()
        try:
            self._hold(f.hold_s)
        finally:
            self.pg.start()

    def _do_db_restart(self, f: Fault) -> None:
        assert self.pg is not None
        self._db_outage(f, self.pg.stop)

    def _do_db_crash(self, f: Fault) -> None:
        assert self.pg is not None
        self._db_outage(f, self.pg.kill)

    def _do_pg_terminate(self, f: Fault) -> None:
        assert self.pg is not None
        deadline = time.monotonic() + 15
        while True:  # a database fault may be under way: retry briefly
            try:
                with psycopg.connect(self.pg.admin_dsn, autocommit=True, connect_timeout=3) as conn:
                    rows = conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'soak' "
                        "AND application_name LIKE %s AND application_name NOT LIKE 'soak-%%' "
                        "AND pid <> pg_backend_pid()", (f.target,)).fetchall()
                self.say(f"pg_terminate_backend {f.target!r}: {len(rows)} connections")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                self._hold(0.5)

    def _with_db(self, call: Callable[[psycopg.Connection[Any]], Any], timeout_s: float = 20.0) -> Any:
        """Run ``call`` on a fresh connection, retrying while a database fault lasts."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3,
                                     application_name="soak-bad-input") as conn:
                    return call(conn)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                self._hold(0.5)

    def _do_poison_row(self, f: Fault) -> None:
        """A row the relay can never publish: too large, or a header that is not a string."""
        n = len(self.poison_ids)
        too_large = n % 2 == 0
        key = f"poison-{n}"

        def write(conn: psycopg.Connection[Any]) -> str:
            with conn.transaction():
                if too_large:
                    return str(write_event(conn, topic=TOPIC, key=key, payload={"key": key, "pad": "x" * POISON_PAD}))
                row = conn.execute("INSERT INTO outbox (topic, key, payload, headers) "
                                   "VALUES (%s, %s, %s, '{\"retries\": 3}') RETURNING event_id",
                                   (TOPIC, key, json.dumps({"key": key}))).fetchone()
                assert row is not None
                return str(row[0])

        event_id = self._with_db(write)
        with self._lock:
            self.poison_ids.append(event_id)
            self.bad_inputs["poison_row:" + ("too_large" if too_large else "bad_header")] += 1

    def _do_bad_message(self, f: Fault) -> None:
        """Messages produced straight to the topic that the consumers must dead-letter."""
        variants = [("no_event_id", "invalid_event_id"), ("event_id_not_uuid", "invalid_event_id"),
                    ("event_id_reused_other_body", "payload_mismatch")]
        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                             "message.timeout.ms": 60000, "reconnect.backoff.max.ms": 1000,
                             "logger": _KAFKA_LOG})
        sent: list[tuple[str, str, str]] = []
        reports: list[Any] = []
        for variant, reason in variants:
            bad_id = uuid.uuid4().hex
            headers: list[tuple[str, str | bytes | None]] = [("soak_bad", bad_id.encode())]
            if variant == "event_id_not_uuid":
                headers.append(("event_id", b"not-a-uuid"))
            elif variant == "event_id_reused_other_body":
                reused = self._with_db(lambda c: c.execute(
                    "SELECT event_id FROM soak_effects LIMIT 1 OFFSET floor(random() * 50)").fetchone())
                if reused is None:
                    continue
                headers.append(("event_id", str(reused[0]).encode()))
            producer.produce(TOPIC, key=f"bad-{bad_id[:8]}".encode(),
                             value=json.dumps({"key": "bad", "seq": -1, "bad": bad_id}).encode(),
                             headers=headers, on_delivery=lambda err, _msg: reports.append(err))
            sent.append((bad_id, reason, variant))
        producer.flush(90)
        if len(reports) != len(sent) or any(err is not None for err in reports):
            raise RuntimeError(f"bad messages not acknowledged: {reports}")
        with self._lock:
            for bad_id, reason, variant in sent:
                self.bad_messages[bad_id] = reason
                self.bad_inputs["bad_message:" + variant] += 1

    def _do_bad_write(self, f: Fault) -> None:
        """Writes the SDK or the schema must refuse; any that goes through is a failure."""
        attempts: list[tuple[str, type[BaseException], Callable[[psycopg.Connection[Any]], Any]]] = [
            ("sdk_invalid_topic", InvalidEvent,
             lambda c: write_event(c, topic="bad topic!", key="bad", payload={})),
            ("sdk_reserved_header", InvalidEvent,
             lambda c: write_event(c, topic=TOPIC, key="bad", payload={}, headers={"event_id": "x"})),
            ("sql_invalid_topic", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload) VALUES ('bad topic!', 'bad', '{}')")),
            ("sql_headers_not_object", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, 'bad', '{}', '[1]')",
                                 (TOPIC,))),
            ("sql_two_payloads", psycopg.errors.CheckViolation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload, payload_bytes) "
                                 "VALUES (%s, 'bad', '{}', '\\x00')", (TOPIC,))),
            ("sql_invalid_json", psycopg.errors.InvalidTextRepresentation,
             lambda c: c.execute("INSERT INTO outbox (topic, key, payload) VALUES (%s, 'bad', 'not json')",
                                 (TOPIC,))),
            ("sdk_reused_event_id", DuplicateEvent,
             lambda c: write_event(c, topic=TOPIC, key="bad", payload={},
                                   event_id=_scalar(c, "SELECT event_id FROM outbox LIMIT 1"))),
        ]

        class _Accepted(Exception):
            pass

        def try_all(conn: psycopg.Connection[Any]) -> list[tuple[str, str | None]]:
            results: list[tuple[str, str | None]] = []
            try:  # outside a transaction on an autocommit connection: refused, nothing written
                write_event(conn, topic=TOPIC, key="bad", payload={})
                results.append(("sdk_no_transaction", "accepted"))
            except TransactionRequired:
                results.append(("sdk_no_transaction", None))
            for name, expected, call in attempts:
                try:
                    with conn.transaction():
                        call(conn)
                        raise _Accepted()
                except _Accepted:
                    results.append((name, "accepted"))
                except expected:
                    results.append((name, None))
                except psycopg.OperationalError:
                    raise
                except Exception as exc:  # noqa: BLE001 - refused, but not the way it should be
                    results.append((name, f"refused with {type(exc).__name__}: {exc}"))
            return results

        for name, problem in self._with_db(try_all):
            with self._lock:
                self.bad_inputs["bad_write:" + name] += 1
                if problem is not None:
                    self.report.bad_input_failures.append(f"{name}: {problem}")

    def _heal_all(self) -> None:
        """Undo whatever a fault left behind (a fault thread that did not finish in time)."""
        assert self.proxy is not None and self.pg is not None
        self.proxy.restore()
        if not self.pg.running:
            self.pg.start()
        for m in self.members.values():
            m.thaw()
            if m.proc is None or not m.proc.alive:
                m.check()
                m.start()
