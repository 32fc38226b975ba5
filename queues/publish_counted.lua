-- Publish entries and count them, atomically, if the counter still holds the expected value
-- (compare-and-set). Replayed after a lost reply, or raced by a second producer, it adds
-- nothing, so a counter that bounds admission (e.g. "groups admitted so far") stays exact.
--
-- KEYS[1]  the stream
-- KEYS[2]  the counter
-- ARGV[1]  the value the counter must hold (a missing counter holds 0)
-- ARGV[2..] payloads (field "d")
--
-- Returns the number of entries added: #payloads, or 0 when the counter had moved.
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current ~= tonumber(ARGV[1]) then return 0 end
for i = 2, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
end
redis.call('INCRBY', KEYS[2], #ARGV - 1)
return #ARGV - 1
