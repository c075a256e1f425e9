"""The shared-token rule for every kvpool server (RPC and data ports).

- A server bound to a loopback address may run without a token.
- A server bound to anything else (including 0.0.0.0 / ::) refuses to start
  without one (``InsecureBindError``).
- The token comes from ``--token`` or else the ``KVPOOL_TOKEN`` environment
  variable; an empty string means none.
- Tokens are compared in constant time; when a server has a token, every
  client must present exactly it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket

from kvpool.errors import InsecureBindError

TOKEN_ENV = "KVPOOL_TOKEN"


def resolve_token(explicit: str | None = None) -> str | None:
    """``explicit`` if given, else $KVPOOL_TOKEN; empty means no token."""
    token = explicit if explicit is not None else os.environ.get(TOKEN_ENV)
    return token or None


def is_loopback(host: str) -> bool:
    """True when ``host`` names only loopback (127.0.0.0/8, ::1, localhost)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, token: str | None) -> None:
    """Raise InsecureBindError for a non-loopback bind without a token."""
    if not token and not is_loopback(host):
        raise InsecureBindError(
            f"refusing to listen on {host!r} without a shared token: "
            f"pass --token or set {TOKEN_ENV} (only loopback may run without one)"
        )


def token_matches(expected: str | None, given: str | None) -> bool:
    """Constant-time check; a server without a token accepts any client."""
    if not expected:
        return True
    return hmac.compare_digest(expected.encode(), (given or "").encode())
