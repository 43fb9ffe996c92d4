-- ARGV: prefix, namespace, hold id, size, cap, ttl_s, now, then the namespace's pending bytes
-- as the caller read them and `pending_gen:{ns}` as it read it before them. Returns
-- {granted (1, 0; -1: uploads were recorded since the caller read, read again), pending,
-- held}. One atomic step: lapsed holds go, a live hold of this id is renewed, else the hold
-- is taken only if pending + held + size fits in cap. Both keys outlive their last hold by
-- a minute and go on their own.
local p, ns, id = ARGV[1], ARGV[2], ARGV[3]
local size, cap, ttl, now = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),
  tonumber(ARGV[7])
local pending = tonumber(ARGV[8])
local hk, sk = p .. 'holds:' .. ns, p .. 'hold_sizes:' .. ns
local gone = redis.call('ZRANGEBYSCORE', hk, '-inf', now)
for _, lapsed in ipairs(gone) do redis.call('HDEL', sk, lapsed) end
redis.call('ZREMRANGEBYSCORE', hk, '-inf', now)
local keep = math.ceil(ttl * 1000) + 60000
if redis.call('ZSCORE', hk, id) then
  redis.call('ZADD', hk, now + ttl, id)
  redis.call('PEXPIRE', hk, keep)
  redis.call('PEXPIRE', sk, keep)
  return {1, 0, 0}
end
if (redis.call('GET', p .. 'pending_gen:' .. ns) or '0') ~= ARGV[9] then
  return {-1, 0, 0}
end
local held = 0
for _, v in ipairs(redis.call('HVALS', sk)) do held = held + tonumber(v) end
if pending + held + size > cap then
  return {0, pending, held}
end
redis.call('ZADD', hk, now + ttl, id)
redis.call('HSET', sk, id, size)
redis.call('PEXPIRE', hk, keep)
redis.call('PEXPIRE', sk, keep)
return {1, pending, held}
