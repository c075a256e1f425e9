"""Threaded msgpack-RPC server: handlers registered by method name.

One accept thread; one reader thread per connection; handlers run on a shared
worker pool (so a connection's requests complete out of order) unless
registered ``inline`` (run on the reader thread, in arrival order: for cheap
handlers where a thread hop costs more than the work).

Invariants:
- the first frame on a connection must be a ``Hello`` with our protocol
  version and, when the server has a token, exactly that token; otherwise the
  server answers ``HelloReply(ok=False, reason=...)``, logs it, and closes;
- a malformed, oversized or undecodable frame is answered with an
  ``ErrorReply(id=0)`` where the socket still takes it, then that connection
  (only) is closed; the server keeps serving every other connection;
- a handler exception becomes an ``ErrorReply`` for that request id (code
  ``"kvpool"`` for KVPoolError, ``"internal"`` otherwise) and the connection
  stays open;
- at most ``max_in_flight`` requests per connection run at once (the reader
  stops reading until one finishes), so a flooding client cannot queue
  unbounded work.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConnectionLostError, FrameTooLargeError, KVPoolError, ProtocolError
from kvpool.rpc.auth import check_bind, resolve_token, token_matches
from kvpool.rpc.frame import (
    DEFAULT_MAX_FRAME,
    FrameReader,
    encode_frame,
    linger_close,
    listen,
    set_io_timeout,
    tune_socket,
)
from kvpool.rpc.messages import (
    PROTOCOL_VERSION,
    Envelope,
    ErrorReply,
    Hello,
    HelloReply,
    Request,
    Response,
    WireMessage,
    decode_envelope,
    encode_envelope,
)

log = logging.getLogger("kvpool.rpc")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # None: take $KVPOOL_TOKEN
    name: str = "kvpool"
    max_frame: int = DEFAULT_MAX_FRAME
    workers: int = 8
    max_in_flight: int = 256
    handshake_timeout: float = 10.0
    io_timeout: float = 30.0  # bounds a send to a client that stopped reading
    # Before a peer authenticated it may send only this much (its hello), so an
    # unauthenticated length prefix never makes the server allocate max_frame.
    hello_max_frame: int = 4096
    max_connections: int = 1024  # more are closed at accept (each costs a thread)


@dataclass
class Deferred:
    """What an ``inline`` handler returns to finish its call on a worker thread:
    the connection's reader goes on at once while ``finish()`` (which may wait on
    other servers) computes the result."""

    finish: Callable[[], Any]


@dataclass
class _Route:
    fn: Callable[..., Any]
    request_type: type[WireMessage] | None
    inline: bool
    pass_conn: bool


class Connection:
    """One accepted client; handlers registered with ``pass_conn`` receive it."""

    def __init__(self, sock: socket.socket, peer: Any, conn_id: int, max_frame: int) -> None:
        self.sock, self.peer, self.id, self.client_name = sock, peer, conn_id, ""
        self.reader = FrameReader(sock)  # used by the connection's reader thread only
        self._max_frame = max_frame
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: Envelope) -> None:
        self.send_frame(encode_frame(encode_envelope(msg), max_frame=self._max_frame))

    def send_frame(self, frame: bytes) -> None:
        """Send one encoded frame whole (frames from several threads never interleave)."""
        with self._send_lock:
            self.sock.sendall(frame)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class RpcServer:
    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.token = resolve_token(self.config.token)
        check_bind(self.config.host, self.token)
        self._routes: dict[str, _Route] = {}
        self._disconnect_hooks: list[Callable[[Connection], None]] = []
        self._conns: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="kvpool-rpc")
        self._listener = listen(self.config.host, self.config.port)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def register(
        self,
        method: str,
        fn: Callable[..., Any],
        *,
        request_type: type[WireMessage] | None = None,
        inline: bool = False,
        pass_conn: bool = False,
    ) -> None:
        """``fn(params)`` or ``fn(params, conn)``; params decoded as ``request_type`` if given.

        The return value (wire types or a WireMessage) becomes the response.
        """
        self._routes[method] = _Route(fn, request_type, inline, pass_conn)

    def on_disconnect(self, hook: Callable[[Connection], None]) -> None:
        self._disconnect_hooks.append(hook)

    def start(self) -> tuple[str, int]:
        """Serve in a background thread; returns the bound (host, port)."""
        self._thread = threading.Thread(target=self.serve_forever, name="kvpool-rpc-accept")
        self._thread.daemon = True
        self._thread.start()
        return self.address

    def serve_forever(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                break
            with self._lock:
                full = len(self._conns) >= self.config.max_connections
            if full:
                log.warning(
                    "%s: %d connections open: refusing %s", self.config.name, len(self._conns), peer
                )
                sock.close()
                continue
            conn = Connection(sock, peer, next(self._ids), self.config.max_frame)
            with self._lock:
                self._conns[conn.id] = conn
            t = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True)
            t.start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- per connection -------------------------------------------------------

    def _serve_conn(self, conn: Connection) -> None:
        try:
            tune_socket(conn.sock)
            if self._handshake(conn):
                # A kernel timeout, not settimeout: no poll before each recv (the
                # reader waits through idle timeouts; a send past it drops the client).
                set_io_timeout(conn.sock, self.config.io_timeout)
                self._read_loop(conn)
        except (ConnectionLostError, OSError):
            pass
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(conn.id, None)
            for hook in self._disconnect_hooks:
                try:
                    hook(conn)
                except Exception:
                    log.exception("disconnect hook failed")

    def _handshake(self, conn: Connection) -> bool:
        conn.sock.settimeout(self.config.handshake_timeout)
        try:
            body = conn.reader.read(max_frame=self.config.hello_max_frame, idle_ok=False)
            if body is None:
                return False
            hello = decode_envelope(body)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        except ProtocolError as exc:
            self._reject(conn, "bad_frame", str(exc))
            return False
        except TimeoutError:
            return False
        conn.client_name = hello.name
        reason = ""
        if hello.version != PROTOCOL_VERSION:
            reason = (
                f"protocol version {hello.version} unsupported (server speaks {PROTOCOL_VERSION})"
            )
        elif not token_matches(self.token, hello.token):
            reason = "missing token" if not hello.token else "wrong token"
        if reason:
            log.warning(
                "refused %s (%r) from %s: %s", self.config.name, hello.name, conn.peer, reason
            )
            with contextlib.suppress(OSError):
                conn.send(HelloReply(ok=False, version=PROTOCOL_VERSION, reason=reason))
            conn.closed = True
            linger_close(conn.sock)
            return False
        conn.send(HelloReply(ok=True, version=PROTOCOL_VERSION, server=self.config.name))
        return True

    def _reject(self, conn: Connection, code: str, message: str) -> None:
        log.warning("closing connection from %s: %s", conn.peer, message)
        with contextlib.suppress(OSError):
            conn.send(ErrorReply(id=0, code=code, message=message))
        conn.closed = True
        linger_close(conn.sock)

    def _read_loop(self, conn: Connection) -> None:
        slots = threading.BoundedSemaphore(self.config.max_in_flight)
        while not conn.closed:
            try:
                body = conn.reader.read(max_frame=self.config.max_frame, idle_ok=True)
                if body is None:
                    return
                req = decode_envelope(body)
                if not isinstance(req, Request) or req.id < 1:
                    raise ProtocolError("expected a request with an id >= 1")
            except FrameTooLargeError as exc:
                return self._reject(conn, "frame_too_large", str(exc))
            except ProtocolError as exc:
                return self._reject(conn, "bad_frame", str(exc))
            route = self._routes.get(req.method)
            if route is None:
                self._send(conn, ErrorReply(req.id, "no_such_method", f"no method {req.method!r}"))
                continue
            slots.acquire()
            if route.inline:
                self._run(conn, route, req, slots)
            else:
                self._pool.submit(self._run, conn, route, req, slots)

    def _run(self, conn: Connection, route: _Route, req: Request, slots: Any) -> None:
        reply: Envelope
        try:
            params = req.params
            if route.request_type is not None:
                params = route.request_type.from_dict(params)
            result = route.fn(params, conn) if route.pass_conn else route.fn(params)
            if isinstance(result, Deferred):
                later = _Route(lambda _params: result.finish(), None, False, False)
                self._pool.submit(self._run, conn, later, req, slots)
                slots = None  # that run releases it
                return
            reply = Response(req.id, result)  # encoded (and checked) by _send
        except ProtocolError as exc:
            reply = ErrorReply(req.id, "bad_params", str(exc), type(exc).__name__)
        except KVPoolError as exc:
            reply = ErrorReply(req.id, "kvpool", str(exc), type(exc).__name__)
        except Exception as exc:
            log.exception("handler %r failed", req.method)
            reply = ErrorReply(req.id, "internal", str(exc), type(exc).__name__)
        finally:
            if slots is not None:
                slots.release()
        self._send(conn, reply)

    def _send(self, conn: Connection, reply: Envelope) -> None:
        try:
            frame = encode_frame(encode_envelope(reply), max_frame=self.config.max_frame)
        except Exception as exc:  # result not encodable (msgpack's TypeError, too large, ...)
            error = ErrorReply(reply.id, "internal", f"unencodable result: {exc}")  # type: ignore[union-attr]
            frame = encode_frame(encode_envelope(error), max_frame=self.config.max_frame)
        try:
            conn.send_frame(frame)
        except OSError:
            conn.close()
