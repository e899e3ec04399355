"""The fleet's fair queue in Redis: a worker with room claims the next job of a model, atomically.

A generated job (its ``GenerateJob``) waits in its model's fair queue until a
worker that can start it soon claims it.  The order of ``claim`` is the fleet
order of ``pagedq.fleet.policy.FairQueue`` (the test oracle), computed in one
Lua script:

1. the highest priority band with a job waiting (strictly);
2. in it, the tenant with the least virtual token counter (``names.vtc``;
   equal counters: the tenant whose head job comes first);
3. in the tenant, the earliest start deadline, then arrival, then push order.

Keys (config/names.py): per model, one sorted set per (band, tenant)
(``fair_band``: member ``arrival|seq|job id``, score the deadline), a set of
the tenants waiting per band (``fair_tenants``), a hash tenant -> jobs
waiting (``fair_waiting``: the *active* tenants), the push counter
(``fair_seq``) and the counters (``vtc``); across models, ``fair_index``
(job id -> where it waits, or the slot it is bound to) and ``fair_message``
(its GenerateJob JSON).

Counters: a claim charges the tenant ``(prompt tokens + n x max_tokens) / weight``
(weights: ``names.tenant_weights``, missing or invalid = 1); ``refund`` gives
back the unused output at the end; ``release`` gives back the whole claim
charge (the job is charged again when claimed again).  A tenant with nothing
waiting that pushes a job is lifted to the least counter of the active
tenants (idle time banks no credit).  Counters are doubles written as
``%.17g``, so Lua and Python compute the same values bit for bit.

Invariants: a job id is in ``fair_index`` from ``push`` until ``unbind`` or
``remove`` (or a claim that finds it ended); while there it is either in
exactly one band set (waiting) or bound to exactly one slot, never both; a
slot key names at most one job, and that job's index entry names the slot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from pagedq.config.messages import GenerateJob, parse_message, to_json
from pagedq.config.names import Names
from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.fleet.placement import PlacementPolicy

BANDS = range(9, -1, -1)  # priority 9 (most urgent) first
SESSION_TTL_S = 600  # placement remembers a session's last worker this long after its last claim

# Shared Lua: put entry ``e`` (decoded fair_index value) into its band, lifting a returning tenant first;
# take a waiting member out of its band.  Both keep fair_tenants / fair_waiting in step with the band sets.
_LIB = """
local function fmt(x) return string.format('%.17g', x) end
local function enqueue(e)
  local waiting = e.prefix .. 'waiting'
  if tonumber(redis.call('HGET', waiting, e.tenant) or '0') <= 0 then
    local low
    for _, t in ipairs(redis.call('HKEYS', waiting)) do
      if t ~= e.tenant then
        local c = tonumber(redis.call('HGET', e.vtc, t) or '0')
        if low == nil or c < low then low = c end
      end
    end
    if low ~= nil and low > tonumber(redis.call('HGET', e.vtc, e.tenant) or '0') then
      redis.call('HSET', e.vtc, e.tenant, fmt(low))
    end
  end
  redis.call('HINCRBY', waiting, e.tenant, 1)
  redis.call('ZADD', e.prefix .. 'band:' .. e.priority .. ':' .. e.tenant, e.deadline, e.member)
  redis.call('SADD', e.prefix .. 'tenants:' .. e.priority, e.tenant)
end
local function weight_of(weights, tenant)  -- missing or invalid = 1
  local w = tonumber(redis.call('HGET', weights, tenant) or '1')
  if w == nil or w <= 0 then return 1 end
  return w
end
local function member_id(member) return string.match(member, '^[^|]*|[^|]*|(.*)$') end
local function give_back(vtc, weights, tenant, tokens)
  local c = tonumber(redis.call('HGET', vtc, tenant) or '0')
  redis.call('HSET', vtc, tenant, fmt(c - tokens / weight_of(weights, tenant)))
