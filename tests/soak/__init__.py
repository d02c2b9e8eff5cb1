"""Chaos soak: the whole pipeline on real services under a seeded schedule of faults (issue 9).

    python -m tests.soak --duration-s 1200 --seed 7 --relays 3 --consumers 2 --workers 2 \\
        --rate 300 --json /tmp/soak.json
    make soak SOAK_ARGS="--duration-s 1200 --seed 7"

What runs, all owned by the soak (nothing shared with other tests):

* an embedded PostgreSQL (restartable) with a fresh database migrated by ``relay.migrate``;
* an Apache Kafka node (``--broker kafka``, the default; tansu when Java or the jars are
  missing outside CI, or with ``--broker tansu``) behind a :class:`TcpProxy`: relays,
  consumers and the verifier reach it only through the proxy (it advertises the proxy's
  port), so cut/delay/blackhole hit every Kafka client.  Not tansu by default: tansu
  0.6.0 makes later offsets of a partition readable before earlier ones when several
  producers write it (tests/integration/kafka/test_broker_offset_order.py), and a
  consumer group that read past them never goes back: the soak then failed for the
  broker's sake, not the relay's;
* writers (threads of this process): transactions of 1-5 events over 1-2 keys; each
  transaction first locks its keys (``pg_advisory_xact_lock(hashtext(key))``, README
  "Ordering") and takes the keys' next seq numbers from ``soak_writer_keys`` in the same
  transaction, so a commit whose outcome is unknown cannot break a key's sequence;
* ``--relays`` replicas as real ``python -m relay run`` processes (owners r1..rN, lease
  3 s, metrics on a free port, scraped for ``outbox_relay_fenced_writes_total``);
* ``--consumers`` dedup consumers (tests/_soak_consumer.py, one group): the handler
  applies the effect (``soak_effects`` row + per-key state) in the inbox transaction;
* ``--workers`` job workers (tests/_soak_consumer.py --role worker) when
  ``consumer_sdk.jobs`` imports: consumers enqueue a job for every JOB_EVERY-th seq of a
  key in the inbox transaction; the job writes its effect fenced, result by key.

Faults come from ``random.Random(seed)`` (the plan is printed and saved): every kind once
early on, then random kinds at random gaps.  Kinds: SIGKILL (restarted after a pause)
and SIGSTOP/SIGCONT (longer than the lease / session timeout, or not) of relays,
consumers and workers; broker cut, slowed and blackholed through the proxy; database
restarted (fast shutdown) and crashed (SIGKILL); ``pg_terminate_backend`` of the
relays', consumers' or workers' connections.  Bad inputs ride along: poison rows the
relay must dead-letter, malformed messages the consumers must dead-letter, and invalid
writes the SDK or the schema must refuse.

At the end: writers stop, everything is healed, the soak waits (deadline) until the
outbox is drained and every effect applied, reads the whole topic with a verifying
consumer, stops every process with SIGTERM and checks the invariants (see
:meth:`SoakReport.failures`).  Exit code 0 only when all hold.  Logs of every process
are kept in the work directory (printed).

The package, one purpose a module:

* ``config``: the constants, :class:`SoakConfig` (what to run) and :class:`SoakReport`
  (the figures, and the invariants in :meth:`SoakReport.failures`);
* ``plan``: :class:`Fault` and :func:`plan_faults`, the seeded schedule (pure);
* ``members``: :class:`~tests.soak.members.Member` (a relay, consumer or worker process
  under a name that survives restarts) and :class:`~tests.soak.members.Writers`;
* ``run``: :class:`Soak` (set-up, the run, the chaos thread, stop and clean-up) and
  :func:`run_soak`; the methods that inject faults are the mixin ``faults.FaultInjection``
  and those that drain, verify and fill the report the mixin ``verify.Verification``;
* ``cli`` and ``__main__``: the command line (:func:`main`).
"""

from tests.soak.cli import main
from tests.soak.config import BAD_INPUTS, PROCESS_FAULTS, SERVICE_FAULTS, SoakConfig, SoakReport
from tests.soak.plan import Fault, plan_faults
from tests.soak.run import Soak, run_soak

__all__ = [
    "BAD_INPUTS",
    "PROCESS_FAULTS",
    "SERVICE_FAULTS",
    "Fault",
    "Soak",
    "SoakConfig",
    "SoakReport",
    "main",
    "plan_faults",
    "run_soak",
]
