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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(t[1])
end
local function int(n) return string.format('%d', n) end
"""


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
if window ~= tonumber(ARGV[1]) then return {-1, now} end
local window_left = (window + 1) * 60000 - now
local est = tonumber(ARGV[3])
-- Running twice for one lease id (a command re-sent after a lost reply) admits once.
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return {1, now} end
-- A caller cancelled after sending may have had its compensation run first: never admit it.
if redis.call('ZSCORE', KEYS[7], ARGV[2]) then return {-2, now} end

-- Dropping expired leases is the only change a refusal may make.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)

-- A full concurrency gate's hint: the typical hold time of its released leases (1000 ms
-- before any), floored at 10 ms and capped by its oldest lease's expiry: the in-memory
-- limiter's slot_wait, so both backends report the same.
local function lease_wait(key, hold_key)
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local expiry_in = tonumber(first[2]) - now
  local hold = tonumber(redis.call('GET', hold_key))
  local estimate = 1000
  if hold then estimate = math.max(10, hold) end
  return math.max(0, math.min(expiry_in, estimate))
end
local function used(key) return tonumber(redis.call('GET', key)) or 0 end

local limit = tonumber(ARGV[5])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then
  return {0, 1, lease_wait(KEYS[1], KEYS[8])}
end
limit = tonumber(ARGV[6])
if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then
  return {0, 2, lease_wait(KEYS[2], KEYS[9])}
end
limit = tonumber(ARGV[7])
if limit > 0 and used(KEYS[3]) >= limit then return {0, 3, window_left} end
limit = tonumber(ARGV[8])
if limit > 0 and used(KEYS[4]) >= limit then return {0, 4, window_left} end
limit = tonumber(ARGV[9])
if limit > 0 and used(KEYS[5]) + est > limit then return {0, 5, window_left} end
limit = tonumber(ARGV[10])
if limit > 0 and used(KEYS[6]) + est > limit then return {0, 6, window_left} end

local expires = int(now + tonumber(ARGV[4]))
redis.call('ZADD', KEYS[1], expires, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], expires, ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('INCR', KEYS[3])
redis.call('EXPIRE', KEYS[3], 120)
redis.call('INCR', KEYS[4])
redis.call('EXPIRE', KEYS[4], 120)
redis.call('INCRBY', KEYS[5], est)
redis.call('EXPIRE', KEYS[5], 120)
redis.call('INCRBY', KEYS[6], est)
redis.call('EXPIRE', KEYS[6], 120)
return {1, now}
"""
ACQUIRE = LuaScript("acquire", _PRELUDE + _ACQUIRE_BODY)

_RELEASE_BODY = """
-- Release a lease; optionally settle its TPM and mark progress in the same step.
-- KEYS: 1 global lease, 2 source lease, 3 global tpm, 4 source tpm (acquire-time window),
--       5 progress, 6 abandoned lease ids, 7 settled lease ids (acquire-time window),
--       8 global hold ms, 9 source hold ms
-- ARGV: 1 lease id, 2 tpm delta, 3 compensation (1: the caller never got the permit; apply
--       the delta only if the acquire ran, and if it has not run yet make sure it never
--       admits), 4 mark progress (1/0), 5 lease ttl ms, 6 end of the acquire-time window (s)
-- Running twice (a release re-sent after its reply was lost) changes nothing more: ZREM finds
-- nothing, and the delta is applied only by the run that adds the id to KEYS[7] (see SETTLE).
-- Reply: 1 when the lease was held, else 0 (already released, expired, or never granted)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
local held = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local released_at = now_ms()
if held == 1 and expiry and tonumber(expiry) > released_at then
  -- How long the lease was held feeds the concurrency gates' wait hints (moving average,
  -- weight 0.2 for the newest, as in the in-memory limiter's next_hold); an expired lease
  -- says nothing about how long calls take.
  local duration = math.max(0, released_at - (tonumber(expiry) - tonumber(ARGV[5])))
  for _, key in ipairs({KEYS[8], KEYS[9]}) do
    local previous = tonumber(redis.call('GET', key))
    local value = duration
    if previous then value = previous + 0.2 * (duration - previous) end
    redis.call('SET', key, int(value), 'EX', 3600)
  end
end
local delta = tonumber(ARGV[2])
if delta ~= 0 and (ARGV[3] == '0' or held == 1) and redis.call('SADD', KEYS[7], ARGV[1]) == 1 then
  redis.call('EXPIREAT', KEYS[7], ARGV[6])
  redis.call('INCRBY', KEYS[3], delta)
  redis.call('EXPIRE', KEYS[3], 120)
  redis.call('INCRBY', KEYS[4], delta)
  redis.call('EXPIRE', KEYS[4], 120)
end
if held == 0 and ARGV[3] == '1' then
  local now = now_ms()
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  redis.call('ZADD', KEYS[6], int(now + tonumber(ARGV[5])), ARGV[1])
  redis.call('PEXPIRE', KEYS[6], ARGV[5])
end
if ARGV[4] == '1' then
  redis.call('SET', KEYS[5], int(now_ms()), 'EX', 3600)
end
return held
"""
RELEASE = LuaScript("release", _PRELUDE + _RELEASE_BODY)

