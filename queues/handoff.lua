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
-- ARGV[6+n+m+c]  "1": the counters are added only if the SREM took a member out (the entry
--                settled an open ticket: a ticket released already, by a dead letter of
--                another entry, or never opened, counts nothing); "0": always
-- ARGV[7+n+m+c..]  payloads, one per output stream (field "d")
--
-- Returns {published (1/0), acked count}. A redelivered message whose outputs were already
-- published (the dedup key exists) publishes nothing, counts nothing and is only
-- acknowledged: the counters move with the first publication, so a replayed hand-off never
-- counts twice.
local n = tonumber(ARGV[3])
local m = tonumber(ARGV[4 + n])
local c = tonumber(ARGV[5 + n + m])
local only_settling = ARGV[6 + n + m + c] == '1'
local first = 3
if m > 0 then first = 4 end
local outs = first + c  -- first output stream
local removed = 0
if m > 0 then
  removed = redis.call('SREM', KEYS[3], unpack(ARGV, 5 + n, 4 + n + m))
end
local published = 0
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[2])) then
  for i = outs, #KEYS do
    redis.call('XADD', KEYS[i], '*', 'd', ARGV[7 + n + m + c + (i - outs)])
  end
  if removed > 0 or not only_settling then
    for j = 1, c do
      redis.call('INCRBY', KEYS[first + j - 1], ARGV[5 + n + m + j])
    end
  end
  published = 1
end
local acked = 0
if n > 0 then
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 4, 3 + n))
end
return {published, acked}
