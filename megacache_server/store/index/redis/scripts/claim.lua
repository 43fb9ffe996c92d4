-- ARGV: prefix, namespace, key, holder, now, lease_s. Returns {granted (1/0), holder,
-- expires_at}: granted when no live claim by another holder stands (a renewal for the same
-- holder, a takeover of an expired lease); else the live claim, untouched.
local p, holder, now, lease = ARGV[1], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local ck = p .. 'claim:' .. ARGV[2] .. ':' .. ARGV[3]
local cur = redis.call('HMGET', ck, 'holder', 'expires_at')
if cur[1] and cur[1] ~= holder and tonumber(cur[2]) > now then
  return {0, cur[1], cur[2]}
end
local expires = string.format('%.6f', now + lease)
redis.call('HSET', ck, 'holder', holder, 'expires_at', expires)
redis.call('PEXPIRE', ck, math.ceil(lease * 1000) + 60000)
return {1, holder, expires}
