-- Reserve a counted publish that crosses slots: count it and record what it publishes,
-- atomically, if the counter still holds the expected value (compare-and-set). The entries
-- themselves are published afterwards, shard by shard, each exactly once (queues/shards.py,
-- publish_counted_routed), and the record is deleted. Every key here is run-global.
--
-- KEYS[1]  the counter
-- KEYS[2]  the hash of reservations (Layout.reservations; field: the counter value it
--          started from)
-- ARGV[1]  the value the counter must hold (a missing counter holds 0)
-- ARGV[2]  a token unique to this call (fixed length), prefixed to the record
-- ARGV[3]  the record (what to publish)
-- ARGV[4]  how many entries it publishes
-- KEYS[3], ARGV[5..]  (optional) a hash of tallies and (field, n) pairs: n added to each
--          field with the reservation
--
-- Returns ARGV[4] when reserved (also when replayed after a lost reply: the record starts
-- with this call's token), 0 when the counter had moved (another call counted first).
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held then
  if string.sub(held, 1, #ARGV[2]) == ARGV[2] then return tonumber(ARGV[4]) end
  return 0
end
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return 0 end
redis.call('INCRBY', KEYS[1], ARGV[4])
for i = 5, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ARGV[3])
return tonumber(ARGV[4])
