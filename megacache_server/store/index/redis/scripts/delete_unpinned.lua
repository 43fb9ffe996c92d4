-- ARGV: prefix, entry keys. Each entry that exists and is not pinned goes with every
-- secondary key `put` wrote (the same keys `_unindex` removes); returns how many went.
-- A hash without a model is what a lookup's touch leaves of an entry deleted under it.
local p, n = ARGV[1], 0
for i = 2, #ARGV do
  local key = ARGV[i]
  local ekey = p .. 'entry:' .. key
  local f = redis.call('HMGET', ekey, 'namespace', 'model', 'env', 'hw', 'size', 'digests',
                       'pinned')
  if not f[2] then
    redis.call('DEL', ekey)
    redis.call('ZREM', p .. 'lru', key)
  elseif f[7] ~= '1' then
    local ns, size = f[1] or 'default', tonumber(f[5] or '0')
    redis.call('DEL', ekey)
    redis.call('ZREM', p .. 'by_model:' .. f[2], key)
    redis.call('ZREM', p .. 'by_envhw:' .. (f[3] or '') .. ':' .. (f[4] or ''), key)
    for _, z in ipairs({'entries', 'ns:' .. ns, 'lru', 'lru:' .. ns, 'sizes', 'sizes:' .. ns}) do
      redis.call('ZREM', p .. z, key)
    end
    redis.call('HINCRBY', p .. 'usage', ns .. ':entries', -1)
    redis.call('HINCRBY', p .. 'usage', ns .. ':bytes', -size)
    redis.call('HINCRBY', p .. 'usage', '*:entries', -1)
    redis.call('HINCRBY', p .. 'usage', '*:bytes', -size)
    for d in string.gmatch(f[6] or '', '[^,]+') do
      redis.call('SREM', p .. 'refs:' .. d, key)
      redis.call('SADD', p .. 'unref', d)
    end
    n = n + 1
  end
end
return n
