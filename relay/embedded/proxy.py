"""A TCP fault proxy for failure injection: cut, blackhole (partition) and latency.

It runs an asyncio loop in its own daemon thread; the public methods are called from the
test thread and return once the change is in effect. Put it in front of PostgreSQL
directly; for Kafka use `broker.tansu_broker_behind_proxy()`, because clients connect
to the address the broker *advertises*, not to the bootstrap address.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import deque
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

__all__ = ["TcpProxy"]

T = TypeVar("T")

_HIGH_WATER: Final = 4 * 1024 * 1024  # queued (delayed/held) bytes before reading pauses
_LOW_WATER: Final = 1024 * 1024
_OP_TIMEOUT_S: Final = 10.0


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_EOF: Final = _Marker("EOF")  # the source half-closed: write_eof() on the peer
_CLOSE: Final = _Marker("CLOSE")  # the source is gone: close the peer after its data

_Item = bytes | _Marker


def _reset(transport: asyncio.BaseTransport | None) -> None:
    """Close a TCP transport with RST (SO_LINGER 0), dropping buffered data."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    assert isinstance(transport, asyncio.Transport)
    transport.abort()


class _Side(asyncio.Protocol):
    """One socket of a proxied connection; queues what it reads for its peer."""

    def __init__(self, conn: _Conn, name: str) -> None:
        self.conn = conn
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.queue: deque[tuple[float, _Item]] = deque()
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.pause_reasons: set[str] = set()
        self.eof = False
        self.lost = False

    # asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._apply_pause()
        self.conn.side_made(self)

    def data_received(self, data: bytes) -> None:
        proxy = self.conn.proxy
        peer = self.peer
        if (
            not self.queue
            and proxy._delay_s <= 0
            and not proxy._blackholed
            and peer is not None
            and peer.transport is not None
            and not peer.transport.is_closing()
        ):
            peer.transport.write(data)  # fast path
            return
        self.enqueue(data)

    def eof_received(self) -> bool:
        self.enqueue(_EOF)
        return True  # keep our write side open (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.timer is not None and self.conn.dead:
            self.timer.cancel()
        if not self.conn.dead:
            self.enqueue(_CLOSE)
        self.conn.side_lost()

    def pause_writing(self) -> None:  # our write buffer is full: stop reading the peer
        if self.peer is not None:
            self.peer.pause("backpressure")

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.resume("backpressure")

    # flow --------------------------------------------------------------------------------
    def pause(self, reason: str) -> None:
        """Stop reading from this socket for `reason` (reading resumes when none is left)."""
        self.pause_reasons.add(reason)
        self._apply_pause()

    def resume(self, reason: str) -> None:
        self.pause_reasons.discard(reason)
        self._apply_pause()

    def _apply_pause(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if self.pause_reasons and t.is_reading():
            t.pause_reading()
        elif not self.pause_reasons and not t.is_reading():
            t.resume_reading()

    def enqueue(self, item: _Item) -> None:
        loop = self.conn.proxy._loop
        assert loop is not None
        self.queue.append((loop.time() + self.conn.proxy._delay_s, item))
        if isinstance(item, bytes):
            self.queued += len(item)
            if self.queued > _HIGH_WATER:
                self.pause("queue")
        self.flush()

    def _on_timer(self) -> None:
        self.timer = None
        self.flush()

    def flush(self) -> None:
        """Write every due item to the peer (nothing while blackholed or unconnected)."""
        proxy = self.conn.proxy
        peer = self.peer
        if self.conn.dead or proxy._blackholed:
            return
        if peer is None or peer.transport is None:
            return
        loop = proxy._loop
        assert loop is not None
        now = loop.time()
        pt = peer.transport
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if isinstance(item, bytes):
                self.queued -= len(item)
                if not pt.is_closing():
                    pt.write(item)
            elif item is _EOF:
                self.eof = True
                if peer.eof or not pt.can_write_eof():
                    self.conn.close()
                elif not pt.is_closing():
                    pt.write_eof()
            else:  # _CLOSE
                self.conn.close()
        if self.queue and self.timer is None and not self.conn.dead:
            self.timer = loop.call_at(self.queue[0][0], self._on_timer)
        if self.queued < _LOW_WATER:
            self.resume("queue")


class _Conn:
    """A client connection and its upstream connection."""

    def __init__(self, proxy: TcpProxy) -> None:
        self.proxy = proxy
        self.client = _Side(self, "client")
        self.upstream: _Side | None = None
        self.dead = False
        self.connecting = False

    def side_made(self, side: _Side) -> None:
        proxy = self.proxy
        if side is self.client:
            if proxy._cut:
                self.dead = True
                _reset(side.transport)
                return
            proxy._conns.add(self)
            side.pause("connecting")
            if proxy._blackholed:
                side.pause("blackhole")  # upstream is connected on restore()
            else:
                self.connect_upstream()
        else:
            if self.dead:  # the client went away (or a cut) while connecting
                _reset(side.transport)
                return
            side.peer = self.client
            self.client.peer = side
            if proxy._blackholed:
                side.pause("blackhole")
            self.client.resume("connecting")
            self.client.flush()

    def connect_upstream(self) -> None:
        if self.connecting or self.dead:
            return
        self.connecting = True
        loop = self.proxy._loop
        assert loop is not None
        self.upstream = _Side(self, "upstream")
        upstream = self.upstream

        async def connect() -> None:
            try:
                await loop.create_connection(
                    lambda: upstream, self.proxy.target_host, self.proxy.target_port
                )
            except OSError:
                self.reset()

        loop.create_task(connect())

    def side_lost(self) -> None:
        """Forget the connection once both of its sockets are gone."""
        if self.client.lost and (self.upstream is None or self.upstream.lost):
            self.dead = True
            self.proxy._conns.discard(self)

    def close(self) -> None:
        """Graceful close of both sides (buffered writes are flushed by asyncio)."""
        if self.dead:
            return
        self.dead = True
        self.proxy._conns.discard(self)
        for side in (self.client, self.upstream):
            if side is not None:
                if side.timer is not None:
                    side.timer.cancel()
                if side.transport is not None and not side.transport.is_closing():
                    side.transport.close()

    def reset(self) -> None:
        """Abort both sides with RST and drop everything queued."""
        self.dead = True
        self.proxy._conns.discard(self)
        for side in (self.client, self.upstream):
            if side is not None:
                if side.timer is not None:
                    side.timer.cancel()
                side.queue.clear()
                side.queued = 0
                _reset(side.transport)


class TcpProxy:
    """Forward 127.0.0.1:`port` to target_host:target_port, with injectable faults.

    Faults: `cut()` resets every connection and refuses new ones; `blackhole()` keeps
    connections open but forwards nothing (a partition: data is held, not dropped, and
    flows again on `restore()`); `set_delay(ms)` delays forwarded data in both directions.
    `restore()` clears all three.
    """

    def __init__(self, target_host: str, target_port: int, listen_port: int | None = None) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = "127.0.0.1"
        self._listen_port = listen_port or 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._delay_s = 0.0
        self._cut = False
        self._blackholed = False
        self._stopped = False

    def __repr__(self) -> str:
        return (
            f"TcpProxy(127.0.0.1:{self._listen_port} -> {self.target_host}:{self.target_port}, "
            f"cut={self._cut}, blackholed={self._blackholed}, delay_ms={self._delay_s * 1000:.0f})"
        )

    @property
    def port(self) -> int:
        """The listening port (known once started)."""
        return self._listen_port

    @property
    def address(self) -> str:
        """ "127.0.0.1:PORT"."""
        return f"{self.listen_host}:{self._listen_port}"

    @property
    def connections(self) -> int:
        """Number of open proxied (client) connections."""
        return len(self._conns)

    def start(self) -> TcpProxy:
        """Bind and start forwarding in a background thread; returns self."""
        if self._thread is not None:
            return self
        if self._stopped:
            raise RuntimeError("a stopped TcpProxy cannot be started again")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"tcp-proxy->{self.target_port}", daemon=True
        )
        self._thread.start()

        async def listen() -> None:
            self._server = await loop.create_server(
                lambda: _Conn(self).client, self.listen_host, self._listen_port, backlog=1024
            )
            sock = self._server.sockets[0]
            self._listen_port = int(sock.getsockname()[1])

        try:
            self._call(listen())
        except BaseException:
            self.stop()
            raise
        return self

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("TcpProxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_OP_TIMEOUT_S)

    def cut(self) -> None:
        """Reset every open connection (both sides) and reset new ones right after accept."""

        async def do() -> None:
            self._cut = True
            for conn in list(self._conns):
                conn.reset()
            self._conns.clear()

        self._call(do())

    def blackhole(self) -> None:
        """Forward nothing, keep connections open; new connections are accepted but silent."""

        async def do() -> None:
            self._blackholed = True
            for conn in list(self._conns):
                for side in (conn.client, conn.upstream):
                    if side is not None:
                        side.pause("blackhole")

        self._call(do())

    def set_delay(self, ms: float) -> None:
        """Delay data forwarded in either direction by `ms` milliseconds (0: no delay)."""
        self._delay_s = max(0.0, ms) / 1000.0

    def restore(self) -> None:
        """Clear cut, blackhole and delay: held data flows again, new connections work."""

        async def do() -> None:
            self._cut = False
            self._delay_s = 0.0
            if self._blackholed:
                self._blackholed = False
                for conn in list(self._conns):
                    if conn.upstream is None:
                        conn.connect_upstream()
                    for side in (conn.client, conn.upstream):
                        if side is not None:
                            side.resume("blackhole")
                            side.flush()

        self._call(do())

    def stop(self) -> None:
        """Close the listener and every connection, stop the thread; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._conns):
                conn.reset()
            self._conns.clear()
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()  # pending upstream connects
            await asyncio.sleep(0)  # let the transports run connection_lost

        if thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(_OP_TIMEOUT_S)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(_OP_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
