-- Stage hand-off, atomically: publish the outputs of a message once, then acknowledge it.
--
-- KEYS[1]        input stream
-- KEYS[2]        dedup key for this (stage, message id)
-- KEYS[3..]      output streams, one per payload (may repeat)
-- ARGV[1]        consumer group of the input stream
-- ARGV[2]        dedup key TTL in seconds
-- ARGV[3]        n: number of entry ids to acknowledge
-- ARGV[4..3+n]   entry ids
-- ARGV[4+n..]    payloads, one per output stream (field "d")
--
-- Returns {published (1/0), acked count}. A redelivered message whose outputs were already
-- published (the dedup key exists) publishes nothing and is only acknowledged.
local n = tonumber(ARGV[3])
local published = 0
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[2])) then
  for i = 3, #KEYS do
    redis.call('XADD', KEYS[i], '*', 'd', ARGV[3 + n + (i - 2)])
  end
  published = 1
end
local acked = 0
if n > 0 then
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4, 3 + n))
end
return {published, acked}
