"""The Lua scripts: one per operation, each atomic on the server.

Conventions shared by every script:
- Time is the server's (``TIME``), in milliseconds; a window id is ``floor(seconds / 60)``.
  ``redis.replicate_commands()`` is called first where a script writes after reading the time
  (required before Redis 5, a no-op since).
- Every write re-applies an expiry, so no key ever lives without a TTL: leases ``PEXPIRE``
  lease TTL, window counters ``EXPIRE 120``, progress ``EX 3600``, breaker hashes a long TTL
  refreshed on each write.
- Replies carry integers only (milliseconds, counts, flags) and strings: Lua numbers are
  doubles and Redis truncates them to integers in replies, so no fraction ever crosses.
- Every key a script touches arrives in ``KEYS`` and carries the scope's hash tag (one slot);
  the window id is chosen by the caller and verified against ``TIME`` by the script.
- The limiter's operations reach keyed state through a few helpers (``counter``,
  ``counter_add``, ``lease_add``, ``hold_ms``...). A script of one operation gets them as plain
  commands (``_DIRECT``). The BATCH script, which runs many operations on the same few keys,
  gets them with the batch's memory (``_BATCHED``): the clock, a counter or a gate hash is
  read once per batch, and the writes whose order no operation can observe (increments of the
  window counters, expiries, hold times, the progress mark) are applied once per key at the
  end. What each operation decides and leaves behind is the same either way: the operations
  run one after another on one view of the keys, as separate scripts would
  (``tests/test_redis_batch_equivalence.py`` runs both on the same operations).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

_PRELUDE = """
-- Globals read once: Redis serves a script's globals through a read-only proxy table, and
-- every read of one through it costs about as much as a small command's own work.
local KEYS, ARGV, redis, math, string = KEYS, ARGV, redis, math, string
local tonumber, type, unpack, pcall, error, ipairs = tonumber, type, unpack, pcall, error, ipairs
if redis.replicate_commands then redis.replicate_commands() end
local GATE_FIELDS = {'state', 'epoch', 'failures', 'open_until', 'probe_until', 'probe_owner',
                     'abandoned_owner'}
"""

_SHARED_HELPERS = """
-- A typical hold time moves toward the newest (moving average, weight 0.2 for the newest, as
-- in the in-memory limiter's next_hold).
local function hold_update(key, duration)
  local previous = hold_ms(key)
  local value = duration
  if previous then value = previous + 0.2 * (duration - previous) end
  hold_set(key, math.floor(value))
end
-- A full concurrency gate's hint: the typical hold time of its released leases (1000 ms
-- before any), floored at 10 ms and capped by its oldest lease's expiry: the in-memory
-- limiter's slot_wait, so both backends report the same.
local function lease_wait(key, hold_key, now)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local expiry_in = tonumber(first[2]) - now
  local hold = hold_ms(hold_key)
  local estimate = 1000
  if hold then estimate = math.max(10, hold) end
  return math.max(0, math.min(expiry_in, estimate))
end
"""

_DIRECT = (
    _PRELUDE
    + """
-- The helpers as plain commands: one operation per script.
local function int(n) return string.format('%d', n) end
local num = tonumber
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(t[1])
end
-- Window counters: every write re-applies their expiry.
local function counter(key) return tonumber(redis.call('GET', key)) or 0 end
local function counter_add(key, n)
  redis.call('INCRBY', key, n)
  redis.call('EXPIRE', key, '120')
end
-- Lease sets: score = expiry (ms); the set lives as long as its newest lease.
local function leases_pruned(key, now) redis.call('ZREMRANGEBYSCORE', key, '-inf', now) end
local function lease_count(key) return redis.call('ZCARD', key) end
local function lease_add(key, expires, id, ttl_ms)
  local added = redis.call('ZADD', key, 'NX', expires, id)
  redis.call('PEXPIRE', key, ttl_ms)
  return added
end
local function lease_remove(key, id) return redis.call('ZREM', key, id) end
-- Lease ids given up by cancelled callers (usually none).
local function abandoned_has(key, id) return redis.call('ZSCORE', key, id) end
local function abandoned_add(key, now, id, ttl_ms)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, int(now + tonumber(ttl_ms)), id)
  redis.call('PEXPIRE', key, ttl_ms)