end
local function unqueue(prefix, priority, tenant, member)
  local band = prefix .. 'band:' .. priority .. ':' .. tenant
  if redis.call('ZREM', band, member) == 0 then return false end
  if redis.call('ZCARD', band) == 0 then redis.call('SREM', prefix .. 'tenants:' .. priority, tenant) end
  if redis.call('HINCRBY', prefix .. 'waiting', tenant, -1) <= 0 then redis.call('HDEL', prefix .. 'waiting', tenant) end
  return true
end
"""

# KEYS: fair index, fair message, the model's push counter. ARGV: job id, message JSON, entry JSON, arrival
# (fixed width).  Idempotent: a job already in the index (waiting or bound) is left as it is.
_PUSH = _LIB + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local e = cjson.decode(ARGV[3])
local clock = redis.call('TIME')
e.since = string.format('%d.%06d', clock[1], clock[2])  -- when it began to wait (placement's steal clock)
e.member = ARGV[4] .. '|' .. string.format('%012d', redis.call('INCR', KEYS[3])) .. '|' .. ARGV[1]
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(e))
redis.call('SET', KEYS[2], ARGV[2])
enqueue(e)
return 1
"""

# Shared by both claims.  KEYS: the model's counters, tenant weights, fair index, the slot.  ARGV: fair prefix,
# slot name, job-key prefix, fair-message prefix.  ``bind`` takes a waiting member out of its band and binds it
# to the slot, charging its tenant (counter ``c``): returns its message, or nil when the job was found ended,
# cancelling or gone (dropped: index entry and message).
_BIND = _LIB + """
if redis.call('EXISTS', KEYS[4]) == 1 then return redis.error_reply('SLOTBUSY ' .. ARGV[2]) end
local prefix = ARGV[1]
local function score(s) if s == 'inf' or s == '+inf' then return math.huge end return tonumber(s) end
local function weight(t) return weight_of(KEYS[2], t) end
local function bind(p, tenant, c, member)
  unqueue(prefix, p, tenant, member)
  local id = member_id(member)
  local raw = redis.call('HGET', KEYS[3], id)
  local st = redis.call('HGET', ARGV[3] .. id, 'state')
  local msg = redis.call('GET', ARGV[4] .. id)
  if raw and msg and (st == 'queued' or st == 'in_progress') then
    local e = cjson.decode(raw)
    local charge = tonumber(e.cost) / weight(tenant)
    redis.call('HSET', KEYS[1], tenant, fmt(c + charge))
    e.slot, e.charge = ARGV[2], fmt(charge)
    redis.call('HSET', KEYS[3], id, cjson.encode(e))
    redis.call('SET', KEYS[4], id)
    redis.call('HSET', ARGV[3] .. id, 'slot', ARGV[2])
    return msg
  end
  redis.call('HDEL', KEYS[3], id)
  redis.call('DEL', ARGV[4] .. id)
  return nil
end
"""

# KEYS, ARGV[1-4]: as _BIND.  ARGV[5]: '' or (a claim beyond the worker's seats) JSON {"held": {tenant: seats},
# "seats": n, "lowest": lowest running priority}.  Returns the claimed job's message, false when nothing waits,
# an error when the slot is bound already.  A job found ended, cancelling or gone is dropped and skipped.
# Beyond the seats only the highest band with a job waiting is looked at: any tenant if it outranks a running
# job, else the tenants below their weighted seat share (``fleet.policy.seat_share``).
_CLAIM = _BIND + """
local over = nil
if ARGV[5] ~= '' then over = cjson.decode(ARGV[5]) end
local function may_take(p, t)
  if over == nil or p > tonumber(over.lowest) then return true end
  local total = weight(t)
  for h, c in pairs(over.held) do if h ~= t and tonumber(c) > 0 then total = total + weight(h) end end
  return tonumber(over.held[t] or 0) < math.floor(tonumber(over.seats) * weight(t) / total + 1e-9)
end
for p = 9, 0, -1 do
  local tkey = prefix .. 'tenants:' .. p
  while true do
    local tenants = redis.call('SMEMBERS', tkey)
    if #tenants == 0 then break end
    local best, bc, bd, bm
    for _, t in ipairs(tenants) do
      local c = tonumber(redis.call('HGET', KEYS[1], t) or '0')
      local head = redis.call('ZRANGE', prefix .. 'band:' .. p .. ':' .. t, 0, 0, 'WITHSCORES')
      if #head == 0 then
        redis.call('SREM', tkey, t)  -- cannot happen while the invariants hold; heals if it does
      elseif may_take(p, t) then
        local d = score(head[2])
        if best == nil or c < bc or (c == bc and (d < bd or (d == bd and head[1] < bm))) then
          best, bc, bd, bm = t, c, d, head[1]
        end
      end
    end
    if best ~= nil then
      local msg = bind(p, best, bc, bm)
      if msg then return msg end
    elseif over ~= nil then
      return false  -- none of this band may take a seat beyond the worker's; no lower band either
    end
  end
end
return false
"""

