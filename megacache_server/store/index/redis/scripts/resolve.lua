-- ARGV: prefix, namespace, job, attempt, key, now, ttl_s, then the candidate: manifest ("" for
-- a miss), etag, entry namespace, digests (comma-separated), then the namespace's cap of live
-- job records ("" for none). Returns the resolution as {manifest, etag, entry_ns, digests,
-- resolved_at, expires_at}, all strings, or {'!full', cap} when a new record would pass the
-- cap (nothing is written).
-- One atomic step: the first caller's candidate is recorded; a live record is returned (its
-- life renewed, never shortened) whatever the candidate; an expired one is replaced.
-- Its blobs are held in `held` (digest -> latest expiry) until it expires; the record is
-- counted in `jobrecs:{ns}` (record key -> expiry, as claim.lua counts claims) while it lives.
local p, now, ttl = ARGV[1], tonumber(ARGV[6]), tonumber(ARGV[7])
local rk = p .. 'job:' .. ARGV[2] .. ':' .. ARGV[3] .. ':' .. ARGV[4] .. ':' .. ARGV[5]
local counted = p .. 'jobrecs:' .. ARGV[2]
local fields = {'manifest', 'etag', 'entry_ns', 'digests', 'resolved_at', 'expires_at'}
local cur = redis.call('HMGET', rk, unpack(fields))
local expires
if cur[6] and tonumber(cur[6]) > now then
  expires = math.max(tonumber(cur[6]), now + ttl)
else
  redis.call('ZREMRANGEBYSCORE', counted, '-inf', now)
  if ARGV[12] ~= '' and redis.call('ZCARD', counted) >= tonumber(ARGV[12]) then
    return {'!full', ARGV[12]}
  end
  cur = {ARGV[8], ARGV[9], ARGV[10], ARGV[11], string.format('%.6f', now), ''}
  expires = now + ttl
end
cur[6] = string.format('%.6f', expires)
redis.call('HSET', rk, fields[1], cur[1], fields[2], cur[2], fields[3], cur[3],
           fields[4], cur[4], fields[5], cur[5], fields[6], cur[6])
-- the key outlives its logical expiry a little: the answer is decided by expires_at
redis.call('PEXPIRE', rk, math.ceil((expires - now) * 1000) + 60000)
redis.call('ZADD', counted, cur[6], rk)
redis.call('PEXPIRE', counted, 86400000 + 60000)
for d in string.gmatch(cur[4], '[^,]+') do
  local until_ = redis.call('ZSCORE', p .. 'held', d)
  if not until_ or tonumber(until_) < expires then
    redis.call('ZADD', p .. 'held', cur[6], d)
  end
end
return cur
