-- ARGV: prefix, a count n, n field names, then entry keys. For each key in turn, the
-- entry's values of those fields, false (nil in the reply) for each it lacks: a gone
-- entry gives n nils.
local p, n, out = ARGV[1], tonumber(ARGV[2]), {}
local fields = {}
for j = 1, n do fields[j] = ARGV[2 + j] end
for i = 3 + n, #ARGV do
  local f = redis.call('HMGET', p .. 'entry:' .. ARGV[i], unpack(fields))
  for j = 1, n do out[#out + 1] = f[j] end
end
return out
