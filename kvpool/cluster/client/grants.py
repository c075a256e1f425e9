"""Client-side stock of put grants: space the master handed out before the keys.

A put normally costs two master round trips: allocate (where do the bytes
go?) and commit (make them visible). A grant answers the first question in
advance: the master reserves a range of a given size on some node, with no
key; the client writes a block there and binds the key in its commit. So a
put that finds a grant costs one round trip. Grants ride on allocate calls
the client makes anyway (``AllocateRequest.spare``) and are topped up in the
background before they run out.

Invariants:
- a grant is handed out by ``take`` at most once, and only while it is fresh:
  younger than ``use_s`` (at most half the master's grant TTL, so the commit
  arrives before the master expires it; and under the master's re-join grace,
  so a master restart cannot hand the same range to another writer while a
  stale grant is being filled);
- grants on a node are dropped as soon as the client learns that node's region
  changed (a restarted node) or a write to it failed;
- ``stale``/``drain`` return every grant that will never be used, so the
  caller can revoke them (they would expire anyway);
- a size's stock depth (``target``) stays within ``BASE_STOCK``..``MAX_STOCK`` and
  the budget: it doubles only when a put found no grant while the refill or the
  claims meant for it were on their way (once per refill), and halves when grants
  of that size expire unused.
Thread-safe: one lock guards the stock.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

DEFAULT_GRANT_BYTES = 64 << 20  # per client and block size
#: grants per block size a client starts with, where the budget allows: a refill
#: (asked for at half) lasts 32 puts. Each refill costs the putting client an ALLOCATE
#: sent and a claim exchange (same host); 32 grants at 1 MiB instead of 64 left a tight
#: loop's p90 at 91-105 us against 67-74 us, and 3% of its same-host puts without a
#: claimed grant against 0.3-1% (bench/RESULTS.md, issue 17 session 20; 16 -> 32 in
#: session 6).
BASE_STOCK = 64
#: the deepest a stock grows (within the budget): doubled from ``BASE_STOCK`` each time
#: a put found it empty while its refill, or the claims of its grants, were still on
#: their way -- 32 puts of 64 KiB take ~0.5 ms here, a refill and its claims 1-3 ms
#: beside them, and each put that found no grant went the general way (~1 ms: 15-19
#: per 512 puts, two thirds of a burst's time); halved back when grants expire unused
#: (a slower client), so an idle one holds few (issue 17, session 31).
MAX_STOCK = 512
MAX_USE_S = 1.0  # below the master's default re-join grace (2 s)
#: How long the straight path waits for its oldest grant's claim on its way before the
#: put goes the general way (``take_claimed``): 1% of the puts of 512-put bursts met a
#: refill's claims out, and each general-way put cost 0.3-3 ms, most of the burst's time;
#: a chunk of claims comes back in 0.1-2.2 ms on the Intel VM (issue 17, session 37).
CLAIM_WAIT_S = 0.003


@dataclass(frozen=True)
class Grant:
    alloc_id: int
    node_id: str
    offset: int
    region: Any  # the node's RegionInfo when granted (identity-compared)
    expires: float  # monotonic time after which it is not used
    epoch: int = 0  # the master term that granted it (writes are stamped with it)


class GrantStock:
    """Grants per block size, refilled by background allocate calls."""

    def __init__(self, budget_bytes: int = DEFAULT_GRANT_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError("put grant budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._stock: dict[int, deque[Grant]] = {}
        self._refills: dict[int, Future[Any]] = {}
        self._dead: list[int] = []  # dropped before use, not yet revoked
        self._reached: dict[int, int] = {}  # size -> stock level after the last refill
        self._depth: dict[int, int] = {}  # size -> grants to keep (BASE_STOCK if absent)
        self._deepened: set[int] = set()  # sizes deepened since their last refill landed
        self.used = self.refills = 0
        # Grants claimed on their node (kvpool.cluster.client.fenced): a same-host put
        # skips the claim round trip. alloc id -> (grant, size, CLOCK_MONOTONIC ns read
        # before the claim was sent, its seal deadline's base: 1 if unknown, never 0)
        self._claimed: dict[int, tuple[Grant, int, int]] = {}
        self._claiming: set[int] = set()
        self._renewing: set[int] = set()  # being claimed again (``claims_older_than``)
        self._claims_landed = threading.Condition(self._lock)  # ``claimed`` notifies
        self._taken_while_claiming: set[int] = set()  # their put claims them itself

    def target(self, size: int) -> int:
        """How many grants of ``size`` bytes to keep in stock (0: grants off): the
        size's depth, ``BASE_STOCK`` to ``MAX_STOCK``, within the budget."""
        if size <= 0:
            return 0
        return min(self._depth.get(size, BASE_STOCK), self.budget_bytes // size)

    def counters(self) -> dict[str, Any]:
        """For ``stats()``: grants used, refills that brought some, and the sizes
        whose stock was deepened with their depth now."""
        with self._lock:
            return {
                "put_grants_used": self.used,
                "put_grant_refills": self.refills,
                "put_grant_depths": dict(self._depth),
            }

    def _found_none(self, size: int, oldest: Grant | None) -> None:
        """(Under the lock.) A put found no grant of ``size`` bytes it could use. If
        the refill of that size, or the first claim of its ``oldest`` grant, was still
        on its way, the stock ran out faster than it is refilled at this client's pace:
        double its depth (once per refill, up to ``MAX_STOCK``)."""
        held_up = oldest is not None and oldest.alloc_id in self._claiming - self._renewing
        late = size in self._refills or held_up
        if late and size not in self._deepened:
            self._deepened.add(size)
            self._depth[size] = min(2 * self._depth.get(size, BASE_STOCK), MAX_STOCK)

    def take(self, size: int) -> Grant | None:
        """A fresh grant for a block of ``size`` bytes, or None."""
        now = time.monotonic()
        with self._lock:
            stock = self._stock.get(size)
            while stock:
                grant = stock.popleft()
                if grant.expires > now:
                    self.used += 1
                    if grant.alloc_id in self._claiming:
                        self._taken_while_claiming.add(grant.alloc_id)
                    return grant
                # Too old to use: ``stale`` hands it to the janitor, which releases its
                # claim on the node and revokes it (dropped here silently, its claim
                # held the range for ever: every later claim there failed BUSY, seen
                # after a master restart made puts wait past their grants' window).
                self._dead.append(grant.alloc_id)
            self._found_none(size, None)
        return None

    def oldest(self, size: int) -> Grant | None:
        """The grant of ``size`` bytes ``take`` tries first (not taken), or None."""
        with self._lock:
            stock = self._stock.get(size)
            if stock:
                return stock[0]
            self._found_none(size, None)
            return None

    def take_this(self, size: int, grant: Grant) -> int | None:
        """Take ``grant`` if still the oldest of ``size`` bytes and fresh (a put choosing
        its path by the grant's node looks first: ``oldest``); its claim, or None."""
        with self._lock:
            stock = self._stock.get(size)
            if not stock or stock[0] is not grant or grant.expires <= time.monotonic():
                return None
            stock.popleft()
            self.used += 1
            if grant.alloc_id in self._claiming:
                self._taken_while_claiming.add(grant.alloc_id)
            claim = self._claimed.pop(grant.alloc_id, None)  # now the put's (was_claimed)
            return 0 if claim is None else claim[2]

    def take_claimed(self, size: int, wait_s: float = 0.0) -> tuple[Grant, int, bool] | None:
        """``take`` and ``was_claimed`` in one, for the sealed put's straight path
        (kvpool.cluster.client.sealed_put): the oldest grant of ``size`` bytes if it
        is fresh and holds its node's claim, else None with nothing taken (the
        general path's ``take`` then deals with it). With the claim's clock (as
        ``was_claimed``) and whether ``wants_refill`` would ask for more now. When
        the oldest grant's claim is on its way, waits up to ``wait_s`` in all for the
        oldest grant's (the lock released meanwhile; see ``CLAIM_WAIT_S``): another
        put may take that one first, then it looks at the next."""
        now = time.monotonic()
        lock = self._lock
        lock.acquire()  # not ``with``: once per same-host put (~0.1 us less)
        try:
            stock = self._stock.get(size)
            if not stock:
                self._found_none(size, None)
                return None
            grant = stock[0]
            claim = self._claimed.pop(grant.alloc_id, None)
            if claim is None:
                self._found_none(size, grant)
                if wait_s <= 0:
                    return None
                give_up = now + wait_s
                while claim is None and grant.alloc_id in self._claiming:
                    left = give_up - time.monotonic()
                    if left <= 0:
                        return None
                    self._claims_landed.wait(left)
                    if not stock:
                        return None
                    grant = stock[0]  # (another put may have taken the one waited for)
                    claim = self._claimed.pop(grant.alloc_id, None)
                if claim is None:  # not being claimed (refused, or never asked)
                    return None
                now = time.monotonic()
            if grant.expires <= now:
                self._claimed[grant.alloc_id] = claim
                return None
            stock.popleft()
            self.used += 1
            return grant, claim[2], self._refill_size(size) > 0
        finally:
            lock.release()

    def put_back(self, grant: Grant, size: int, claimed_at: int) -> None:
        """Undo ``take_claimed``: ``grant`` is the oldest again, with its claim (the
        put took the general path, which takes it next)."""
        with self._lock:
            self._stock.setdefault(size, deque()).appendleft(grant)
            self._claimed[grant.alloc_id] = (grant, size, claimed_at)
            self.used -= 1

    def wants_refill(self, size: int) -> int:
        """How many grants to ask for now: when the stock is down to half of what
        the last refill reached (the master may lend fewer than the target), and
        no refill is on its way; else 0."""
        with self._lock:
            return self._refill_size(size)

    def _refill_size(self, size: int) -> int:
        """(Under the lock.) ``wants_refill``'s answer."""
        if size in self._refills:
            return 0
        want = self.target(size)
        have = len(self._stock.get(size, ()))
        level = min(want, self._reached.get(size, want))
        return want - have if have <= level // 2 else 0

    def refilling(self, size: int, fut: Future[Any], absorb: Callable[[Future[Any]], None]) -> None:
        """Track an in-flight refill; ``absorb`` runs when it completes."""
        with self._lock:
            self._refills[size] = fut
        fut.add_done_callback(absorb)

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for in-flight refills to be absorbed (the
        client is closing: a refill landing after ``drain`` would stock grants
        nobody revokes, held on the master until they expire)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pending = list(self._refills.values())
        for fut in pending:
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline:  # the absorbing callback runs after result()
            with self._lock:
                if not self._refills:
                    return
            time.sleep(0.001)

    def add(self, size: int, grants: list[Grant], refill: Future[Any] | None = None) -> None:
        with self._lock:
            if refill is not None and self._refills.get(size) is refill:
                del self._refills[size]
                self._deepened.discard(size)
            stock = self._stock.setdefault(size, deque())
            stock.extend(grants)
            if refill is not None or grants:
                self._reached[size] = len(stock)
            self.refills += bool(grants)

    def to_claim(self) -> list[tuple[Grant, int]]:
        """Grants in stock not claimed on their node yet (marked as being claimed)."""
        with self._lock:
            found = [
                (g, size)
                for size, stock in self._stock.items()
                for g in stock
                if g.alloc_id not in self._claimed and g.alloc_id not in self._claiming
            ]
            self._claiming.update(g.alloc_id for g, _ in found)
        return found

    def claimed(
        self, grants: list[tuple[Grant, int]], ok: list[bool], at_ns: int = 0
    ) -> list[tuple[Grant, int]]:
        """Record which claims succeeded (``at_ns``: the clock read before they
        were sent; 0: unknown). Returns the successful claims of grants
        dropped meanwhile (stale, their node changed, the client closing): the
        caller must release them, or the node would keep their ranges held from
        the next allocation there. A grant a put took meanwhile is returned too:
        that put made its own claim (``was_claimed`` said no), so this one is
        redundant -- and it may have reached the node after the put's seal, its
        commit and a remove had ended the block, holding the freed range for
        nothing (seen under load: every later claim there waited 2 s, BUSY). So is a
        failed renewal (``claims_older_than``): its first claim is still held, after a
        master restart by an aborted entry no fresh allocation could claim past."""
        orphans = []
        with self._lock:
            stocked = {g.alloc_id for stock in self._stock.values() for g in stock}
            for (grant, size), good in zip(grants, ok, strict=True):
                self._claiming.discard(grant.alloc_id)
                renewal = grant.alloc_id in self._renewing
                self._renewing.discard(grant.alloc_id)
                taken = grant.alloc_id in self._taken_while_claiming
                self._taken_while_claiming.discard(grant.alloc_id)
                if good and grant.alloc_id in stocked and not taken:
                    self._claimed[grant.alloc_id] = (grant, size, max(1, at_ns))
                elif good or renewal:
                    orphans.append((grant, size))
            self._claims_landed.notify_all()
        return orphans

    def claims_older_than(self, cutoff_ns: int) -> list[tuple[Grant, int]]:
        """The stocked grants whose claim was sent before ``cutoff_ns`` (its clock
        unknown counts as old), oldest first, marked as being claimed: the caller
        claims them again (``GrantClaims.renew``), and ``take_claimed`` waits for that."""
        with self._lock:
            old = [
                (grant, size)
                for size, stock in self._stock.items()
                for grant in stock
                if (claim := self._claimed.get(grant.alloc_id)) is not None and claim[2] < cutoff_ns
            ]
            for grant, _ in old:
                del self._claimed[grant.alloc_id]
                self._claiming.add(grant.alloc_id)
                self._renewing.add(grant.alloc_id)  # (a wait for it is no sign of a thin stock)
        return old

    def was_claimed(self, alloc_id: int) -> int:
        """Whether a grant just taken holds its node's claim (then it is the put's):
        0 if not, else the clock (ns) read before the claim was sent (1: unknown)."""
        with self._lock:
            found = self._claimed.pop(alloc_id, None)
            return 0 if found is None else found[2]

    def claimed_in_stock(self) -> int:
        """How many grants in stock hold their node's claim already."""
        with self._lock:
            return sum(g.alloc_id in self._claimed for s in self._stock.values() for g in s)

    def claims_of(self, ids: list[int]) -> list[tuple[Grant, int]]:
        """Remove and return the claims held by these (dropped) grants."""
        with self._lock:
            found = [c for i in ids if (c := self._claimed.pop(i, None)) is not None]
            return [(grant, size) for grant, size, _ in found]

    def forget_node(self, node_id: str) -> None:
        """Drop every grant on ``node_id`` (``stale`` returns them for revoking)."""
        with self._lock:
            for stock in self._stock.values():
                keep = [g for g in stock if g.node_id != node_id]
                self._dead += [g.alloc_id for g in stock if g.node_id == node_id]
                stock.clear()
                stock.extend(keep)

    def stale(self) -> list[int]:
        """Remove and return the ids of grants dropped or too old to use; a size
        whose grants expired unused has its depth halved (``BASE_STOCK`` at least)."""
        now = time.monotonic()
        with self._lock:
            gone, self._dead = self._dead, []
            for size, stock in self._stock.items():
                expired = len(gone)
                while stock and stock[0].expires <= now:
                    gone.append(stock.popleft().alloc_id)
                if len(gone) > expired and size in self._depth:
                    self._depth[size] = max(BASE_STOCK, self._depth[size] // 2)
        return gone

    def drain(self) -> list[int]:
        """Remove and return every grant's id (the client is closing)."""
        with self._lock:
            gone = self._dead + [g.alloc_id for stock in self._stock.values() for g in stock]
            self._stock.clear()
            self._dead = []
        return gone

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._stock.values())


def use_window(spare_ttl: float) -> float:
    """Seconds a grant may be used after it was granted."""
    return min(MAX_USE_S, 0.5 * spare_ttl)


def grant_budget(explicit: int | None = None) -> int:
    """Bytes of grants a client keeps per block size: ``explicit``, else
    ``$KVPOOL_PUT_GRANT_BYTES``, else 64 MiB (0 turns grants off)."""
    if explicit is not None:
        return explicit
    raw = os.environ.get("KVPOOL_PUT_GRANT_BYTES", "")
    try:
        budget = int(raw) if raw else DEFAULT_GRANT_BYTES
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(f"KVPOOL_PUT_GRANT_BYTES must be an integer >= 0, got {raw!r}")
    return budget
