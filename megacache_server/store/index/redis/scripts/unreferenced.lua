-- ARGV: prefix, candidate digests (from `unref`). Returns [digest, size, touched, ...] of
-- those no entry names; drops from `unref` the ones named again or no longer recorded.
-- Check and drop are one atomic step: an entry deleted meanwhile re-adds its blobs after.
local p, out = ARGV[1], {}
for i = 2, #ARGV do
  local d = ARGV[i]
  local size = redis.call('HGET', p .. 'blobs', d)
  if not size or redis.call('SCARD', p .. 'refs:' .. d) > 0 then
    redis.call('SREM', p .. 'unref', d)
  else
    out[#out + 1] = d
    out[#out + 1] = size
    out[#out + 1] = redis.call('ZSCORE', p .. 'blob_touched', d) or '0'
  end
end
return out
