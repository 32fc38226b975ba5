-- Dead-letter a message, atomically: acknowledge it and copy it to the dead-letter stream.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
--
-- Only an entry that was still pending is copied: when two consumers hold the same entry
-- (one reclaimed it from the other, a call replayed after a lost reply) it is dead-lettered
-- once. Returns 1 if the entry was dead-lettered now, 0 if it had been settled already.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then
  redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
end
return acked