_SETTLE_BODY = """
-- Move TPM of the acquire-time window by actual - est (negative allowed; readers clamp).
-- KEYS: 1 global tpm, 2 source tpm, 3 settled lease ids (all of that window)
-- ARGV: 1 delta, 2 lease id, 3 end of that window (unix seconds)
-- Once per lease: a settle re-sent after its reply was lost finds the id in KEYS[3]. The set
-- lives until its window ends: after that, nothing reads the window's counters, so a late
-- duplicate changes no decision (past its end EXPIREAT deletes the set at once). EXPIRE is
-- re-applied: a settle arriving after its window expired must not leave a key without TTL.
if redis.call('SADD', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('EXPIREAT', KEYS[3], ARGV[3])
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], 120)
redis.call('INCRBY', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], 120)
return 1
"""
SETTLE = LuaScript("settle", _SETTLE_BODY)

SOURCE_STATS = LuaScript(
    "source_stats",
    _PRELUDE
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
    _PRELUDE
    + """
-- KEYS: 1 global lease. Reply: leases not yet expired.
local now = now_ms()
return redis.call('ZCOUNT', KEYS[1], '(' .. int(now), '+inf')
""",
)

_PROGRESS_MARK_BODY = """
-- KEYS: 1 progress. The TTL (1 h) is far above any stall window: an expired key would read
-- as "never progressed".
redis.call('SET', KEYS[1], int(now_ms()), 'EX', 3600)
return 1
"""
PROGRESS_MARK = LuaScript("progress_mark", _PRELUDE + _PROGRESS_MARK_BODY)

PROGRESS_AGE = LuaScript(
    "progress_age",
    _PRELUDE
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
local F = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'failures', 'open_until',
                     'probe_until', 'probe_owner', 'abandoned_owner')
local state = F[1] or 'closed'
local epoch = tonumber(F[2]) or 0
local failures = tonumber(F[3]) or 0
local owner = F[6] or ''
"""
_GATE_PRELUDE = _PRELUDE + _GATE_STATE

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
  local open_until = tonumber(F[4]) or 0
  if now < open_until then return {0, 'open', epoch, failures, '', open_until - now} end
else
  local probe_until = tonumber(F[5]) or 0
  if owner ~= '' and now < probe_until then
    return {0, 'half_open', epoch, failures, '', probe_until - now}
  end
end
-- Cooldown over, or the probe lease is free or lapsed: this caller is the probe.
redis.call('HSET', KEYS[1], 'state', 'half_open', 'probe_owner', ARGV[1],
           'probe_until', int(now + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
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
    _PRELUDE
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


def _op(name: str, body: str) -> str:
    # KEYS and ARGV as parameters shadow the script's own: each body runs unchanged on its
    # slice of the batch, as it would as a script of its own.
    return f"local function {name}(KEYS, ARGV)\n{body}\nend\n"


BATCH = LuaScript(
    "batch",
    _PRELUDE
    + _op("acquire", _ACQUIRE_BODY)
    + _op("release", _RELEASE_BODY)
    + _op("settle", _SETTLE_BODY)
    + _op("progress_mark", _PROGRESS_MARK_BODY)
    + _op("gate_try_enter", _GATE_STATE + _GATE_TRY_ENTER_BODY)
    + """
-- The breaker gate, then (if it lets the caller through) the admission: one step for a
-- breaker and a limiter sharing the scope. KEYS: 1 gate, 2.. acquire's; ARGV: 1-3
-- gate_try_enter's, 4.. acquire's. Reply: {gate reply, acquire reply or {}}.
local function gate_acquire(KEYS, ARGV)
  local gate = gate_try_enter({KEYS[1]}, {ARGV[1], ARGV[2], ARGV[3]})
  if gate[1] == 0 then return {gate, {}} end
  return {gate, acquire({unpack(KEYS, 2)}, {unpack(ARGV, 4)})}
end

-- Several operations in one script call, in order (accounting first, then admissions).
-- ARGV: per operation its code (1 acquire, 2 release, 3 settle, 4 progress mark,
-- 5 gate_try_enter, 6 gate_acquire), its key count, its argument count, then its arguments;
-- KEYS: every operation's keys, in the same order. Reply: one entry per operation.
local ops = {acquire, release, settle, progress_mark, gate_try_enter, gate_acquire}
local out = {}
local k, a = 1, 1
while a <= #ARGV do
  local code, nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local keys, args = {}, {}
  for i = 1, nk do keys[i] = KEYS[k + i - 1] end
  for i = 1, na do args[i] = ARGV[a + i - 1] end
  k = k + nk
  a = a + na
  out[#out + 1] = ops[code](keys, args)
end
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
