"""librdkafka's error texts may quote a secret property's value: masked before they are
logged or raised (relay and SDK).  A malformed sasl.oauthbearer.config was printed in clear
from where librdkafka's parsing stopped, in the relay's one fatal line and in the SDK's
kafka_fatal log and KafkaFatal (an audit of the security paths)."""

from __future__ import annotations

import time
from typing import Any

from outbox_core.secrets import scrub
from relay.publisher import Publisher

SECRET = "UNSECURED-s3cret"
OAUTH = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
         "enable.sasl.oauthbearer.unsecure.jwt": "true",
         "sasl.oauthbearer.config": f"principal=relay scope=x {SECRET}"}


def test_the_relays_client_error_does_not_quote_a_malformed_oauthbearer_config() -> None:
    # A real librdkafka client: it fails to build its token before any broker answers.
    got: list[tuple[Any, str, bool]] = []
    publisher = Publisher({"bootstrap.servers": "127.0.0.1:1", **OAUTH},
                          on_client_error=lambda state, message, fatal: got.append((state, message, fatal)))
    try:
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            publisher.poll(0.1)
    finally:
        publisher.close()
    assert got, "no client error"
    state, message, fatal = got[0]
    assert fatal and "sasl.oauthbearer.config" in message
    assert SECRET not in message and "relay scope" not in message, message


def test_pieces_of_a_secret_value_are_masked_where_an_error_quotes_them() -> None:
    props = {"sasl.oauthbearer.config": "clientId=app clientSecret=hunter2-long-secret scope=all",
             "sasl.password": "pw-1234"}
    said = ("bad value clientSecret=hunter2-long-secret; hunter2-long-secret alone; "
            "password pw-1234; Unrecognized sasl.oauthbearer.config beginning at: scope=all\nnext line")
    masked = scrub(said, properties=props)
    assert "hunter2" not in masked and "pw-1234" not in masked and "scope=all" not in masked, masked
    assert masked.endswith("beginning at: ***\nnext line")
    # Short pieces are left: "app" or "all" would mask ordinary words.
    assert scrub("an app and all", properties=props) == "an app and all"
