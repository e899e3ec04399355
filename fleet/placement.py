"""Which worker runs a job: the one holding its prompt's longest cached prefix, weighed against load.

Each GPU worker's prefix cache is known by the names of its blocks (``workers/engine/block_hash``), and each
waiting job by the names of its prompt's blocks.  The cost of job J on worker w, in tokens (NVIDIA Dynamo's
router): the prompt tokens w would compute, past the longest run of J's leading blocks that w holds, plus
``load_weight`` x the tokens w already has to compute::

    cost(J, w) = prompt_tokens(J) - block_size x matched(J, w) + load_weight x load_tokens(w)

Placement stays a *pull*: a worker X with a free seat asks for a job, and ``decide`` picks, among the first
jobs of the fleet order (``FairQueue.candidates``: the highest band only, tenants by counter), the first X
may take:

- no live worker holds any of J's blocks (nor is J's session's last worker live: below): anyone may (blind
  pull, ``by_load``);
- X costs at most ``slack_tokens`` more than every other live worker with a free seat (``by_cache`` when X
  holds part of J, else ``by_load``): a hot prefix spreads once its worker is loaded or full;
- (session affinity) when no worker holds any of J's blocks but J's session (``prompt_cache_key`` or
  ``user``) last ran on a live worker S, S counts as holding ``session_blocks`` blocks (``by_session``);
- J has waited ``steal_s`` (``stolen``): a job whose worker died, drains or is busy runs elsewhere.

When X may take none, nothing changes hands: X is told which worker to nudge (the cheapest for the first
candidate, once per job) and when to ask again (the soonest a candidate may be stolen).  Strict priority is
kept (only the highest band is looked at), and within it the fleet order restricted to what X may take now.

Plain Python, no I/O: the oracle the Redis claim (``store/dispatch.py``) is tested against.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

DECODE_TOKEN_COST = 0.25  # a token still to generate weighs this much of a prompt token to compute (load)


def load_tokens(pending: list[tuple[int, int]]) -> float:
    """A worker's load from the sequences it holds, each (prompt tokens not yet computed, output tokens it may
    still generate): what a new job's prefill queues behind."""
    return sum(prompt + DECODE_TOKEN_COST * output for prompt, output in pending)


@dataclass(frozen=True)
class PlacementPolicy:
    block_size: int = 16
    load_weight: float = 1.0
    slack_tokens: float = 32.0
    steal_s: float = 0.5
    candidates: int = 8  # jobs of the fleet order looked at per claim
    per_tenant: int = 2  # of them, at most this many per tenant
    session_blocks: int = 4  # a session's last worker counts as holding this many blocks when none holds any


@dataclass(frozen=True)
class WorkerLoad:
    """A live GPU worker as placement sees it: its prefix cache's block names, the tokens it has yet to compute
    (queued and running, and claimed since it last said), and its free seats."""

    name: str
    cached: Collection[str]
    load_tokens: float = 0.0
    free_seats: int = 1


@dataclass(frozen=True)
class Candidate:
    """A waiting job: its prompt's block names (leading blocks, at most a bound), its prompt length, since when
    it waits (the Redis clock), the worker it was nudged to, and its session's last worker, if any."""

    key: str
    blocks: Sequence[str]
    prompt_tokens: int
    since: float
    nudged: str | None = None
    session_worker: str | None = None  # the worker its session's last job was placed on (affinity)


@dataclass(frozen=True)
class Decision:
    key: str | None  # the job to take, or None: take nothing now
    reason: str  # by_cache, by_session, by_load, stolen; or skipped
    nudge: str | None = None  # with skipped: a worker to send a token to (None: nudged already, or nobody)
    retry_in: float = 0.0  # with skipped: seconds until a candidate may be stolen


def matched(blocks: Sequence[str], cached: Collection[str]) -> int:
    """How many of the leading blocks are cached (the prefix cache finds a chain, not single blocks)."""
    n = 0
    for name in blocks:
        if name not in cached:
            break
        n += 1
    return n


def cost(job: Candidate, worker: WorkerLoad, policy: PlacementPolicy, held: int | None = None) -> float:
    """``held``: the job's leading blocks the worker holds (default: counted from its cache)."""
    held = matched(job.blocks, worker.cached) if held is None else held
    return max(job.prompt_tokens - policy.block_size * held, 0) + policy.load_weight * worker.load_tokens


def holdings(job: Candidate, workers: Sequence[WorkerLoad], policy: PlacementPolicy) -> dict[str, int]:
    """Worker -> the job's leading blocks it holds.  When none holds any, its session's last worker counts as
    holding ``session_blocks`` (affinity for prompts whose prefix changed, e.g. a summarised history)."""
    held = {w.name: matched(job.blocks, w.cached) for w in workers}
    if not any(held.values()) and job.session_worker in held:
        held[job.session_worker] = policy.session_blocks
    return held


def judge(job: Candidate, claimer: WorkerLoad, workers: Mapping[str, WorkerLoad], now: float,
          policy: PlacementPolicy) -> tuple[str, WorkerLoad | None]:
    """(reason, the worker preferred over the claimer): reason is by_cache, by_session, by_load or stolen when
    the claimer may take ``job``, else skipped."""
    everyone = {**workers, claimer.name: workers.get(claimer.name, claimer)}
    held = holdings(job, list(everyone.values()), policy)
    if not any(held.values()):
        return "by_load", None
    others = [w for w in everyone.values() if w.name != claimer.name and w.free_seats > 0]
    best = min(others, key=lambda w: (cost(job, w, policy, held[w.name]), w.name), default=None)
    if best is None or cost(job, claimer, policy, held[claimer.name]) <= \
            cost(job, best, policy, held[best.name]) + policy.slack_tokens:
        if not held[claimer.name]:
            return "by_load", None
        return ("by_cache" if matched(job.blocks, claimer.cached) else "by_session"), None
    if now - job.since >= policy.steal_s:
        return "stolen", best
    return "skipped", best


def decide(candidates: Sequence[Candidate], claimer: str, workers: Mapping[str, WorkerLoad], now: float,
           policy: PlacementPolicy) -> Decision:
    """What ``claimer`` takes among ``candidates`` (fleet order).  ``workers``: the live workers by name; a
    claimer without an entry holds nothing and has no load."""
    me = workers.get(claimer) or WorkerLoad(claimer, ())
    if not candidates:
        return Decision(None, "skipped")
    nudge: str | None = None
    for i, job in enumerate(candidates):
        reason, best = judge(job, me, workers, now, policy)
        if reason != "skipped":
            return Decision(job.key, reason)
        if i == 0 and best is not None and job.nudged != best.name:
            nudge = best.name
    retry_in = min(job.since + policy.steal_s - now for job in candidates)
    return Decision(None, "skipped", nudge, max(retry_in, 0.0))
