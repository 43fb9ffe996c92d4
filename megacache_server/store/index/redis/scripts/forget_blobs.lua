-- ARGV: prefix, digests. Drops each blob's record, size total, touch and verify times and
-- owners.
local p = ARGV[1]
for i = 2, #ARGV do
  local d = ARGV[i]
  local size = redis.call('HGET', p .. 'blobs', d)
  if size and redis.call('HDEL', p .. 'blobs', d) == 1 then
    redis.call('DECRBY', p .. 'stored_bytes', tonumber(size))
  end
  for _, ns in ipairs(redis.call('SMEMBERS', p .. 'blob_owners:' .. d)) do
    redis.call('SREM', p .. 'owned:' .. ns, d)
  end
  redis.call('DEL', p .. 'blob_owners:' .. d)
  redis.call('ZREM', p .. 'blob_touched', d)
  redis.call('ZREM', p .. 'blob_verified', d)
  redis.call('SREM', p .. 'unref', d)
end
return #ARGV - 1
