"""InboxConfig's check of the consumer's librdkafka properties (consumer_sdk/kafka_properties.py)
makes a client and destroys it at once: it must contact neither the cluster (librdkafka
connects to a bootstrap broker as soon as a client is made) nor an OIDC token endpoint
(librdkafka asks it as soon as a SASL/OAUTHBEARER client is made).  Listeners on both
addresses see no connection.  No broker is needed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from consumer_sdk import InboxConfig

#: Configurations made per case: an unguarded check connected in about half of them.
TRIES = 20


class Listener:
    """Accepts connections on a thread of its own and closes them at once (a client waiting
    for an answer would hold the check), setting ``contacted``."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.contacted = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            self.contacted.set()
            conn.close()

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (close alone does not)
        except OSError:
            pass
        self.server.close()
        self.thread.join(5)

    def nothing_came(self) -> bool:
        """No connection, waiting a second for a late one."""
        return not self.contacted.wait(1.0)


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("security", [
    {},
    {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "u",
     "sasl.password": "p"},
], ids=["plaintext", "scram"])
def test_the_check_contacts_no_broker(listener: Listener, security: dict[str, str]) -> None:
    for _ in range(TRIES):
        InboxConfig(name="svc", bootstrap_servers=f"127.0.0.1:{listener.port}", topics=["t"], kafka_properties=security)
    assert listener.nothing_came(), "the configuration's check connected to the bootstrap address"


def test_the_check_asks_no_oidc_token_endpoint(listener: Listener) -> None:
    props = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
             "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": "svc",
             "sasl.oauthbearer.client.secret": "s3cret",
             "sasl.oauthbearer.token.endpoint.url": f"http://127.0.0.1:{listener.port}/token"}
    for _ in range(TRIES):
        InboxConfig(name="svc", bootstrap_servers="127.0.0.1:1", topics=["t"], kafka_properties=props)
    assert listener.nothing_came(), "the configuration's check asked the OIDC token endpoint"