# KEYS[1-4], ARGV[1-4]: as _BIND; KEYS[5]: the model's placement workers, KEYS[6]: its placement stats.
# ARGV[5]: worker-record prefix, ARGV[6]: cache-set prefix (``kv:<slug>:``), ARGV[7]: the claimer, ARGV[8]: the
# policy JSON (``fleet.placement.PlacementPolicy``), ARGV[9]: session-key prefix, ARGV[10]: a session's TTL (s).
# The rule of ``fleet.placement.decide`` over the first jobs of the highest band (``FairQueue.candidates``).
# Returns the claimed job's message; or {'skip', worker to nudge or '', seconds until a candidate may be stolen}
# (nothing changed but the nudge mark and the counters); false when nothing waits.
_CLAIM_PLACED = _BIND + """
local P = cjson.decode(ARGV[8])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local workers, me = {}, nil
for _, h in ipairs(redis.call('SMEMBERS', KEYS[5])) do
  local rec = redis.call('HMGET', ARGV[5] .. h, 'beat_at', 'ttl_s', 'load_tokens', 'claimed_tokens', 'free_seats')
  if not rec[1] then
    redis.call('SREM', KEYS[5], h)  -- its record is gone: it is dead
  elseif h == ARGV[7] or now - tonumber(rec[1]) <= tonumber(rec[2] or '15') / 2 then
    local w = {name = h, kv = ARGV[6] .. h, free = tonumber(rec[5] or '1'),
               load = tonumber(rec[3] or '0') + tonumber(rec[4] or '0')}
    workers[#workers + 1] = w
    if h == ARGV[7] then me = w end
  end
end
if me == nil then
  me = {name = ARGV[7], kv = ARGV[6] .. ARGV[7], free = 1, load = 0}
  workers[#workers + 1] = me
end
local function matched(w, blocks)
  local n = 0
  for _, b in ipairs(blocks) do
    if redis.call('SISMEMBER', w.kv, b) == 0 then break end
    n = n + 1
  end
  return n
end
local function cost(job, n, w)
  return math.max(job.prompt - P.block_size * n, 0) + P.load_weight * w.load
end
-- (reason, preferred worker) for one candidate, as fleet.placement.judge
-- Also returns the claimer's own cached blocks of the job (before any session credit).
local function judge(job)
  local held, any = {}, false
  for _, w in ipairs(workers) do
    held[w.name] = matched(w, job.blocks)
    if held[w.name] > 0 then any = true end
  end
  local mine = held[me.name]
  if not any and job.session and held[job.session] ~= nil then  -- affinity: its session's last worker
    held[job.session] = P.session_blocks
    any = P.session_blocks > 0
  end
  if not any then return 'by_load', nil, mine end
  local best, bcost
  for _, w in ipairs(workers) do
    if w ~= me and w.free > 0 then
      local c = cost(job, held[w.name], w)
      if best == nil or c < bcost or (c == bcost and w.name < best.name) then best, bcost = w, c end
    end
  end
  if best == nil or cost(job, held[me.name], me) <= bcost + P.slack_tokens then
    if held[me.name] == 0 then return 'by_load', nil, mine end
    if mine > 0 then return 'by_cache', nil, mine end
    return 'by_session', nil, mine
  end
  if now - job.since >= P.steal_s then return 'stolen', best, mine end
  return 'skipped', best, mine
end
for p = 9, 0, -1 do
  local tkey = prefix .. 'tenants:' .. p
  while true do
    local order = {}
    for _, t in ipairs(redis.call('SMEMBERS', tkey)) do
      local head = redis.call('ZRANGE', prefix .. 'band:' .. p .. ':' .. t, 0, P.per_tenant - 1, 'WITHSCORES')
      if #head == 0 then
        redis.call('SREM', tkey, t)
      else
        order[#order + 1] = {t = t, c = tonumber(redis.call('HGET', KEYS[1], t) or '0'), d = score(head[2]),
                             m = head[1], head = head}
      end
    end
    if #order == 0 then break end
    table.sort(order, function(a, b)
      if a.c ~= b.c then return a.c < b.c end
      if a.d ~= b.d then return a.d < b.d end
      return a.m < b.m
    end)
    local jobs = {}
    for _, o in ipairs(order) do
      for i = 1, #o.head, 2 do
        if #jobs < P.candidates then jobs[#jobs + 1] = {t = o.t, c = o.c, m = o.head[i]} end
      end
      if #jobs >= P.candidates then break end
    end
    local nudge, retry, dropped = '', nil, false
    for i, j in ipairs(jobs) do
      local id = member_id(j.m)
      local raw = redis.call('HGET', KEYS[3], id)
      local e = raw and cjson.decode(raw) or {}
      j.blocks, j.prompt, j.since = e.blocks or {}, tonumber(e.prompt or '0'), tonumber(e.since or now)
      if e.session then j.session = redis.call('GET', ARGV[9] .. e.session) or nil end
      local reason, best, mine = judge(j)
      if reason ~= 'skipped' then
        local msg = bind(p, j.t, j.c, j.m)
        if msg then
          redis.call('HINCRBY', KEYS[6], reason, 1)
          if e.session then redis.call('SET', ARGV[9] .. e.session, me.name, 'EX', ARGV[10]) end
          if redis.call('EXISTS', ARGV[5] .. me.name) == 1 then
            local computed = math.max(j.prompt - P.block_size * mine, 0)
            redis.call('HINCRBYFLOAT', ARGV[5] .. me.name, 'claimed_tokens', computed)
          end
          return msg
        end
        dropped = true
        break  -- the job had ended: choose again
      end
      if i == 1 and best ~= nil and e.nudged ~= best.name and raw then
        nudge, e.nudged = best.name, best.name
        redis.call('HSET', KEYS[3], id, cjson.encode(e))
        redis.call('HINCRBY', KEYS[6], 'nudged', 1)
      end
      local left = j.since + P.steal_s - now
      if retry == nil or left < retry then retry = left end
    end
    if not dropped then
      redis.call('HINCRBY', KEYS[6], 'skipped', 1)
      return {'skip', nudge, tostring(math.max(retry, 0))}
    end
  end
end
return false
"""

