-- ARGV: prefix, now, blob digests. For each digest in turn: how many names it has (entries
-- naming it, plus one when a live job resolution holds it past `now`), then its recorded
-- size (false, nil in the reply, when the index has no record of it).
local p, now, out = ARGV[1], tonumber(ARGV[2]), {}
for i = 3, #ARGV do
  local d = ARGV[i]
  local names = redis.call('SCARD', p .. 'refs:' .. d)
  local held = redis.call('ZSCORE', p .. 'held', d)
  if held and tonumber(held) > now then names = names + 1 end
  out[#out + 1] = names
  out[#out + 1] = redis.call('HGET', p .. 'blobs', d)
end
return out
