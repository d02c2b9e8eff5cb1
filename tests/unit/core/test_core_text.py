"""Where input that is not UTF-8 text is, named without its value."""

from __future__ import annotations

import pytest

from outbox_core.text import bootstrap_servers_problem, first_undecodable


def test_names_the_variable_the_flag_or_the_position_never_the_value() -> None:
    assert first_undecodable(["run", "--dsn", "x"], {"OUTBOX_RELAY_OWNER": "ok", "HOME": "\udcff"},
                             "OUTBOX_RELAY_") is None  # another program's variable is not ours
    assert first_undecodable([], {"OUTBOX_RELAY_DSN": "pw\udcff"}, "OUTBOX_RELAY_") == "OUTBOX_RELAY_DSN"
    assert first_undecodable([], {"OUTBOX_RELAY_\udcff": "x"}, "OUTBOX_RELAY_") == \
        "the environment variable 'OUTBOX_RELAY_\\udcff'"
    assert first_undecodable(["run", "--dsn=pw\udcff"], {}, "P_") == "the value of --dsn"
    assert first_undecodable(["run", "--dsn", "pw\udcff"], {}, "P_") == "the value after --dsn"
    assert first_undecodable(["replay", "ab\udcff"], {}, "P_") == "command-line argument 2"
    assert first_undecodable(["--dsn=a", "b\udcff"], {}, "P_") == "command-line argument 2"


@pytest.mark.parametrize("servers", [
    "127.0.0.1:9092", "k", "a:1,b:2", "PLAINTEXT://h:9092", "[::1]:9092", "::1", "a,,b",
    "SASL_SSL://broker-1.example.com:9093, broker-2:9093", "kafka-0.kafka.ns.svc.cluster.local:9092",
])
def test_a_bootstrap_list_librdkafka_can_use_passes(servers: str) -> None:
    assert bootstrap_servers_problem(servers) is None


@pytest.mark.parametrize(("servers", "problem"), [
    (" ", "names no broker"), (" , ", "names no broker"),
    ("127.0.0.1:abc", "'abc' is not a TCP port"),  # librdkafka connected to port 0
    ("127.0.0.1:99999", "'99999' is not a TCP port"),  # ... to 99999 modulo 65536
    ("h:0", "'0' is not a TCP port"), ("h:", "'' is not a TCP port"),
    ("host name:9092", "'host name:9092' is not host:port"), (None, "not NoneType"),
])
def test_a_bootstrap_list_librdkafka_would_retry_for_ever_is_named(servers: object, problem: str) -> None:
    found = bootstrap_servers_problem(servers)
    assert found is not None and problem in found, found
