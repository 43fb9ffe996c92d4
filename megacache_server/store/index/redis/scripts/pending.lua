-- ARGV: prefix, namespace, then digests the namespace owns. Returns the summed recorded size
-- of those that no entry of the namespace names (another namespace's entries do not count).
local p, ns, total = ARGV[1], ARGV[2], 0
local own = p .. 'ns:' .. ns
for i = 3, #ARGV do
  local size = redis.call('HGET', p .. 'blobs', ARGV[i])
  if size then
    local named = false
    for _, key in ipairs(redis.call('SMEMBERS', p .. 'refs:' .. ARGV[i])) do
      if redis.call('ZSCORE', own, key) then
        named = true
        break
      end
    end
    if not named then total = total + tonumber(size) end
  end
end
return total
