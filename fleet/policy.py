"""Which job next: strict priority, then fair share across tenants, then deadline and arrival.

The order among the waiting jobs of one model (DESIGN.md, "Fleet scheduling"):

1. **Priority bands, strictly.**  No job of a lower band is chosen while a job
   of a higher band waits.
2. **Within a band, the least-served tenant.**  Each tenant has a virtual
   token counter (VTC, Sheng et al., OSDI 2024): the tokens it was served
   (prompt and output, each with its cost) divided by its weight.  The
   tenant with the lowest counter goes next, so two backlogged tenants'
   weighted service never drifts apart by more than about twice the largest
   request's cost.  A tenant that had nothing waiting and comes back starts at
   the lowest counter among the tenants still waiting (``lift``): idle time
   banks no credit, and a returning tenant is not starved either.
3. **Within a tenant, earliest start deadline, then arrival.**

Seats: when every seat of a worker is taken, a tenant holding fewer of them
than its share (``seat_share``: the seats split by weight among the
tenants holding some and itself) may still take one, in place of a sequence of the
most-seated tenant of its band (preempted, recomputed later from the prefix
cache).  Without it, a tenant that arrives after another's flood filled every
seat waits until the flood's running jobs end, however low its counter.

``FairQueue`` is that order in plain Python (no I/O): the test oracle, and
the engine-side order.  Service is charged with ``charge`` as it is given
(the dispatcher charges the prompt when a job is claimed and output tokens as
they are produced); the order depends only on the counters at the moment of
the choice.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pagedq.config.scheduling import SchedulingMeta

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class TokenCosts:
    """What one token costs a tenant's counter (the VTC paper weighs output tokens above prompt tokens)."""

    prompt: float = 1.0
    output: float = 1.0

    def of(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.prompt * prompt_tokens + self.output * output_tokens


@dataclass
class VirtualTokenCounters:
    """Per tenant: weighted service so far.  ``weights`` maps tenant -> weight (> 0, default ``default_weight``)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    costs: TokenCosts = field(default_factory=TokenCosts)
    counters: dict[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        w = float(self.weights.get(tenant, self.default_weight))
        if w <= 0:
            raise ValueError(f"weight of tenant {tenant!r} must be > 0, not {w}")
        return w

    def get(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> float:
        """Add service given to ``tenant``; returns its new counter."""
        value = self.get(tenant) + self.costs.of(prompt_tokens, output_tokens) / self.weight(tenant)
        self.counters[tenant] = value
        return value

    def lift(self, tenant: str, active: list[str]) -> None:
        """A tenant becoming active starts no lower than the least-served of the ``active`` ones."""
        others = [self.get(t) for t in active if t != tenant]
        if others:
            self.counters[tenant] = max(self.get(tenant), min(others))


def seat_share(held: Mapping[str, int], tenant: str, seats: int,
               weight: Callable[[str], float] = lambda _: 1.0, joining: str | None = None) -> int:
    """``tenant``'s share of one worker's ``seats``: split by weight among the tenants holding some, ``tenant``
    and ``joining`` (a tenant about to take a seat; rounded down)."""
    tenants = {t for t, n in held.items() if n > 0} | {tenant} | ({joining} if joining else set())
    return int(seats * weight(tenant) / sum(weight(t) for t in tenants) + 1e-9)


def below_share(held: Mapping[str, int], seats: int,
                weight: Callable[[str], float] = lambda _: 1.0) -> Callable[[str], bool]:
    """Whether a tenant holds fewer seats than its share (it may take one when all are taken)."""
    return lambda tenant: held.get(tenant, 0) < seat_share(held, tenant, seats, weight)


class FairQueue(Generic[K]):
    """The waiting jobs of one model, popped in the fleet order (module docstring).

    Invariants: every key is in at most one place; ``_bands[p][tenant]`` is a non-empty heap of
    ``(deadline, arrival, seq, key)``; a tenant is *active* while it has a key in any band.
    """

    def __init__(self, counters: VirtualTokenCounters | None = None) -> None:
        self.counters = counters or VirtualTokenCounters()
        self._bands: dict[int, dict[str, list[tuple[float, float, int, K]]]] = {}
        self._where: dict[K, SchedulingMeta] = {}
        self._waiting_of: dict[str, int] = {}  # tenant -> keys waiting, any band
        self._seq = itertools.count()  # ties after (deadline, arrival) keep insertion order

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self):
        """The waiting keys, in no particular order."""
        return iter(self._where)

    @property
    def active_tenants(self) -> list[str]:
        return [t for t, n in self._waiting_of.items() if n > 0]

    def push(self, key: K, meta: SchedulingMeta) -> None:
        if key in self._where:
            raise KeyError(f"{key!r} is already waiting")
        if not self._waiting_of.get(meta.tenant):
            self.counters.lift(meta.tenant, self.active_tenants)
        self._where[key] = meta
        self._waiting_of[meta.tenant] = self._waiting_of.get(meta.tenant, 0) + 1
        heap = self._bands.setdefault(meta.priority, {}).setdefault(meta.tenant, [])
        heapq.heappush(heap, (*meta.order_within_tenant(), next(self._seq), key))

    def peek(self, only: Callable[[str], bool] | None = None) -> K | None:
        """The key ``pop`` would return, or None when nothing waits.  With ``only``: the first key in the same
        order among the tenants ``only`` accepts, in the highest band alone (strict priority), or None."""
        choice = self._choose(only)
        return None if choice is None else choice[2][0][3]

    def candidates(self, k: int, per_tenant: int = 2) -> list[K]:
        """The first ``k`` keys of the highest band in the fleet order, at most ``per_tenant`` of each tenant:
        tenants by counter (ties: the earliest head), each tenant's keys in its own order.  What placement
        chooses among (``fleet.placement``)."""
        if not self._bands:
            return []
        tenants = self._bands[max(self._bands)]
        keys: list[K] = []
        for tenant in sorted(tenants, key=lambda t: (self.counters.get(t), tenants[t][0][:3])):
            keys += [entry[3] for entry in heapq.nsmallest(per_tenant, tenants[tenant])]
            if len(keys) >= k:
                break
        return keys[:k]

    def pop(self) -> K | None:
        """Remove and return the next key in the fleet order, or None when nothing waits."""
        choice = self._choose()
        if choice is None:
            return None
        priority, tenant, heap = choice
        key = heapq.heappop(heap)[3]
        self._forget(key, priority, tenant, heap)
        return key

    def remove(self, key: K) -> bool:
        """Take ``key`` out wherever it waits (cancelled, expired, claimed elsewhere); False if it was not there."""
        meta = self._where.get(key)
        if meta is None:
            return False
        heap = self._bands[meta.priority][meta.tenant]
        heap[:] = [e for e in heap if e[3] != key]
        heapq.heapify(heap)
        self._forget(key, meta.priority, meta.tenant, heap)
        return True

    def _choose(self, only: Callable[[str], bool] | None = None) -> tuple[int, str, list] | None:
        if not self._bands:
            return None
        priority = max(self._bands)
        tenants = self._bands[priority]
        if only is not None:
            tenants = {t: heap for t, heap in tenants.items() if only(t)}
            if not tenants:
                return None
        # The least-served tenant; equal counters go to the tenant whose head job is earliest.
        tenant = min(tenants, key=lambda t: (self.counters.get(t), tenants[t][0][:3]))
        return priority, tenant, tenants[tenant]

    def _forget(self, key: K, priority: int, tenant: str, heap: list) -> None:
        del self._where[key]
        self._waiting_of[tenant] -= 1
        if not heap:
            del self._bands[priority][tenant]
            if not self._bands[priority]:
                del self._bands[priority]