end
-- Typical hold times (ms, moving average), and the lease ids whose TPM delta was applied.
local function hold_ms(key) return tonumber(redis.call('GET', key)) end
local function hold_set(key, value) redis.call('SET', key, int(value), 'EX', '3600') end
local function settled_add(key, id, window_end)
  if redis.call('SADD', key, id) == 0 then return false end
  redis.call('EXPIREAT', key, window_end)
  return true
end
local function progress_set(key, ms) redis.call('SET', key, ms, 'EX', '3600') end
local function gate_fields(key) return redis.call('HMGET', key, unpack(GATE_FIELDS)) end
local function gate_changed(key) end
"""
    + _SHARED_HELPERS
)

_BATCHED = (
    _PRELUDE
    + """
-- The helpers with the batch's memory. Reads are made once per key and kept up to date by the
-- batch's own writes; counter increments, expiries, hold times and progress marks are applied
-- by flush() at the end, once per key, with the values the last of the operations left.
-- Numbers and their decimal strings, converted once per batch (a conversion costs as much as
-- a command): the operations' limits, TTLs and times are mostly the same few values.
local nums, ints = {}, {}
local function num(s)
  if s == nil then return nil end
  local n = nums[s]
  if n == nil then
    n = tonumber(s)
    if n ~= nil then nums[s] = n end
  end
  return n
end
local function int(n)
  local s = ints[n]
  if s == nil then
    s = string.format('%d', n)
    ints[n] = s
  end
  return s
end
local clock_ms, clock_s
local function now_ms()
  if not clock_ms then
    local t = redis.call('TIME')
    clock_s = tonumber(t[1])
    clock_ms = clock_s * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return clock_ms, clock_s
end
-- Each deferred write's keys are listed (``*_order``) in the order first written, so that
-- flush() writes in a fixed order. (Written out in each helper: a call per write costs more
-- than the write.)

local counts, count_adds, count_order = {}, {}, {}
local function counter_read(key)
  local n = tonumber(redis.call('GET', key)) or 0
  counts[key] = n
  return n
