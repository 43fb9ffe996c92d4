-- ARGV: prefix, bucket, rate, burst, now. Takes one unit from the token bucket
-- `rate:{bucket}` (full when absent; the rule of protocols/rates.refill) and returns, as a
-- string, the seconds until a unit is there ("0": one was taken). The key goes on its own
-- once it would be full again.
local k = ARGV[1] .. 'rate:' .. ARGV[2]
local rate, burst, now = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cur = redis.call('HMGET', k, 'tokens', 'at')
local tokens, at = burst, now
if cur[1] then
  tokens, at = tonumber(cur[1]), tonumber(cur[2])
end
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens < 1 then
  wait = (1 - tokens) / rate
else
  tokens = tokens - 1
end
redis.call('HSET', k, 'tokens', tostring(tokens), 'at', ARGV[5])
redis.call('PEXPIRE', k, math.ceil((burst - tokens) / rate * 1000) + 1000)
return tostring(wait)
