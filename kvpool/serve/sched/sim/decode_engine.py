"""One node's continuous decode batch in the simulator, simulated per epoch.

Decode batches are simulated per *epoch*, not per step: between two changes
of a batch (a join, a finish, a stall) the step time grows linearly with the
step index (``DecodeCostModel``: weights + every request's KV), so the time
of any step and the number of steps before a time are closed forms. Each
epoch is logged once; a request's inter-token gaps (and so its P90 TBT) are
read back from the log when it finishes. This is exact for the cost model and
keeps a 10,000-request trace well under a minute.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque

from kvpool.serve.sched.cost_model import DecodeCostModel


class DecodeEngine:
    """One node's continuous decode batch, simulated epoch by epoch.

    Step ``s`` (global index) takes ``a + b * (s - s0)`` seconds inside an
    epoch that starts at step ``s0``, where ``a`` is the step time at ``s0``
    and ``b = per_token_s * batch`` (every request's context grows one token
    per step). ``stall`` (coupled nodes) is time spent prefilling at the
    current step boundary before the next step runs.
    """

    def __init__(self, cost: DecodeCostModel) -> None:
        self.cost = cost
        self.capacity_tokens = cost.kv_capacity_tokens
        self.s = 0  # step index of the current boundary
        self.tb = 0.0  # time the boundary was reached (before the stall)
        self.stall = 0.0  # prefill time at this boundary before the next step
        self.batch = 0
        self.sum_base = 0  # sum over members of (context at join - join step)
        self.ends: list[tuple[int, int]] = []  # (end step, rid)
        self.version = 0
        self.reserved = 0  # KV tokens reserved by members (prompt + reply)
        self.waiting: deque[int] = deque()
        self.waiting_tokens = 0
        # epoch log
        self.seg_s: list[int] = []
        self.seg_e: list[int] = []
        self.seg_t0: list[float] = []
        self.seg_a: list[float] = []
        self.seg_b: list[float] = []
        self.stall_s: list[int] = []
        self.stall_t: list[float] = []

    # -- clock ------------------------------------------------------------------------

    def _a(self) -> float:
        c = self.cost
        return (
            c.base_s
            + c.per_request_s * self.batch
            + c.per_token_s * (self.sum_base + self.batch * self.s)
        )

    def busy_until(self) -> float:
        """When the node can next start a prefill (coupled) or the batch next changes."""
        return self.tb + self.stall

    def _advance(self, n: int) -> None:
        if n <= 0 or self.batch == 0:
            return
        a, b = self._a(), self.cost.per_token_s * self.batch
        t0 = self.tb + self.stall
        if self.stall > 0:
            self.stall_s.append(self.s)
            self.stall_t.append(self.stall)
        self.seg_s.append(self.s)
        self.seg_e.append(self.s + n)
        self.seg_t0.append(t0)
        self.seg_a.append(a)
        self.seg_b.append(b)
        self.tb = t0 + n * a + b * n * (n - 1) / 2
        self.s += n
        self.stall = 0.0

    def _steps_until(self, dt: float) -> int:
        """Smallest n with (time of n steps) >= dt."""
        if dt <= 0:
            return 0
        a, b = self._a(), self.cost.per_token_s * self.batch
        if b <= 0:
            n = math.ceil(dt / a)
        else:
            # b/2 n^2 + (a - b/2) n - dt = 0
            p = a - b / 2
            n = math.ceil((-p + math.sqrt(p * p + 2 * b * dt)) / b)
        n = max(n, 0)
        while n > 0 and (n - 1) * a + b * (n - 1) * (n - 2) / 2 >= dt:
            n -= 1
        while n * a + b * n * (n - 1) / 2 < dt:
            n += 1
        return n

    def sync(self, t: float) -> None:
        """Move the boundary to the first step boundary at or after ``t`` (no finishes)."""
        if self.batch == 0:
            if self.tb + self.stall <= t:
                if self.stall > 0:
                    self.stall_s.append(self.s)
                    self.stall_t.append(self.stall)
                self.tb, self.stall = t, 0.0
            return
        t0 = self.tb + self.stall
        if t <= t0:
            return
        n_max = self.ends[0][0] - self.s
        self._advance(min(self._steps_until(t - t0), n_max))

    def next_wake(self) -> float | None:
        if self.batch == 0:
            return None
        n = self.ends[0][0] - self.s
        a, b = self._a(), self.cost.per_token_s * self.batch
        return self.tb + self.stall + n * a + b * n * (n - 1) / 2

    # -- membership -------------------------------------------------------------------

    def join(self, rid: int, context: int, steps: int) -> int:
        """Add a request at the current boundary for ``steps`` steps; returns its join step."""
        j = self.s
        self.batch += 1
        self.sum_base += context - j
        heapq.heappush(self.ends, (j + steps, rid))
        return j

    def add_stall(self, t: float, seconds: float) -> float:
        """A prefill of ``seconds`` at the next boundary; returns when it ends."""
        self.sync(t)
        self.stall += seconds
        return self.tb + self.stall

    def finish_due(self) -> list[int]:
        """Advance to the earliest end and pop every request ending there."""
        n = self.ends[0][0] - self.s
        self._advance(n)
        done = []
        while self.ends and self.ends[0][0] == self.s:
            done.append(heapq.heappop(self.ends)[1])
        return done

    def leave(self, context_at_join: int, join_step: int) -> None:
        self.batch -= 1
        self.sum_base -= context_at_join - join_step

    # -- reading the log ----------------------------------------------------------------

    def _seg(self, step: int) -> int:
        return bisect.bisect_right(self.seg_s, step) - 1

    def step_time(self, step: int) -> tuple[float, float]:
        """(start time, duration) of a logged step."""
        i = self._seg(step)
        k = step - self.seg_s[i]
        a, b = self.seg_a[i], self.seg_b[i]
        return self.seg_t0[i] + k * a + b * k * (k - 1) / 2, a + b * k

    def gaps_over(self, join: int, end: int, first_token_t: float, slo: float) -> tuple[int, float]:
        """(gaps longer than ``slo``, the first gap) of a member over steps [join, end)."""
        start, d = self.step_time(join)
        first = start + d - first_token_t
        over = 1 if first > slo else 0
        lo = join + 1
        i = self._seg(lo) if lo < end else len(self.seg_s)
        while i < len(self.seg_s) and self.seg_s[i] < end:
            s0, s1 = max(lo, self.seg_s[i]), min(end, self.seg_e[i])
            if s1 > s0:
                a, b = self.seg_a[i], self.seg_b[i]
                if b <= 0:
                    k_star = 0 if a > slo else s1 - self.seg_s[i]
                else:
                    k_star = max(0, math.floor((slo - a) / b) + 1)
                over += max(0, s1 - max(s0, self.seg_s[i] + k_star))
            i += 1
        j = bisect.bisect_left(self.stall_s, lo)
        while j < len(self.stall_s) and self.stall_s[j] < end:
            _, d = self.step_time(self.stall_s[j])
            if d <= slo < d + self.stall_t[j]:
                over += 1
            j += 1
        return over, first
