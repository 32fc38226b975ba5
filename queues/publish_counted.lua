-- Publish entries and count them, atomically, if the counter still holds the expected value
-- (compare-and-set). Replayed after a lost reply, or raced by a second producer, it adds
-- nothing, so the counter ("entries published so far") stays exact and can bound producers.
--
-- KEYS[1]  the stream
-- KEYS[2]  the counter
-- KEYS[3]  (when m > 0) a set the members are added to with the entries (open tickets)
-- KEYS[#KEYS]  (when t > 0) a hash of tallies: field n added to each of its t fields
-- ARGV[1]  the value the counter must hold (a missing counter holds 0)
-- ARGV[2]  m: number of members
-- ARGV[3..2+m]  members
-- ARGV[3+m]     t: number of tallies
-- ARGV[4+m..3+m+2t]  tallies, (field, n) pairs
-- ARGV[4+m+2t..]     payloads (field "d")
--
-- Returns the number of entries added: #payloads, or 0 when the counter had moved.
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current ~= tonumber(ARGV[1]) then return 0 end
local m = tonumber(ARGV[2])
local t = tonumber(ARGV[3 + m])
local first = 4 + m + 2 * t
for i = first, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
end
if m > 0 then
  redis.call('SADD', KEYS[3], unpack(ARGV, 3, 2 + m))
end
for i = 4 + m, first - 1, 2 do
  redis.call('HINCRBY', KEYS[#KEYS], ARGV[i], ARGV[i + 1])
end
redis.call('INCRBY', KEYS[2], #ARGV - first + 1)
return #ARGV - first + 1
