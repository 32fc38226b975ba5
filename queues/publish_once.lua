-- Publish payloads once: XADD each to its stream, unless the dedup key says it was done.
--
-- KEYS[1]    dedup key
-- KEYS[2]    (when m > 0) a set the members are added to with the payloads
-- KEYS[..]   output streams, one per payload (may repeat)
-- ARGV[1]    dedup key TTL in seconds
-- ARGV[2]    m: number of members
-- ARGV[3..2+m]  members (tickets opened with the payloads, e.g. per shard, queues/shards.py)
-- ARGV[3+m..]   payloads, one per output stream (field "d")
--
-- Returns 1 if published, 0 if the dedup key existed (published before: nothing added).
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[1])) then
  return 0
end
local m = tonumber(ARGV[2])
local first = 2
if m > 0 then
  redis.call('SADD', KEYS[2], unpack(ARGV, 3, 2 + m))
  first = 3
end
for i = first, #KEYS do
  redis.call('XADD', KEYS[i], '*', 'd', ARGV[2 + m + i - first + 1])
end
return 1
