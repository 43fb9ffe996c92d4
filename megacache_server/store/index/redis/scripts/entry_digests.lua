-- ARGV: prefix, entry keys. Each entry's `digests` field ('' when it names none), or
-- false (nil in the reply) where the hash is gone or is only a touch's remnant.
local p, out = ARGV[1], {}
for i = 2, #ARGV do
  local f = redis.call('HMGET', p .. 'entry:' .. ARGV[i], 'model', 'digests')
  if f[1] then out[i - 1] = f[2] or '' else out[i - 1] = false end
end
return out