end
local function counter(key) return (counts[key] or counter_read(key)) + (count_adds[key] or 0) end
local function counter_add(key, n)
  local adds = count_adds[key]
  if adds == nil then
    count_order[#count_order + 1] = key
    adds = 0
  end
  count_adds[key] = adds + (nums[n] or num(n))
end

local cards, pruned, lease_ttls, lease_order = {}, {}, {}, {}
local function leases_pruned(key, now)
  if not pruned[key] then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    pruned[key] = true
    cards[key] = nil
  end
end
local function lease_count(key)
  local n = cards[key]
  if n == nil then
    n = redis.call('ZCARD', key)
    cards[key] = n
  end
  return n
end
local function lease_add(key, expires, id, ttl_ms)
  local added = redis.call('ZADD', key, 'NX', expires, id)
  if added == 1 and cards[key] then cards[key] = cards[key] + 1 end
  local ttl, previous = nums[ttl_ms] or num(ttl_ms), lease_ttls[key]
  if previous == nil then
    lease_order[#lease_order + 1] = key
    previous = -1
  end
  if previous < ttl then lease_ttls[key] = ttl end
  return added
end
local function lease_remove(key, id)
  local removed = redis.call('ZREM', key, id)
  if removed == 1 and cards[key] then cards[key] = cards[key] - 1 end
  return removed
end

local abandoned_present = {}
local function abandoned_has(key, id)
  local present = abandoned_present[key]
  if present == nil then
    present = redis.call('EXISTS', key) == 1
    abandoned_present[key] = present
  end
  return present and redis.call('ZSCORE', key, id)
end
local function abandoned_add(key, now, id, ttl_ms)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, int(now + num(ttl_ms)), id)
  redis.call('PEXPIRE', key, ttl_ms)
  abandoned_present[key] = true
end

local holds, hold_order, hold_written = {}, {}, {}
local function hold_ms(key)
  local h = holds[key]
  if h == nil then
    h = tonumber(redis.call('GET', key)) or false
    holds[key] = h
  end
  return h or nil
end
local function hold_set(key, value)
  holds[key] = value  -- also what later reads in the batch see
  if hold_written[key] == nil then
    hold_order[#hold_order + 1] = key
    hold_written[key] = true
  end
end

local settled_ends, settled_order = {}, {}
local function settled_add(key, id, window_end)
  if redis.call('SADD', key, id) == 0 then return false end
  local at, previous = nums[window_end] or num(window_end), settled_ends[key]
  if previous == nil then
    settled_order[#settled_order + 1] = key
    previous = -1
  end
  if previous < at then settled_ends[key] = at end
  return true
end

local marks, mark_order = {}, {}
local function progress_set(key, ms)
  if marks[key] == nil then mark_order[#mark_order + 1] = key end
  marks[key] = ms
end

local gates = {}
local function gate_fields(key)
  local f = gates[key]
  if f == nil then
    f = redis.call('HMGET', key, unpack(GATE_FIELDS))
    gates[key] = f
  end
  return f
end
local function gate_changed(key) gates[key] = nil end

-- The expiries first, then the increments (the only writes that can fail: a counter holding
-- something else than an integer), each followed by its key's expiry whatever it answered.
local function flush()
  for _, key in ipairs(lease_order) do redis.call('PEXPIRE', key, int(lease_ttls[key])) end
  for _, key in ipairs(settled_order) do redis.call('EXPIREAT', key, int(settled_ends[key])) end
  for _, key in ipairs(hold_order) do redis.call('SET', key, int(holds[key]), 'EX', '3600') end
  for _, key in ipairs(mark_order) do redis.call('SET', key, marks[key], 'EX', '3600') end
  local failure
  for _, key in ipairs(count_order) do
    local ok, err = pcall(redis.call, 'INCRBY', key, int(count_adds[key]))
    redis.call('EXPIRE', key, '120')
    if not ok and failure == nil then failure = err end
  end
  if failure ~= nil then error(failure, 0) end
end
"""
    + _SHARED_HELPERS
)


@dataclass(frozen=True, slots=True)
class LuaScript:
    """A script's source and its SHA1 (what ``EVALSHA`` names it by)."""

    name: str
    source: str
    sha: str = field(init=False)
    sha_bytes: bytes = field(init=False, repr=False)
    sha_resp: bytes = field(init=False, repr=False)
    """The SHA as a RESP bulk string, as it goes on the wire."""

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "sha_bytes", sha.encode("ascii"))
        object.__setattr__(self, "sha_resp", b"$40\r\n%s\r\n" % sha.encode("ascii"))


# --------------------------------------------------------------------------- limiter

_ACQUIRE_BODY = """
-- KEYS: 1 global lease, 2 source lease, 3 global rpm, 4 source rpm, 5 global tpm, 6 source tpm
--       (rpm/tpm keys of window ARGV[1]), 7 abandoned lease ids, 8 global hold ms,
--       9 source hold ms (typical lease hold times, written by RELEASE)
-- ARGV: 1 window, 2 lease id, 3 est tokens, 4 lease ttl ms, 5 global concurrency,
--       6 source concurrency, 7 global rpm, 8 source rpm, 9 global tpm, 10 source tpm (0 = off)
-- Reply: {1, now}            admitted
--        {0, gate, wait_ms}  refused by gate 1..6 (check order); nothing changed
--        {-1, now}           ARGV[1] is not the server's current window: nothing changed
--        {-2, now}           the caller gave this lease id up before the script ran
local now, sec = now_ms()
local window = math.floor(sec / 60)
if window ~= num(ARGV[1]) then return {-1, now} end
local est = num(ARGV[3])
-- A caller cancelled after sending may have had its compensation run first: never admit it.
-- (Its id is recorded only if it held no lease then, so it cannot hold one now.)
if abandoned_has(KEYS[7], ARGV[2]) then return {-2, now} end

-- Dropping expired leases is the only change a refusal may make.
leases_pruned(KEYS[1], now)
leases_pruned(KEYS[2], now)

local gate
repeat
  local limit = num(ARGV[5])
  if limit > 0 and lease_count(KEYS[1]) >= limit then gate = 1; break end
  limit = num(ARGV[6])
  if limit > 0 and lease_count(KEYS[2]) >= limit then gate = 2; break end
  limit = num(ARGV[7])
  if limit > 0 and counter(KEYS[3]) >= limit then gate = 3; break end
  limit = num(ARGV[8])
  if limit > 0 and counter(KEYS[4]) >= limit then gate = 4; break end
  limit = num(ARGV[9])
  if limit > 0 and counter(KEYS[5]) + est > limit then gate = 5; break end
  limit = num(ARGV[10])
  if limit > 0 and counter(KEYS[6]) + est > limit then gate = 6; break end
until true
-- Running twice for one lease id (a command re-sent after a lost reply) admits once: a refusal
-- first looks for the lease this id may hold already, and an admission adds only a new one.
if gate then
  if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return {1, now} end
  if gate == 1 then return {0, 1, lease_wait(KEYS[1], KEYS[8], now)} end
  if gate == 2 then return {0, 2, lease_wait(KEYS[2], KEYS[9], now)} end
  return {0, gate, (window + 1) * 60000 - now}
end

local expires = int(now + num(ARGV[4]))
if lease_add(KEYS[1], expires, ARGV[2], ARGV[4]) == 0 then return {1, now} end
lease_add(KEYS[2], expires, ARGV[2], ARGV[4])
counter_add(KEYS[3], 1)
counter_add(KEYS[4], 1)
counter_add(KEYS[5], est)
counter_add(KEYS[6], est)
return {1, now}
"""
ACQUIRE = LuaScript("acquire", _DIRECT + _ACQUIRE_BODY)

_RELEASE_BODY = """
-- Release a lease; optionally settle its TPM and mark progress in the same step.
-- KEYS: 1 global lease, 2 source lease, 3 global tpm, 4 source tpm (acquire-time window),
--       5 progress, 6 abandoned lease ids, 7 settled lease ids (acquire-time window),
--       8 global hold ms, 9 source hold ms
-- ARGV: 1 lease id, 2 tpm delta, 3 compensation (1: the caller never got the permit; apply
--       the delta only if the acquire ran, and if it has not run yet make sure it never
--       admits), 4 mark progress (1/0), 5 lease ttl ms, 6 end of the acquire-time window (s),
--       7 the server time the acquire answered (ms; 0 when unknown: a compensation's)
-- Running twice (a release re-sent after its reply was lost) changes nothing more: ZREM finds
-- nothing, and the delta is applied only by the run that adds the id to KEYS[7] (see SETTLE).
-- Reply: 1 when the lease was held, else 0 (already released, expired, or never granted)
local held = lease_remove(KEYS[1], ARGV[1])
lease_remove(KEYS[2], ARGV[1])
local acquired = num(ARGV[7])
if held == 1 and acquired > 0 then
  -- How long the lease was held feeds the concurrency gates' wait hints; an expired lease
  -- says nothing about how long calls take.
  local released_at = now_ms()
  if released_at < acquired + num(ARGV[5]) then
    local duration = math.max(0, released_at - acquired)
    hold_update(KEYS[8], duration)
    hold_update(KEYS[9], duration)
  end
end
local delta = num(ARGV[2])
if delta ~= 0 and (ARGV[3] == '0' or held == 1) and settled_add(KEYS[7], ARGV[1], ARGV[6]) then
  counter_add(KEYS[3], delta)
  counter_add(KEYS[4], delta)
end
if held == 0 and ARGV[3] == '1' then abandoned_add(KEYS[6], now_ms(), ARGV[1], ARGV[5]) end
if ARGV[4] == '1' then progress_set(KEYS[5], int(now_ms())) end
return held
"""
RELEASE = LuaScript("release", _DIRECT + _RELEASE_BODY)

_SETTLE_BODY = """
-- Move TPM of the acquire-time window by actual - est (negative allowed; readers clamp).
-- KEYS: 1 global tpm, 2 source tpm, 3 settled lease ids (all of that window)
-- ARGV: 1 delta, 2 lease id, 3 end of that window (unix seconds)
-- Once per lease: a settle re-sent after its reply was lost finds the id in KEYS[3]. The set
-- lives until its window ends: after that, nothing reads the window's counters, so a late
-- duplicate changes no decision (past its end EXPIREAT deletes the set at once). EXPIRE is
-- re-applied: a settle arriving after its window expired must not leave a key without TTL.
if not settled_add(KEYS[3], ARGV[2], ARGV[3]) then return 0 end
counter_add(KEYS[1], ARGV[1])
counter_add(KEYS[2], ARGV[1])
return 1
"""
SETTLE = LuaScript("settle", _DIRECT + _SETTLE_BODY)

SOURCE_STATS = LuaScript(
    "source_stats",
    _DIRECT
    + """
-- KEYS: 1 source lease, 2 source rpm, 3 source tpm (window ARGV[1]); ARGV: 1 window
-- Reply: {1, inflight, rpm, tpm >= 0} or {-1, now} (wrong window)
local now, sec = now_ms()
if math.floor(sec / 60) ~= tonumber(ARGV[1]) then return {-1, now} end
local inflight = redis.call('ZCOUNT', KEYS[1], '(' .. int(now), '+inf')
local rpm = tonumber(redis.call('GET', KEYS[2])) or 0
local tpm = tonumber(redis.call('GET', KEYS[3])) or 0
if tpm < 0 then tpm = 0 end
return {1, inflight, rpm, tpm}
""",
)

INFLIGHT = LuaScript(
    "inflight",
    _DIRECT
    + """
-- KEYS: 1 global lease. Reply: leases not yet expired.
local now = now_ms()
return redis.call('ZCOUNT', KEYS[1], '(' .. int(now), '+inf')
""",
)

_PROGRESS_MARK_BODY = """
-- KEYS: 1 progress. The TTL (1 h) is far above any stall window: an expired key would read
-- as "never progressed".
progress_set(KEYS[1], int(now_ms()))
return 1
"""
PROGRESS_MARK = LuaScript("progress_mark", _DIRECT + _PROGRESS_MARK_BODY)

PROGRESS_AGE = LuaScript(
    "progress_age",
    _DIRECT
    + """
-- KEYS: 1 progress. Reply: ms since the mark, -1 when there is none; a clock that went back
-- reads 0.
local mark = tonumber(redis.call('GET', KEYS[1]))
if not mark then return -1 end
local age = now_ms() - mark
if age < 0 then age = 0 end
return age
""",
)

# --------------------------------------------------------------------------- breaker

_GATE_STATE = """
local F = gate_fields(KEYS[1])
local state = F[1] or 'closed'
local epoch = num(F[2]) or 0
local failures = num(F[3]) or 0
local owner = F[6] or ''
"""
_GATE_PRELUDE = _DIRECT + _GATE_STATE

_GATE_HOLDS = """
-- The fencing rule: a write-back speaks for the current state only with the current epoch
-- and, for a probe, the current probe owner.
local function holds(d_epoch, d_owner)
  if d_owner ~= '' then
    return state == 'half_open' and owner == d_owner
      and (d_epoch == '' or epoch == tonumber(d_epoch))
  end
  return state == 'closed' and epoch == tonumber(d_epoch)
end
"""

_GATE_OPEN = """
-- The cooldown doubles with every failed probe in a row ('streak'), capped at max_ms.
local function cooldown_for(cooldown_ms, max_ms)
  local streak = tonumber(redis.call('HGET', KEYS[1], 'streak')) or 0
  return math.min(tonumber(cooldown_ms) * 2 ^ math.min(streak, 64), tonumber(max_ms))
end

local function open(n, cooldown_ms, key_ttl_ms, max_ms)
  epoch = epoch + 1
  failures = n
  state = 'open'
  redis.call('HSET', KEYS[1], 'state', 'open', 'epoch', epoch, 'failures', n,
             'open_until', int(now_ms() + cooldown_for(cooldown_ms, max_ms)), 'probe_owner', '',
             'probe_until', 0)
  redis.call('PEXPIRE', KEYS[1], key_ttl_ms)
end
"""

_GATE_TRY_ENTER_BODY = """
-- KEYS: 1 gate; ARGV: 1 new probe owner, 2 probe ttl ms, 3 key ttl ms
-- Reply: {allowed, state, epoch, failures, probe owner or '', wait ms}
if state == 'closed' then return {1, 'closed', epoch, failures, '', 0} end
-- Running twice for one probe id (a command re-sent after a lost reply) is one probe.
if state == 'half_open' and owner == ARGV[1] then
  return {1, 'half_open', epoch, failures, ARGV[1], 0}
end
-- Its caller was cancelled after sending and handed the probe back before this ran.
if F[7] == ARGV[1] then return {0, state, epoch, failures, '', 0} end
local now = now_ms()
if state == 'open' then
  local open_until = num(F[4]) or 0
  if now < open_until then return {0, 'open', epoch, failures, '', open_until - now} end
else
  local probe_until = num(F[5]) or 0
  if owner ~= '' and now < probe_until then
    return {0, 'half_open', epoch, failures, '', probe_until - now}
  end
end
-- Cooldown over, or the probe lease is free or lapsed: this caller is the probe.
redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe_owner', ARGV[1],
           'probe_until', int(now + num(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
gate_changed(KEYS[1])
return {1, 'half_open', epoch, failures, ARGV[1], 0}
"""
GATE_TRY_ENTER = LuaScript("gate_try_enter", _GATE_PRELUDE + _GATE_TRY_ENTER_BODY)

GATE_RECORD_SUCCESS = LuaScript(
    "gate_record_success",
    _GATE_PRELUDE
    + _GATE_HOLDS
    + """
-- KEYS: 1 gate; ARGV: 1 epoch, 2 probe owner ('' if none), 3 key ttl ms
-- Reply: {applied, state, epoch, failures}
if not holds(ARGV[1], ARGV[2]) then return {0, state, epoch, failures} end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'state', 'closed', 'failures', 0, 'probe_owner', '',
             'probe_until', 0, 'streak', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
elseif failures ~= 0 then
  redis.call('HSET', KEYS[1], 'failures', 0)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {1, 'closed', epoch, 0}
""",
)

GATE_RECORD_FAILURE = LuaScript(
    "gate_record_failure",
    _GATE_PRELUDE
    + _GATE_HOLDS
    + _GATE_OPEN
    + """
-- KEYS: 1 gate; ARGV: 1 epoch, 2 probe owner, 3 threshold, 4 force open (1/0),
--       5 cooldown ms, 6 key ttl ms, 7 max cooldown ms
-- Reply: {applied, state, epoch, failures}
if not holds(ARGV[1], ARGV[2]) then return {0, state, epoch, failures} end
local threshold = tonumber(ARGV[3])
if ARGV[4] == '1' or ARGV[2] ~= '' then
  -- A dead source, or a failed probe: straight back to open, for longer each time.
  if ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[1], 'streak', 1) end
  open(math.max(failures, threshold), ARGV[5], ARGV[6], ARGV[7])
else
  failures = failures + 1
  if failures >= threshold then
    open(failures, ARGV[5], ARGV[6], ARGV[7])
  else
    redis.call('HSET', KEYS[1], 'failures', failures)
    redis.call('PEXPIRE', KEYS[1], ARGV[6])
  end
end
return {1, state, epoch, failures}
""",
)

GATE_RELEASE_PROBE = LuaScript(
    "gate_release_probe",
    _GATE_PRELUDE
    + _GATE_HOLDS
    + """
-- KEYS: 1 gate; ARGV: 1 epoch ('' = a hand-back by a try_enter cancelled after sending: the
--       owner id alone is unique), 2 probe owner, 3 key ttl ms.
-- The next try_enter becomes the probe at once. Reply: 1 if released.
if ARGV[2] == '' then return 0 end
if not holds(ARGV[1], ARGV[2]) then
  if ARGV[1] == '' then
    -- The try_enter may not have run yet: make sure it never hands this id the probe.
    redis.call('HSET', KEYS[1], 'abandoned_owner', ARGV[2])
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
  end
  return 0
end
redis.call('HSET', KEYS[1], 'probe_owner', '', 'probe_until', 0)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
""",
)

GATE_FORCE_OPEN = LuaScript(
    "gate_force_open",
    _GATE_PRELUDE
    + _GATE_OPEN
    + """
-- KEYS: 1 gate; ARGV: 1 threshold, 2 cooldown ms, 3 key ttl ms, 4 max cooldown ms
-- Already open: the cooldown restarts (never shortens), same epoch.
-- Reply: {1, state, epoch, failures}
local n = math.max(failures, tonumber(ARGV[1]))
if state == 'open' then
  local open_until = math.max(tonumber(F[4]) or 0, now_ms() + cooldown_for(ARGV[2], ARGV[4]))
  redis.call('HSET', KEYS[1], 'failures', n, 'open_until', int(open_until))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, 'open', epoch, n}
end
open(n, ARGV[2], ARGV[3], ARGV[4])
return {1, state, epoch, failures}
""",
)

GATE_RETRY_AFTER = LuaScript(
    "gate_retry_after",
    _DIRECT
    + """
-- KEYS: the gates of the sources asked about (one scope, one slot).
-- Reply: ms until the first of them admits again, >= 0.
local now = nil
local shortest = nil
for _, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, 'state', 'open_until', 'probe_until', 'probe_owner')
  local state = f[1] or 'closed'
  if state == 'closed' then return 0 end
  if now == nil then now = now_ms() end
  local wait = 0
  if state == 'open' then
    wait = (tonumber(f[2]) or 0) - now
  elseif f[4] and f[4] ~= '' then
    wait = (tonumber(f[3]) or 0) - now
  end
  if shortest == nil or wait < shortest then shortest = wait end
end
if shortest == nil or shortest < 0 then return 0 end
return shortest
""",
)

# --------------------------------------------------------------------------- batches


_SLOT = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")
_KEY = r"(KEYS\[K \+ \d+\])"
_ARG = r"(ARGV\[A \+ \d+\])"
_INLINED: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.MULTILINE), replacement)
    for pattern, replacement in (
        # Each helper's memo (``_BATCHED``) read in place, the helper called only on a miss:
        # a number converted already, a counter, a lease count or a gate hash read already,
        # no abandoned ids, the leases pruned already, the clock read already.
        (rf"\bnum\({_ARG}\)", r"(nums[\1] or num(\1))"),
        (r"\bnum\((F\[\d\])\)", r"(nums[\1] or num(\1))"),
        (rf"\bcounter\({_KEY}\)", r"((counts[\1] or counter_read(\1)) + (count_adds[\1] or 0))"),
        (rf"\blease_count\({_KEY}\)", r"(cards[\1] or lease_count(\1))"),
        (rf"\bgate_fields\({_KEY}\)", r"(gates[\1] or gate_fields(\1))"),
        (
            rf"\babandoned_has\({_KEY}, {_ARG}\)",
            r"(abandoned_present[\1] ~= false and abandoned_has(\1, \2))",
        ),
        (rf"^leases_pruned\({_KEY}, now\)$", r"if not pruned[\1] then leases_pruned(\1, now) end"),
        (r"(?<!sec = )\bnow_ms\(\)", "(clock_ms or now_ms())"),
        (
            r"^local now, sec = now_ms\(\)$",
            "local now, sec = clock_ms, clock_s\nif not now then now, sec = now_ms() end",
        ),
        # An increment by a number (not an argument to convert): counter_add's body.
        (
            rf"^( *)counter_add\({_KEY}, ([^()]+)\)$",
            r"\1do local key = \2; local adds = count_adds[key]; if adds == nil then"
            r" count_order[#count_order + 1] = key; adds = 0 end; count_adds[key] = adds + \3 end",
        ),
        # An operation answers with its values, not a table of them (a table per answer).
        (r"\breturn \{([^{}]*)\}", r"return \1"),
    )
)
"""What ``_op`` writes out in the BATCH script's operations. Redis's Lua spends more on a
function call than most of these helpers spend on their work, and they run several times per
operation: written out (and the answers given as values), they took redis-server from
167.7k to 144.0k instructions a call (c=64, JSON). What each operation decides is the same
(``tests/test_redis_batch_equivalence.py``); ``tests/test_redis_scripts.py`` checks that every
rewrite still finds what it rewrites."""


