"""What the relay and the consumer SDK share, in one neutral package.

``outbox_core`` imports neither ``relay`` nor ``consumer_sdk`` (``outbox_core/ruff.toml``),
and neither of those imports the other's private modules (their ``ruff.toml``):

* :mod:`outbox_core.queries`: the SQL files (``outbox_core/sql/``: migrations, named
  queries, role scripts, adoption), found with :mod:`importlib.resources`;
* :mod:`outbox_core.connect_errors`: what a failed PostgreSQL connection attempt means;
* :mod:`outbox_core.secrets`: masking of DSN passwords and secret properties;
* :mod:`outbox_core.leases`: the local lease clock (until when a renewed lease is trusted);
* :mod:`outbox_core.backoff`: the one capped exponential back-off with jitter;
* :mod:`outbox_core.kafka_errors`: what a Kafka client's error says about its set-up (a
  password or a TLS set-up that cannot work, a listener of the other protocol);
* :mod:`outbox_core.kafka_clients`: the end of a Kafka producer (every delivery report
  served, then its threads joined);
* :mod:`outbox_core.pooling`: whether a DSN reaches PostgreSQL through a transaction pooler;
* :mod:`outbox_core.spin`: waiting for PostgreSQL's answer by polling its socket briefly;
* :mod:`outbox_core.cgroup`: the CPU limit of this process's control group, in cores;
* :mod:`outbox_core.text`: input that is not UTF-8 text, found before a parser meets it;
* :mod:`outbox_core.waits`: what a service's own sessions wait on in the database, read by
  a watch thread while they seem held up (the relay's, the consumer's and the jobs pool's).

A path such as ``sql/queries/relay.sql`` in a comment means ``outbox_core/sql/queries/relay.sql``.
"""
