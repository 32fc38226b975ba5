-- Dead-letter a message, atomically: acknowledge it and copy it to the dead-letter stream.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- KEYS[3]  counter of dead-lettered training groups (names.dead_groups, same slot)
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
-- ARGV[5]  "1" if the message is (part of) an admitted training group, else "0"
--
-- Only an entry that was still pending is copied: when two consumers hold the same entry
-- (one reclaimed it from the other, a call replayed after a lost reply) it is dead-lettered
-- once. A training group's letter carries the field "group" and adds one to KEYS[3] in the
-- same step, so the group's admission slot is freed exactly once (requeue.lua takes it back).
-- Returns 1 if the entry was dead-lettered now, 0 if it had been settled already.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then
  if ARGV[5] == '1' then
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', '1')
    redis.call('INCR', KEYS[3])
  else
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
  end
end
return acked
