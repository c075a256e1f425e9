"""Control-plane RPC: msgpack frames over TCP (the public face of ``kvpool.rpc_*``).

- ``rpc_frame``: the frame format (magic, version, length; max frame size);
- ``rpc_messages``: typed envelopes and the ``WireMessage`` base for payloads;
- ``rpc_auth``: the shared-token rule;
- ``rpc_server`` / ``rpc_client``: the threaded server and the pipelining client.

Usage::

    server = RpcServer(ServerConfig(host="127.0.0.1", port=7480, token=None))
    server.register("ping", lambda params: {"pong": params})
    host, port = server.start()
    with RpcClient((host, port), timeout=5.0) as client:
        client.call("ping", 1)                       # -> {"pong": 1}
        futs = [client.submit("ping", i) for i in range(8)]   # pipelined
"""

from kvpool.rpc.auth import TOKEN_ENV, check_bind, is_loopback, resolve_token
from kvpool.rpc.client import RpcClient, parse_address
from kvpool.rpc.frame import DEFAULT_MAX_FRAME, encode_frame, read_frame
from kvpool.rpc.messages import PROTOCOL_VERSION, WireMessage
from kvpool.rpc.server import Connection, RpcServer, ServerConfig

__all__ = [
    "DEFAULT_MAX_FRAME",
    "PROTOCOL_VERSION",
    "TOKEN_ENV",
    "Connection",
    "RpcClient",
    "RpcServer",
    "ServerConfig",
    "WireMessage",
    "check_bind",
    "encode_frame",
    "is_loopback",
    "parse_address",
    "read_frame",
    "resolve_token",
]
