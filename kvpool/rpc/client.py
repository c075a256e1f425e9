"""msgpack-RPC client: one TCP connection, many calls in flight.

``submit`` sends a request and returns a Future immediately; a reader thread
matches responses to futures by request id, in whatever order the server
completes them. ``call`` is ``submit`` + wait with a timeout.

Invariants:
- a call never waits past its timeout: it raises ``CallTimeoutError`` and a
  late response for it is dropped;
- when the connection dies (EOF, reset, undecodable frame) every pending call
  fails at once with ``ConnectionLostError`` and the next call reconnects
  (with ``reconnect=True``) or raises ``ConnectionLostError``; a request is
  never silently re-sent;
- a refused handshake raises ``HandshakeRefusedError`` with the server's reason;
- remote failures raise ``RemoteError``, or the kvpool error class of the same
  name when the server raised a KVPoolError (looked up in ``kvpool.errors``
  only; nothing is unpickled or imported by name).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvpool import errors
from kvpool.args import parse_address
from kvpool.errors import (
    CallTimeoutError,
    ConnectionLostError,
    HandshakeRefusedError,
    KVPoolError,
    ProtocolError,
    RemoteError,
)
from kvpool.rpc.auth import resolve_token
from kvpool.rpc.frame import (
    DEFAULT_MAX_FRAME,
    FrameReader,
    encode_frame,
    set_io_timeout,
    tune_socket,
)
from kvpool.rpc.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    Request,
    Response,
    WireMessage,
    decode_envelope,
    encode_envelope,
)

W = TypeVar("W", bound=WireMessage)


def remote_exception(err: ErrorReply) -> KVPoolError:
    """The local exception for a remote failure (kvpool classes by name, else RemoteError)."""
    if err.code == "kvpool":
        cls = getattr(errors, err.type, None)
        if isinstance(cls, type) and issubclass(cls, KVPoolError):
            try:
                return cls(err.message)
            except TypeError:  # constructors with other signatures
                pass
    return RemoteError(err.code, err.message, err.type)


class RpcClient:
    def __init__(
        self,
        address: str | tuple[str, int],
        *,
        token: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        name: str = "",
        max_frame: int = DEFAULT_MAX_FRAME,
        reconnect: bool = True,
    ) -> None:
        self.host, self.port = parse_address(address)
        self.token = resolve_token(token)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.name, self.max_frame, self.reconnect = name, max_frame, reconnect
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _sock/_pending and serializes sends
        self._pending: dict[int, Future[Any]] = {}
        self._sock: socket.socket | None = None
        self._closed = False
        self.server_name = ""
        self._connect()

    # --- connection -----------------------------------------------------------

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise ConnectionLostError(f"connect to {self.host}:{self.port} timed out") from exc
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        reader = FrameReader(sock)
        try:
            tune_socket(sock)
            hello = Hello(version=PROTOCOL_VERSION, token=self.token, name=self.name)
            sock.sendall(encode_frame(encode_envelope(hello)))
            body = reader.read(max_frame=self.max_frame, idle_ok=False)
            if body is None:
                raise ConnectionLostError(f"{self.host}:{self.port} closed during handshake")
            reply = decode_envelope(body)
        except TimeoutError as exc:
            sock.close()
            raise ConnectionLostError(f"handshake with {self.host}:{self.port} timed out") from exc
        except (OSError, ProtocolError):
            sock.close()
            raise
        if isinstance(reply, ErrorReply):
            sock.close()
            raise HandshakeRefusedError(f"{reply.code}: {reply.message}")
        if not isinstance(reply, HelloReply):
            sock.close()
            raise ProtocolError(f"expected a hello reply, got {type(reply).__name__}")
        if not reply.ok:
            sock.close()
            raise HandshakeRefusedError(reply.reason)
        self.server_name = reply.server
        # Paces the reader (an idle wait ends each timeout) and bounds every send. A
        # kernel timeout, not settimeout: no poll before each of the reader's recvs.
        set_io_timeout(sock, max(self.timeout, 1.0))
        self._sock = sock
        threading.Thread(target=self._reader, args=(sock, reader), daemon=True).start()

    def _reader(self, sock: socket.socket, reader: FrameReader) -> None:
        reason = "connection closed by server"
        try:
            while True:
                body = reader.read(max_frame=self.max_frame, idle_ok=True)
                if body is None:
                    break
                msg = decode_envelope(body)
                if isinstance(msg, ErrorReply) and msg.id == 0:
                    reason = f"server closed the connection: {msg.code}: {msg.message}"
                    break
                if not isinstance(msg, Response | ErrorReply):
                    raise ProtocolError(f"unexpected {type(msg).__name__} from server")
                with self._lock:
                    fut = self._pending.pop(msg.id, None)
                if fut is None:
                    continue  # timed out and abandoned
                if isinstance(msg, Response):
                    fut.set_result(msg.result)
                else:
                    fut.set_exception(remote_exception(msg))
        except (OSError, ProtocolError) as exc:
            reason = f"connection lost: {exc}"
        self._fail_all(sock, reason)

    def _fail_all(self, sock: socket.socket, reason: str) -> None:
        with self._lock:
            if self._sock is sock:
                self._sock = None
            pending, self._pending = self._pending, {}
        with contextlib.suppress(OSError):
            sock.close()
        for fut in pending.values():
            fut.set_exception(ConnectionLostError(f"{self.host}:{self.port}: {reason}"))

    # --- calls ------------------------------------------------------------------

    def submit(self, method: str, params: Any = None) -> Future[Any]:
        """Send one request now; the Future resolves to its result (or raises)."""
        fut: Future[Any] = Future()
        req = Request(next(self._ids), method, params)  # encoding walks params once
        frame = encode_frame(encode_envelope(req), max_frame=self.max_frame)
        with self._lock:
            if self._closed:
                raise ConnectionLostError("client is closed")
            if self._sock is None:
                if not self.reconnect:
                    raise ConnectionLostError(f"not connected to {self.host}:{self.port}")
                self._connect()
            sock = self._sock
            assert sock is not None
            self._pending[req.id] = fut
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._pending.pop(req.id, None)
                sock.close()  # a partial frame leaves the stream unusable
                raise ConnectionLostError(f"send to {self.host}:{self.port} failed: {exc}") from exc
        fut.request_id = req.id  # type: ignore[attr-defined]
        return fut

    def wait(self, fut: Future[Any], timeout: float | None = None) -> Any:
        """Result of a submitted call, or CallTimeoutError after ``timeout`` seconds."""
        t = self.timeout if timeout is None else timeout
        try:
            return fut.result(timeout=t)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(getattr(fut, "request_id", -1), None)
            raise CallTimeoutError(
                f"call to {self.host}:{self.port} timed out after {t} s"
            ) from None

    def call(
        self,
        method: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        response_type: type[W] | None = None,
    ) -> Any:
        result = self.wait(self.submit(method, params), timeout)
        return response_type.from_dict(result) if response_type is not None else result

    def call_many(
        self, calls: Iterable[tuple[str, Any]], *, timeout: float | None = None
    ) -> list[Any]:
        """Pipeline several calls on the connection; results in call order.

        ``timeout`` bounds the whole batch, not each call.
        """
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        futs = [self.submit(m, p) for m, p in calls]
        return [self.wait(f, max(0.0, deadline - time.monotonic())) for f in futs]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            self._fail_all(sock, "client closed")

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
