-- ARGV: prefix, namespace, key, holder, now. Returns 0 when another holder's live claim
-- stands (left alone), 1 otherwise (the claim, the caller's or an expired one, is gone).
local p, holder, now = ARGV[1], ARGV[4], tonumber(ARGV[5])
local ck = p .. 'claim:' .. ARGV[2] .. ':' .. ARGV[3]
local cur = redis.call('HMGET', ck, 'holder', 'expires_at')
if cur[1] and cur[1] ~= holder and tonumber(cur[2]) > now then
  return 0
end
redis.call('DEL', ck)
redis.call('ZREM', p .. 'jobrecs:' .. ARGV[2], ck)
return 1
