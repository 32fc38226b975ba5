-- Stage hand-off, atomically: publish the outputs of a message once, then acknowledge it.
--
-- KEYS[1]        input stream
-- KEYS[2]        dedup key for this (stage, message id)
-- KEYS[3]        (when m > 0) a set the settled members are removed from
-- KEYS[..]       output streams, one per payload (may repeat)
-- ARGV[1]        consumer group of the input stream
-- ARGV[2]        dedup key TTL in seconds
-- ARGV[3]        n: number of entry ids to acknowledge
-- ARGV[4..3+n]   entry ids
-- ARGV[4+n]      m: number of settled members (e.g. the training groups trained or dropped,
--                taken out of the admission record names.admitted_groups with their entries)
-- ARGV[5+n..4+n+m]  members
-- ARGV[5+n+m..]  payloads, one per output stream (field "d")
--
-- Returns {published (1/0), acked count}. A redelivered message whose outputs were already
-- published (the dedup key exists) publishes nothing and is only acknowledged.
local n = tonumber(ARGV[3])
local m = tonumber(ARGV[4 + n])
local first = 3
if m > 0 then first = 4 end
local published = 0
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[2])) then
  for i = first, #KEYS do
    redis.call('XADD', KEYS[i], '*', 'd', ARGV[5 + n + m + (i - first)])
  end
  published = 1
end
if m > 0 then
  redis.call('SREM', KEYS[3], unpack(ARGV, 5 + n, 4 + n + m))
end
local acked = 0
if n > 0 then
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4, 3 + n))
end
return {published, acked}
