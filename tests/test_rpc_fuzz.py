"""Hypothesis-generated malformed and truncated frames against a server process.

Property: whatever bytes a client sends (before or after the handshake), the
server answers only with well-formed frames, closes that connection once the
client stops sending, and keeps answering a good client.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.rpc import RpcClient, encode_frame
from kvpool.rpc.frame import HEADER, HEADER_SIZE, MAGIC, decode_body, parse_header
from kvpool.rpc.messages import Hello, decode_envelope, encode_envelope

SERVER = r"""
import sys
from kvpool.rpc import RpcServer, ServerConfig
s = RpcServer(ServerConfig(port=0, max_frame=1 << 16, handshake_timeout=5))
s.register("echo", lambda p: p)
print(s.start()[1], flush=True)
sys.stdin.read()
s.close()
"""

HELLO = encode_frame(encode_envelope(Hello(version=1, name="fuzz")))


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    yield int(proc.stdout.readline())
    proc.stdin.close()
    proc.wait(timeout=10)


def _frame(body: object) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(MAGIC, 1, 0, len(payload)) + payload


wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=16)
    | st.text(max_size=8)
    | st.floats(allow_nan=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
bodies = st.one_of(
    wire_values.map(_frame),  # well-framed garbage
    st.fixed_dictionaries(
        {
            "t": st.sampled_from(["req", "res", "err", "hello", "x"]),
            "id": wire_values,
            "method": wire_values,
            "params": wire_values,
        }
    ).map(_frame),
    st.tuples(
        st.binary(min_size=2, max_size=2),
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ).map(lambda t: HEADER.pack(t[0], t[1], t[2], t[3]) + t[4]),  # random headers
    st.binary(max_size=200),  # raw noise
)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes pending: RST
            data = b""
        if not data:
            return b"".join(chunks)
        chunks.append(data)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(handshake=st.booleans(), junk=bodies, cut=st.integers(0, 300))
def test_malformed_frames(port: int, handshake: bool, junk: bytes, cut: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        data = (HELLO if handshake else b"") + junk[: max(1, cut)]  # possibly truncated
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server already answered and closed
            pass
        reply = _read_all(s)  # the server must close: recv returns EOF, never hangs
    pos = 0
    while pos + HEADER_SIZE <= len(reply):  # what arrived (before any RST) is well-formed
        n = parse_header(reply[pos : pos + HEADER_SIZE])
        decode_envelope(decode_body(reply[pos + HEADER_SIZE : pos + HEADER_SIZE + n]))
        pos += HEADER_SIZE + n


def test_server_survives_fuzzing(port: int) -> None:
    with RpcClient(("127.0.0.1", port), timeout=5) as c:
        assert c.call_many([("echo", i) for i in range(20)]) == list(range(20))
