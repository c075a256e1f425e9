"""A client's supply of put grants: the stock, its refills, its claims, what goes back.

``GrantStock`` (kvpool.cluster.client.grants) is the thread-safe stock itself;
``GrantClaims`` claims stocked grants on their nodes ahead of the puts. This
class runs them for one client session: it tops the stock up in the
background when it runs low (an ``ALLOCATE`` with no keys whose reply is
stocked on the RPC reader thread), hands a put a grant whose node still has
the region it was granted in, and gives back, claim first, every grant that
will not be used.

Invariants:
- a grant leaves the stock once: to a put (``take``), or back to the master
  (``revoke_stale``, ``close``, or ``take`` finding its node's region changed);
- a grant given back has its claim released first, so the node never keeps a
  range held for a grant nobody will fill (every later claim there would wait,
  then fail ``BUSY``);
- a refill never blocks a put: it is sent without waiting, and a put that finds
  the stock empty allocates the classic way.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from typing import Any

from kvpool.cluster.client.claims import GrantClaims
from kvpool.cluster.client.grants import Grant, GrantStock, use_window
from kvpool.cluster.client.session import ClientSession
from kvpool.cluster.wire import ALLOCATE, REVOKE, AllocateReply, AllocateRequest, IdsRequest
from kvpool.errors import KVPoolError


class GrantSupply:
    """Put grants for one client session (see the module docstring)."""

    def __init__(self, session: ClientSession, budget_bytes: int) -> None:
        self._session = session
        self.stock = GrantStock(budget_bytes)
        self._claims = GrantClaims(session, self.stock)

    @property
    def enabled(self) -> bool:
        return self.stock.budget_bytes > 0

    def take(self, size: int) -> tuple[Grant, int] | None:
        """A grant for a block of ``size`` bytes whose node still has the region it
        was granted in, with its claim (``GrantStock.was_claimed``: 0 if the put must
        claim the range itself, else the clock read before the claim was sent)."""
        regions = self._session.regions
        while (grant := self.stock.take(size)) is not None:
            region = regions.get(grant.node_id)  # the same object unless it changed
            if region is grant.region or region == grant.region:
                return grant, self.stock.was_claimed(grant.alloc_id)
            self._claims.release([grant.alloc_id])  # never revoke a range still claimed
            self.revoke([grant.alloc_id])
        return None

    def allocate(self, request: AllocateRequest, use_grants: bool) -> AllocateReply:
        """The classic allocation of ``request``'s blocks, asking (``use_grants``) for
        spare grants of its first block's size on the way: stocked and claimed here."""
        spare_size = request.sizes[0]
        request.avoid = self._session.suspects.current()
        request.spare = self.stock.wants_refill(spare_size) if use_grants else 0
        request.spare_size = spare_size if request.spare else 0
        reply = self._session.rpc.call(ALLOCATE, request, response_type=AllocateReply)
        self.absorb(spare_size, reply)
        return reply

    def top_up(self, size: int) -> None:
        """Ask for more grants of ``size`` without waiting, when the stock runs low."""
        want = self.stock.wants_refill(size)
        if not want:
            return
        request = AllocateRequest(
            [], [], [], spare=want, spare_size=size, avoid=self._session.suspects.current()
        )
        try:
            fut = self._session.rpc.submit(ALLOCATE, request)
        except KVPoolError:
            return  # the next put allocates the classic way
        self.stock.refilling(size, fut, lambda f: self._refilled(size, f))

    def absorb(self, size: int, reply: AllocateReply, fut: Future[Any] | None = None) -> None:
        """Stock the spare grants an allocation's ``reply`` carries, and claim them."""
        self._session.learn(reply.nodes)
        expires = time.monotonic() + use_window(reply.spare_ttl)
        regions = self._session.regions
        grants = [Grant(a, n, o, regions.get(n), expires, reply.epoch) for a, n, o in reply.spares]
        self.stock.add(size, grants, fut)
        if grants:
            self._claims.claim_soon()  # same-host puts then skip their claim

    def renew_claims(self, cutoff_ns: int) -> None:
        """Claim again, in the background, every stocked grant whose claim was sent
        before ``cutoff_ns``."""
        old = self.stock.claims_older_than(cutoff_ns)
        if old:
            self._claims.renew(old)

    def forget_node(self, node_id: str) -> None:
        """The node's region changed or failed: its grants are useless now (the
        janitor revokes them: this may run on the RPC reader thread)."""
        self.stock.forget_node(node_id)

    def node_failed(self, node_id: str) -> None:
        """A write to the node failed: forget its grants and avoid it in the next
        allocations (kvpool.cluster.client.suspects)."""
        self._session.suspects.report(node_id)
        self.forget_node(node_id)

    def revoke_stale(self) -> None:
        """Give back the grants dropped or too old to use (the janitor's tick)."""
        stale = self.stock.stale()
        self._claims.release(stale)
        self.revoke(stale)

    def revoke(self, ids: list[int]) -> None:
        """Tell the master these allocations or grants will never be committed."""
        if ids:
            with contextlib.suppress(KVPoolError):
                self._session.rpc.submit(REVOKE, IdsRequest(ids))

    def close(self) -> None:
        """Give back every grant (the client is closing; refills on their way first)."""
        self.stock.settle(timeout=1.0)
        self._claims.close()
        unused = self.stock.drain()
        self._claims.release(unused)
        self.revoke(unused)

    def _refilled(self, size: int, fut: Future[Any]) -> None:
        """Runs on the RPC reader thread: stock the grants (cheap, no calls)."""
        reply = None
        with contextlib.suppress(Exception):
            reply = AllocateReply.from_dict(fut.result(timeout=0))
        if reply is None:
            self.stock.add(size, [], fut)
        else:
            self.absorb(size, reply, fut)
