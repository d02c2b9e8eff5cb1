"""A DBA's ACCESS EXCLUSIVE lock on the outbox, held longer than liveness's 30 s for a loop
that does not tick (relay/waits.py, relay/probes.py).

The relay said nothing but ``heartbeat_late`` and /healthz failed after 30 s, so the
liveness probe restarted the sidecar (an operations audit).  Now the relay names the lock
it waits on and who holds it, shows the wait in ``outbox_relay_lock_wait_seconds`` and the
/healthz body, and /healthz stays OK: the lock is not the relay's business.  After the
release every row is published; every event is counted."""

from __future__ import annotations

import json
import threading
import time

import psycopg

from tests.faults.test_observability import get, sample
from tests.fixtures.broker import read_all
from tests.fixtures.outbox import (
    all_event_ids,
    check_delivery,
    insert_rows,
    pending,
    relay_cmd,
    relay_env,
    wait_drained,
)
from tests.fixtures.procs import free_port, wait_until

#: Longer than /healthz's 30 s for a loop that does not tick (relay/probes.py).
HOLD_S = 36.0
DBA = "dba-maintenance"


def _lock_waits(log_text: str) -> list[dict[str, object]]:
    lines = (json.loads(line) for line in log_text.splitlines() if '"database_lock_wait"' in line)
    return [line for line in lines if line.get("event") == "database_lock_wait"]


def test_a_dba_lock_on_the_outbox_is_named_and_liveness_holds(outbox_db, broker, topic, spawn):
    port = free_port()
    relay = spawn(relay_cmd("run"), name="relay", env=relay_env(
        outbox_db, broker.bootstrap, metrics_port=port, metrics_host="127.0.0.1"))
    insert_rows(outbox_db, topic, 300, keys=10)
    wait_drained(outbox_db, timeout_s=60)

    dba = psycopg.connect(outbox_db, application_name=DBA)  # not autocommit: the lock is held
    writer = threading.Thread(target=insert_rows, args=(outbox_db, topic, 300),
                              kwargs={"keys": 10, "start": 300}, daemon=True)
    statuses: list[tuple[float, int, str]] = []
    try:
        dba_pid = dba.info.backend_pid
        dba.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        locked_at = time.monotonic()
        writer.start()  # a writer waits on the lock too

        def healthz_until_released() -> bool:
            status, body = get(port, "/healthz")
            statuses.append((time.monotonic() - locked_at, status, body))
            return time.monotonic() - locked_at >= HOLD_S

        wait_until(healthz_until_released, timeout_s=HOLD_S + 30, interval_s=0.5)
        waits = _lock_waits(relay.log_text())
        gauge = sample(port, "outbox_relay_lock_wait_seconds")
    finally:
        dba.rollback()
        dba.close()
    writer.join(60)

    failing = [(round(at, 1), status, body) for at, status, body in statuses if status != 200]
    assert not failing, f"/healthz failed while the relay waited on the lock: {failing[:3]}"
    assert statuses[-1][0] >= HOLD_S > 30
    assert "waiting on a lock on outbox" in statuses[-1][2], statuses[-1][2]
    assert waits, f"no database_lock_wait logged\n{relay.log_tail()}"
    first = waits[0]
    assert first["relation"] == "outbox" and first["level"] == "warning"
    assert dba_pid in first["blocking_pids"] and DBA in first["blockers"], first
    assert "LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE" in str(first["detail"]), first
    assert gauge >= 20, gauge

    wait_drained(outbox_db, timeout_s=60)
    relay.wait_for_log("database_wait_over", timeout_s=30)
    wait_until(lambda: sample(port, "outbox_relay_lock_wait_seconds") == 0, timeout_s=30)
    expected = all_event_ids(outbox_db)
    assert len(expected) == 600 and pending(outbox_db) == 0
    assert relay.alive
    relay.sigterm()
    assert relay.wait(30) == 0
    delivery = check_delivery(read_all(broker.bootstrap, topic, expected=expected, timeout_s=60), expected)
    assert delivery.missing == set() and delivery.order_violations == []
