"""The Apache Kafka fixture's cluster ids are ones kafka-storage can parse."""

from __future__ import annotations

import base64

from tests.fixtures.apache_kafka import _cluster_id


def test_no_cluster_id_starts_with_a_dash_and_each_is_sixteen_bytes() -> None:
    # One id in 64 began with '-' before the fix; among 5000 that is certain to show.
    ids = [_cluster_id() for _ in range(5000)]
    assert [i for i in ids if i.startswith("-")] == []
    assert all(len(base64.urlsafe_b64decode(i + "==")) == 16 for i in ids)
    assert len(set(ids)) == len(ids)
