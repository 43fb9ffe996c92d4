-- ARGV: prefix, namespace, key, holder, now, lease_s, then the namespace's cap of live job
-- records ("" for none). Returns {granted (1/0), holder, expires_at}: granted when no live
-- claim by another holder stands (a renewal for the same holder, a takeover of an expired
-- lease); else the live claim, untouched; or {'!full', cap} when a new claim would pass the
-- cap (counted with the resolutions in `jobrecs:{ns}`, as resolve.lua does).
local p, holder, now, lease = ARGV[1], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local ck = p .. 'claim:' .. ARGV[2] .. ':' .. ARGV[3]
local counted = p .. 'jobrecs:' .. ARGV[2]
local cur = redis.call('HMGET', ck, 'holder', 'expires_at')
local live = cur[1] and tonumber(cur[2]) > now
if live and cur[1] ~= holder then
  return {0, cur[1], cur[2]}
end
if not live then
  redis.call('ZREMRANGEBYSCORE', counted, '-inf', now)
  if ARGV[7] ~= '' and redis.call('ZCARD', counted) >= tonumber(ARGV[7]) then
    return {'!full', ARGV[7]}
  end
end
local expires = string.format('%.6f', now + lease)
redis.call('HSET', ck, 'holder', holder, 'expires_at', expires)
redis.call('PEXPIRE', ck, math.ceil(lease * 1000) + 60000)
redis.call('ZADD', counted, expires, ck)
redis.call('PEXPIRE', counted, 86400000 + 60000)
return {1, holder, expires}