# Shared: a caller fenced at epoch ``fence`` ('' or nil: no fence) whose job was taken since by another worker
# (``store/jobs.py``: fencing) touches nothing of the slot: the slot, rebound by a restored token, is theirs now.
_FENCE = """
local function taken_since(job, fence)
  return fence ~= nil and fence ~= '' and tonumber(redis.call('HGET', job, 'epoch') or '0') ~= tonumber(fence)
end
"""

# KEYS: the slot, fair index. ARGV: slot name, job-key prefix, fair-message prefix, the fence (optional).  The
# bound job goes back to its place in its band (same member: its deadline, arrival and push order), its claim
# charge refunded.
_RELEASE = _LIB + _FENCE + """
local id = redis.call('GET', KEYS[1])
if not id then return false end
if taken_since(ARGV[2] .. id, ARGV[4]) then return false end
redis.call('DEL', KEYS[1])
local job = ARGV[2] .. id
if redis.call('HGET', job, 'slot') == ARGV[1] then redis.call('HDEL', job, 'slot') end
local raw = redis.call('HGET', KEYS[2], id)
if not raw then return id end
local e = cjson.decode(raw)
if e.slot ~= ARGV[1] then return id end
if e.charge then
  redis.call('HSET', e.vtc, e.tenant, fmt(tonumber(redis.call('HGET', e.vtc, e.tenant) or '0') - tonumber(e.charge)))
end
e.slot, e.charge = nil, nil
local st = redis.call('HGET', job, 'state')
if st == 'in_progress' then redis.call('HSET', job, 'state', 'queued') end
if (st == 'queued' or st == 'in_progress') and redis.call('EXISTS', ARGV[3] .. id) == 1 then
  redis.call('HSET', KEYS[2], id, cjson.encode(e))
  enqueue(e)
else
  redis.call('HDEL', KEYS[2], id)
  redis.call('DEL', ARGV[3] .. id)
end
return id
"""

