"""The two Lua scripts the Redis limiter runs, one round trip each (EVALSHA).

Time is Redis server TIME, never a client's clock: replicas with skewed clocks see one
bucket. Redis 7 replicates a script by its effects, so calling TIME before writing needs no
`redis.replicate_commands()`. The formulas and the fit rule are buckets.py's. Numbers go in
and out as "%.17g" strings (exact doubles; Redis would truncate a returned Lua number to an
integer). A limit of -1 is no limit.

Keys, all of one tenant and with one hash tag (a cluster slot): `{prefix}:{tenant}:rpm`,
`:tpm` (a bucket's tat, expiring when the bucket is full), `:inflight` (sorted set of
request ids scored by lease expiry, expiring two leases after its last entry),
`:month:YYYY-MM` (tokens used, expiring a grace after the month ends).
"""

from __future__ import annotations

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local EPSILON = 1e-6
local function num(x) return string.format('%.17g', x) end
local function tat_of(key)
  return tonumber(redis.call('GET', key) or 0)
end
local function set_tat(key, tat)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, num(tat), 'PXAT', math.ceil(tat * 1000))
  end
end
"""

# KEYS: rpm, tpm, inflight, month
# ARGV: rpm, tpm, tokens, max concurrency, request id, lease (s), monthly quota,
#       seed (tokens used this month per the ledger; -1 unknown), month counter expiry (unix s)
# -> {'seed'} when the month's counter is missing and no seed came (nothing was changed);
#    else {admitted 1/0, rpm level, tpm level, in flight, earliest lease wait, month used}
#    with levels as strings ('' unlimited) and -1 for an unlimited count.
ACQUIRE = (
    _COMMON
    + """
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, id, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local quota, seed = tonumber(ARGV[7]), tonumber(ARGV[8])

local used = -1
if quota >= 0 then
  local v = redis.call('GET', KEYS[4])
  if not v then
    if seed < 0 then return {'seed'} end
    redis.call('SET', KEYS[4], seed, 'NX', 'EXAT', ARGV[9])
    v = seed
  end
  used = tonumber(v)
end

local ok = true
local rpm_tat, tpm_tat, rpm_level, tpm_level = 0, 0, '', ''
if rpm >= 0 then
  rpm_tat = tat_of(KEYS[1])
  rpm_level = rpm - math.max(0, rpm_tat - now) * rpm / 60
  if rpm_level + EPSILON < 1 then ok = false end
end
if tpm >= 0 then
  tpm_tat = tat_of(KEYS[2])
  tpm_level = tpm - math.max(0, tpm_tat - now) * tpm / 60
  if tokens > tpm or tpm_level + EPSILON < tokens then ok = false end
end

local tracked = tpm >= 0 or conc >= 0 or quota >= 0
local in_flight, lease_wait = -1, 0
if tracked then
  -- an entry stays one lease past its expiry, uncounted, so a late release still refunds
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', num(now - lease))
end
if conc >= 0 then
  in_flight = redis.call('ZCOUNT', KEYS[3], '(' .. num(now), '+inf')
  if in_flight >= conc then
    ok = false
    local first = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. num(now), '+inf',
                             'WITHSCORES', 'LIMIT', 0, 1)
    if first[2] then lease_wait = tonumber(first[2]) - now end
  end
end
if quota >= 0 and used >= quota then ok = false end

if ok then
  if rpm >= 0 then set_tat(KEYS[1], math.max(rpm_tat, now) + 60 / rpm) end
  if tpm >= 0 then set_tat(KEYS[2], math.max(tpm_tat, now) + tokens * 60 / tpm) end
  if tracked then
    redis.call('ZADD', KEYS[3], num(now + lease), id)
    redis.call('PEXPIRE', KEYS[3], math.ceil(2 * lease * 1000))
  end
  if quota >= 0 then redis.call('INCRBY', KEYS[4], tokens) end
end
if rpm_level ~= '' then rpm_level = num(rpm_level) end
if tpm_level ~= '' then tpm_level = num(tpm_level) end
return {ok and 1 or 0, rpm_level, tpm_level, in_flight, num(lease_wait), used}
"""
)

# KEYS: tpm, inflight, month
# ARGV: request id, tpm (-1 none), tokens to give back (reserved - used; negative is debt),
#       month charged (1/0)
# -> 1 released, 0 already released (nothing changed)
RELEASE = (
    _COMMON
    + """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
local tpm, back = tonumber(ARGV[2]), tonumber(ARGV[3])
if back ~= 0 then
  if tpm >= 0 then set_tat(KEYS[1], math.max(tat_of(KEYS[1]), now) - back * 60 / tpm) end
  if ARGV[4] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
    if redis.call('DECRBY', KEYS[3], back) < 0 then
      redis.call('SET', KEYS[3], 0, 'KEEPTTL')
    end
  end
end
return 1
"""
)