BATCH_ARG_COUNTS: dict[int, int] = {1: 10, 2: 7, 3: 3, 4: 0, 5: 3, 6: 13}
"""The BATCH script's operation codes and how many arguments of its own each takes (those of
the script it runs: acquire, release, settle, progress mark, gate_try_enter, and gate_try_enter
then acquire)."""


BATCH_REPLY_FIELDS: dict[int, int] = {1: 3, 2: 1, 3: 1, 4: 1, 5: 6, 6: 6 + 3}
"""How many values of the BATCH script's flat reply each operation answers with: acquire
``{status, now or gate, wait ms}``, one number for the accounting operations, gate_try_enter
``{allowed, state, epoch, failures, probe owner, wait ms}``, and gate_acquire the gate's six
then the acquire's three (zeros when the gate refused)."""


def shifted(body: str) -> str:
    """A script's body on its slice of the batch's ``KEYS`` and ``ARGV``: ``KEYS[n]`` reads
    ``KEYS[K + n]`` and ``ARGV[n]`` ``ARGV[A + n]``, where ``K`` and ``A`` are where the
    operation's keys and arguments start. (Copying each slice into tables of its own cost
    more than the rest of the dispatch together.)"""
    offset = {"KEYS": "K", "ARGV": "A"}
    return _SLOT.sub(lambda m: f"{m[1]}[{offset[m[1]]} + {m[2]}]", body)