# KEYS: the slot, fair index, the model's counters, tenant weights. ARGV: slot name, job-key prefix,
# fair-message prefix, the job expected ('' = any), its tenant, output tokens to give back (refunded whatever the
# slot holds), the fence ('' = none).  The job ended.  A slot bound to another job meanwhile is left alone; a
# fenced caller whose job was taken since gives back nothing (the restore that took it refunded its charge).
_UNBIND = _LIB + _FENCE + """
if ARGV[4] ~= '' and taken_since(ARGV[2] .. ARGV[4], ARGV[7]) then return false end
if tonumber(ARGV[6]) > 0 then give_back(KEYS[3], KEYS[4], ARGV[5], tonumber(ARGV[6])) end
local id = redis.call('GET', KEYS[1])
if not id then return false end
if ARGV[4] ~= '' and id ~= ARGV[4] then return false end
redis.call('DEL', KEYS[1])
if redis.call('HGET', ARGV[2] .. id, 'slot') == ARGV[1] then redis.call('HDEL', ARGV[2] .. id, 'slot') end
local raw = redis.call('HGET', KEYS[2], id)
if raw and cjson.decode(raw).slot == ARGV[1] then
  redis.call('HDEL', KEYS[2], id)
  redis.call('DEL', ARGV[3] .. id)
end
return id
"""

# KEYS: fair index, fair message. ARGV: job id.  Only a waiting job is removed (a bound one is its slot's).
_REMOVE = _LIB + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local e = cjson.decode(raw)
if e.slot then return 0 end
unqueue(e.prefix, e.priority, e.tenant, e.member)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""

# KEYS: the model's counters, tenant weights. ARGV: tenant, output tokens to give back.
_REFUND = _LIB + """
give_back(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]))
return 1
"""


@dataclass(frozen=True)
class SeatsHeld:
    """A worker with no free seat: its seats, the seats each tenant holds, the lowest priority running."""

    seats: int
    held: dict[str, int]
    lowest_priority: int


@dataclass(frozen=True)
class Skip:
    """A placed claim took nothing: every candidate is another worker's to take for now (``fleet.placement``).
    ``nudge``: a worker to send a token to (None: nudged already); ``retry_in``: seconds until one may be stolen."""

    nudge: str | None
    retry_in: float


class SlotBusy(RuntimeError):
    """``claim`` for a slot that is still bound: unbind or release it first."""


def _scheduling(job: GenerateJob) -> tuple[str, int, float | None, float]:
    """(tenant, priority 0-9, deadline, arrival) of a job.  The band is ``job.priority``, which every message
    has (``meta.priority`` equals it; a message from an older producer has only the default meta)."""
    meta = job.meta
    return (meta.tenant or DEFAULT_TENANT, min(max(int(job.priority), 0), 9), meta.deadline,
            float(meta.arrival or 0.0))


def _fence_arg(fence: int | None) -> str:
    return "" if fence is None else str(int(fence))


