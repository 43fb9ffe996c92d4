-- ARGV: prefix, zset key, first rank, last rank (newest first), namespace, env, hw ('' =
-- any). Returns the number of zset members read, then [key, field values...] of each entry
-- there that exists and matches every filter (fields in LISTED_FIELDS' order).
local p, ns, env, hw, out = ARGV[1], ARGV[5], ARGV[6], ARGV[7], {}
local keys = redis.call('ZREVRANGE', ARGV[2], ARGV[3], ARGV[4])
out[1] = #keys
for _, key in ipairs(keys) do
  local f = redis.call('HMGET', p .. 'entry:' .. key, 'model', 'namespace', 'env', 'hw',
                       'digests', 'size', 'created_at', 'updated_at', 'last_access', 'pinned',
                       'manifest', 'etag', 'provenance')
  if f[1] and (ns == '' or (f[2] or 'default') == ns) and (env == '' or f[3] == env)
      and (hw == '' or f[4] == hw) then
    out[#out + 1] = key
    for i = 1, #f do out[#out + 1] = f[i] or '' end
  end
end
return out