def _op(name: str, body: str) -> str:
    """A script's body as a function of the BATCH script: ``shifted``, with the helpers of
    ``_INLINED`` written out."""
    text = shifted(body)
    for pattern, replacement in _INLINED:
        text = pattern.sub(replacement, text)
    return f"local function {name}(K, A)\n{text}\nend\n"


BATCH_OPERATIONS: dict[str, str] = {
    "acquire": _ACQUIRE_BODY,
    "release": _RELEASE_BODY,
    "settle": _SETTLE_BODY,
    "progress_mark": _PROGRESS_MARK_BODY,
    "gate_try_enter": _GATE_STATE + _GATE_TRY_ENTER_BODY,
}
"""The scripts the BATCH script runs as functions, by name: their bodies."""


BATCH = LuaScript(
    "batch",
    _BATCHED
    + "".join(_op(name, body) for name, body in BATCH_OPERATIONS.items())
    + """
-- The breaker gate, then (if it lets the caller through) the admission: one step for a
-- breaker and a limiter sharing the scope. KEYS: 1 gate, 2.. acquire's; ARGV: 1-3
-- gate_try_enter's, 4.. acquire's. Answers with the gate's six values, then the acquire's
-- (none when the gate refused: the batch writes zeros).
local function gate_acquire(K, A)
  local allowed, state, epoch, failures, owner, wait = gate_try_enter(K, A)
  if allowed == 0 then return allowed, state, epoch, failures, owner, wait end
  return allowed, state, epoch, failures, owner, wait, acquire(K + 1, A + 3)
end

-- Several operations in one script call, in order (accounting first, then admissions).
-- ARGV: per operation its code (1 acquire, 2 release, 3 settle, 4 progress mark,
-- 5 gate_try_enter, 6 gate_acquire), its arguments (as many as the script of its own takes),
-- then where its keys start in KEYS (0-based). KEYS: each group of keys once: operations on
-- the same keys (one source's, in one window) share them.
-- Reply: one flat array, each operation's fields in turn, as many as BATCH_REPLY_FIELDS says
-- (missing ones are 0): Redis converts every table of a reply at a cost, so the batch
-- answers with one.
local ops = {['1'] = acquire, ['2'] = release, ['3'] = settle, ['4'] = progress_mark,
             ['5'] = gate_try_enter, ['6'] = gate_acquire}
"""
    + "local arg_counts = {"
    + ", ".join(f"['{code}'] = {count}" for code, count in BATCH_ARG_COUNTS.items())
    + "}\nlocal reply_fields = {"
    + ", ".join(f"['{code}'] = {count}" for code, count in BATCH_REPLY_FIELDS.items())
    + "}\n"
    + """local out, n = {}, 0
local function run_all()
  local a, last = 0, #ARGV
  while a < last do
    local code = ARGV[a + 1]
    local na, width = arg_counts[code], reply_fields[code]
    local r1, r2, r3, r4, r5, r6, r7, r8, r9 = ops[code](num(ARGV[a + na + 2]), a + 1)
    out[n + 1] = r1 or 0
    if width > 1 then
      out[n + 2] = r2 or 0
      out[n + 3] = r3 or 0
      if width > 3 then
        out[n + 4] = r4 or 0
        out[n + 5] = r5 or 0
        out[n + 6] = r6 or 0
        if width > 6 then
          out[n + 7] = r7 or 0
          out[n + 8] = r8 or 0
          out[n + 9] = r9 or 0
        end
      end
    end
    n = n + width
    a = a + na + 2
  end
end
-- The deferred writes land even when an operation fails: what the operations before it
-- wrote stays whole (no lease set or counter without its expiry). An operation's error is
-- the one reported, before the flush's.
local ok, err = pcall(run_all)
local flushed, flush_err = pcall(flush)
if not ok then error(err, 0) end
if not flushed then error(flush_err, 0) end
return out
""",
)
"""Several of the scripts above as one call (the operation codes are ``BatchOp``'s)."""


ALL_SCRIPTS: tuple[LuaScript, ...] = (
    ACQUIRE,
    RELEASE,
    SETTLE,
    SOURCE_STATS,
    INFLIGHT,
    PROGRESS_MARK,
    PROGRESS_AGE,
    GATE_TRY_ENTER,
    GATE_RECORD_SUCCESS,
    GATE_RECORD_FAILURE,
    GATE_RELEASE_PROBE,
    GATE_FORCE_OPEN,
    GATE_RETRY_AFTER,
    BATCH,
)