def arrival_key(arrival: float) -> str:
    """Fixed width, so that byte order is time order (microseconds; the Redis clock's resolution)."""
    return f"{max(arrival, 0.0):020.6f}"


class FairDispatch:
    """The fair queues of every model (module docstring).  Each method is one Lua call."""

    def __init__(self, r: redis.Redis, names: Names) -> None:
        self.r = r
        self.names = names
        self._job_prefix = names.job("")
        self._message_prefix = names.fair_message("")
        self._push = r.register_script(_PUSH)
        self._claim = r.register_script(_CLAIM)
        self._claim_placed = r.register_script(_CLAIM_PLACED)
        self._release = r.register_script(_RELEASE)
        self._unbind = r.register_script(_UNBIND)
        self._remove = r.register_script(_REMOVE)
        self._refund = r.register_script(_REFUND)

    def push(self, job: GenerateJob, blocks: list[str] | None = None) -> None:
        """The job waits in its model's fair queue; pushing a job already waiting or bound changes nothing.
        ``blocks``: the names of its prompt's leading blocks (``workers.engine.block_hash``), for placement."""
        tenant, priority, deadline, arrival = _scheduling(job)
        n = self.names
        entry = {"prefix": n.fair_prefix(job.model), "vtc": n.vtc(job.model), "model": job.model,
                 "priority": str(priority), "tenant": tenant,
                 "deadline": "+inf" if deadline is None else repr(float(deadline)),
                 "cost": str(len(job.prompt_token_ids) + job.params.max_output_tokens),
                 "prompt": str(len(job.prompt_token_ids))}
        if blocks:
            entry["blocks"] = list(blocks)
        if job.meta.session:
            entry["session"] = job.meta.session
        self._push(keys=[n.fair_index, n.fair_message(job.job_id), n.fair_seq(job.model)],
                   args=[job.job_id, json.dumps(to_json(job)), json.dumps(entry), arrival_key(arrival)])

    def claim(self, model: str, worker: str, slot: str, beyond: SeatsHeld | None = None) -> GenerateJob | None:
        """The next job of ``model`` in the fleet order, bound to ``slot`` and charged to its tenant; None when
        nothing waits.  ``worker`` names the claimer (for logs; the binding is the slot's).  With ``beyond`` (the
        worker has no free seat): only a job that may take a running job's seat (``_CLAIM``), or None."""
        n = self.names
        over = "" if beyond is None else json.dumps(
            {"held": beyond.held, "seats": beyond.seats, "lowest": beyond.lowest_priority})
        try:
            raw = self._claim(keys=[n.vtc(model), n.tenant_weights, n.fair_index, n.slot(slot)],
                              args=[n.fair_prefix(model), slot, self._job_prefix, self._message_prefix, over])
        except redis.ResponseError as e:
            if "SLOTBUSY" in str(e):
                raise SlotBusy(f"slot {slot!r} of {worker!r} is bound to job {self.bound_job(slot)!r}") from None
            raise
        return parse_message(GenerateJob, json.loads(raw)) if raw else None

    def claim_placed(self, model: str, worker: str, slot: str, policy: PlacementPolicy) -> GenerateJob | Skip | None:
        """As ``claim``, with cache-aware placement (``fleet.placement``): the first of the fleet order's first
        jobs that ``worker`` may take, bound to ``slot``; a ``Skip`` when each is another worker's for now; None
        when nothing waits."""
        n = self.names
        try:
            raw = self._claim_placed(
                keys=[n.vtc(model), n.tenant_weights, n.fair_index, n.slot(slot), n.placement_workers(model),
                      n.placement_stats(model)],
                args=[n.fair_prefix(model), slot, self._job_prefix, self._message_prefix, n.worker(""),
                      n.kv_blocks(model, ""), worker, json.dumps(asdict(policy)), n.placement_session(model, ""),
                      SESSION_TTL_S])
        except redis.ResponseError as e:
            if "SLOTBUSY" in str(e):
                raise SlotBusy(f"slot {slot!r} of {worker!r} is bound to job {self.bound_job(slot)!r}") from None
            raise
        if isinstance(raw, list):
            return Skip(raw[1] or None, float(raw[2]))
        return parse_message(GenerateJob, json.loads(raw)) if raw else None

    def placement_stats(self, model: str) -> dict[str, int]:
        """Counts of the model's placement decisions (by_cache, by_load, stolen, skipped, nudged)."""
        return {k: int(v) for k, v in self.r.hgetall(self.names.placement_stats(model)).items()}

    def bound_job(self, slot: str) -> str | None:
        """The job id ``slot`` is bound to, or None."""
        return self.r.get(self.names.slot(slot))

    def release(self, slot: str, fence: int | None = None) -> str | None:
        """The job bound to ``slot`` goes back to its place in its fair queue (state queued if it was
        in_progress; attempts untouched: call ``JobStore.requeue`` first to decide those), unbound, its claim
        charge refunded; a job that ended meanwhile is forgotten instead.  Returns its id, None if the slot was
        free (so a second release is a no-op).  ``fence``: the epoch the caller's worker took the job at; if
        another worker took it since, nothing changes and None is returned."""
        n = self.names
        return self._release(keys=[n.slot(slot), n.fair_index],
                             args=[slot, self._job_prefix, self._message_prefix, _fence_arg(fence)])

    def unbind(self, slot: str, job_id: str | None = None, model: str = "", tenant: str = "",
               refund: int = 0, fence: int | None = None) -> None:
        """The job bound to ``slot`` ended: forget the binding, its index entry and its message.  With ``job_id``,
        only if the slot is still bound to that job (a slot rebound to another job keeps it).  With ``refund`` >
        0, in the same call: ``refund(model, tenant, refund)``.  With ``job_id`` and ``fence`` (the epoch the
        caller's worker took it at): nothing at all if another worker took the job since; a worker that froze
        past its lease and woke must not unbind the slot its restored token has bound again elsewhere."""
        n = self.names
        self._unbind(keys=[n.slot(slot), n.fair_index, n.vtc(model), n.tenant_weights],
                     args=[slot, self._job_prefix, self._message_prefix, job_id or "", tenant, max(int(refund), 0),
                           _fence_arg(fence)])

    def remove(self, job_id: str) -> bool:
        """Take a waiting job out of its fair queue (with its message); False if it was not waiting."""
        n = self.names
        return bool(self._remove(keys=[n.fair_index, n.fair_message(job_id)], args=[job_id]))

    def remove_many(self, job_ids: list[str]) -> int:
        """``remove`` for many jobs in one round trip (a batch's cancel); returns how many were waiting."""
        n = self.names
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            self._remove(keys=[n.fair_index, n.fair_message(job_id)], args=[job_id], client=pipe)
        return sum(bool(x) for x in pipe.execute()) if job_ids else 0

    def refund(self, model: str, tenant: str, tokens: int) -> None:
        """Give back charged but unused output tokens (``max_tokens`` - generated) at the end of a job."""
        if tokens:
            self._refund(keys=[self.names.vtc(model), self.names.tenant_weights], args=[tenant, int(tokens)])

    def waiting(self, model: str) -> int:
        """Jobs waiting in the model's fair queue."""
        return sum(self.waiting_by_tenant(model).values())

    def waiting_by_tenant(self, model: str) -> dict[str, int]:
        """Tenant -> jobs of the model waiting (tenants with none are absent)."""
        return {t: int(c) for t, c in self.r.hgetall(self.names.fair_waiting(model)).items() if int(c) > 0}

    def counters(self, model: str) -> dict[str, float]:
        """Tenant -> virtual token counter of the model."""
        return {t: float(c) for t, c in self.r.hgetall(self.names.vtc(model)).items()}

    def is_waiting(self, job_id: str) -> bool:
        """True while the job waits in a fair queue (not bound to a slot)."""
        raw = self.r.hget(self.names.fair_index, job_id)
        return raw is not None and "slot" not in json.loads(raw)
