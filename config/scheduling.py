"""What the fleet scheduler knows of a request: one typed object from the producer to the engine.

A job's ``SchedulingMeta`` is written with its record and carried in its
messages, so every component that orders work (the dispatch that picks the
next job of a model, the engine's waiting queue) reads the same four facts
instead of loose arguments.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class SchedulingMeta:
    """``priority``: 0-9, 9 most urgent (strict across bands).  ``tenant``: whose service the job is charged
    to (fair share within a band).  ``deadline``: the latest start time (Redis clock, seconds since the epoch),
    or None.  ``arrival``: when the job was accepted (Redis clock), the last tie-breaker.  ``session``: the
    request's ``prompt_cache_key`` (else its ``user``), or None: placement keeps a session's jobs on one worker
    when no worker holds a prefix of its prompt (``fleet.placement``)."""

    tenant: str = DEFAULT_TENANT
    priority: int = 5
    deadline: float | None = None
    arrival: float = 0.0
    session: str | None = None

    def order_within_tenant(self) -> tuple[float, float]:
        """Earliest start deadline first (none = last), then arrival."""
        return (self.deadline if self.deadline is not None else math.inf, self.arrival)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> SchedulingMeta:
        deadline = raw.get("deadline")
        return cls(tenant=str(raw.get("tenant") or DEFAULT_TENANT), priority=int(raw.get("priority", 5)),
                   deadline=None if deadline in (None, "") else float(deadline),
                   arrival=float(raw.get("arrival") or 0.0), session=raw.get("session") or None)
