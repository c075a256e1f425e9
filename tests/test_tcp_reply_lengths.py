"""A reply header whose length no data server would send: the client drops the stream.

Every reply of the TCP data path carries a length in its header (tcp_wire
``RESP``). An error's message is short (``tcp_wire.MAX_MESSAGE`` at most; a refused
checked read's, padded as long as an ok reply, at most that reply), so a larger
length means the stream is out of sync -- a bug, a peer that is not our server, a
reply read at the wrong place. Each receive path checks it before it makes a buffer
that long: ``ConnectionLostError`` at once, never a ``MemoryError`` or a host
swapping to hold 2**62 bytes. A scripted peer answers every call with such a header.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.errors import ConnectionLostError
from kvpool.transport import tcp_wire as w
from kvpool.transport.fencing import IDENT, WriteStamp
from kvpool.transport.tcp_conn import DataConn

HUGE = 1 << 62
STAMP = WriteStamp(1, 1, 0, 64, bytes(16), None).pack()


@pytest.fixture(params=[w.ST_OK, w.ST_RANGE, w.ST_STALE])
def conn(request: pytest.FixtureRequest) -> Iterator[DataConn]:
    """A connection to a peer that answers the first request with ``status`` and a
    length of 2**62, then 64 KiB of zeros (enough for any receive that waits for a
    whole small reply), then holds the connection open."""
    status = request.param
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            w.answer_hello(sock, None, "", "test")
            sock.recv(1 << 16)  # the request, whatever it is
            sock.sendall(w.RESP.pack(status, 1, HUGE) + bytes(1 << 16))
            done.wait(10)

    threading.Thread(target=serve, daemon=True).start()
    data = DataConn("127.0.0.1", listener.getsockname()[1], None, 5.0)
    yield data
    done.set()
    data.close()
    listener.close()


def _block() -> np.ndarray:
    return np.zeros(64, np.uint8)


CALLS: dict[str, Callable[[DataConn], object]] = {
    "read_one": lambda c: c.read_one(0, _block()),
    "read_block": lambda c: c.read_block(0, _block(), IDENT.pack(bytes(16), 0)),
    "read_blocks": lambda c: c.read_blocks([(0, _block(), bytes(16), 0)], 1 << 20),
    "write_many": lambda c: c.write_many([(0, _block())]),
    "stamped_one": lambda c: c.stamped_one(w.OP_WRITE_COMMIT, STAMP, 0, _block()),
    "stamped_many": lambda c: c.stamped_many([(w.OP_CLAIM, STAMP, 0, None)]),
    "commit_outcomes": lambda c: c.commit_outcomes([(1, 0)], 0.1),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_impossible_reply_length_drops_the_stream(conn: DataConn, call: str) -> None:
    with pytest.raises(ConnectionLostError, match="out of sync"):
        CALLS[call](conn)


def test_message_length_allows_up_to_its_bound() -> None:
    assert w.message_length(w.MAX_MESSAGE) == w.MAX_MESSAGE
    assert w.message_length(5, 5) == 5
    with pytest.raises(ConnectionLostError, match="a reply of 6 B"):
        w.message_length(6, 5)
