-- Stage hand-off, atomically: publish the outputs of a message once, then acknowledge it.
--
-- KEYS[1]        input stream
-- KEYS[2]        dedup key for this (stage, message id)
-- KEYS[3]        (when m > 0) a set the settled members are removed from
-- KEYS[..]       c counter keys, then the output streams, one per payload (may repeat)
-- ARGV[1]        consumer group of the input stream
-- ARGV[2]        dedup key TTL in seconds
-- ARGV[3]        n: number of entry ids to acknowledge
-- ARGV[4..3+n]   entry ids
-- ARGV[4+n]      m: number of settled members (tickets the entries carry, taken out of the
--                open tickets, Layout.open_tickets, with their entries)
-- ARGV[5+n..4+n+m]  members
-- ARGV[5+n+m]    c: number of counters
-- ARGV[6+n+m..5+n+m+c]  increments, one per counter key (INCRBY)
-- ARGV[6+n+m+c..]  payloads, one per output stream (field "d")
--
-- Returns {published (1/0), acked count}. A redelivered message whose outputs were already
-- published (the dedup key exists) publishes nothing, counts nothing and is only
-- acknowledged: the counters move with the first publication, so a replayed hand-off never
-- counts twice.
local n = tonumber(ARGV[3])
local m = tonumber(ARGV[4 + n])
local c = tonumber(ARGV[5 + n + m])
local first = 3
if m > 0 then first = 4 end
local outs = first + c  -- first output stream
local published = 0
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[2])) then
  for i = outs, #KEYS do
    redis.call('XADD', KEYS[i], '*', 'd', ARGV[6 + n + m + c + (i - outs)])
  end
  for j = 1, c do
    redis.call('INCRBY', KEYS[first + j - 1], ARGV[5 + n + m + j])
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
