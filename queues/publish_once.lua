-- Publish payloads once: XADD each to its stream, unless the dedup key says it was done.
--
-- KEYS[1]    dedup key
-- KEYS[2..]  output streams, one per payload (may repeat)
-- ARGV[1]    dedup key TTL in seconds
-- ARGV[2..]  payloads, one per output stream (field "d")
--
-- Returns 1 if published, 0 if the dedup key existed (published before: nothing added).
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[1])) then
  return 0
end
for i = 2, #KEYS do
  redis.call('XADD', KEYS[i], '*', 'd', ARGV[i])
end
return 1
