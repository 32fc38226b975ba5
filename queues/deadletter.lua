-- Dead-letter a message, atomically: acknowledge it and copy it to the dead-letter stream.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- KEYS[3]  counter of dead-lettered training groups (names.dead_groups, same slot)
-- KEYS[4]  set of admitted, unsettled training groups (names.admitted_groups, same slot)
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
-- ARGV[5]  the training group id the message claims to carry, or "" for none
--
-- Only an entry that was still pending is copied: when two consumers hold the same entry
-- (one reclaimed it from the other, a call replayed after a lost reply) it is dead-lettered
-- once. A group's letter frees its admission slot (INCR KEYS[3]) only if the group was
-- admitted and is still unsettled: it is taken out of KEYS[4] in the same step, so a group
-- frees its slot once (a forged or never-admitted group, or a second letter of the same
-- group, frees none). Such a letter carries the field "group" (the id), and requeue.lua
-- puts the group back in KEYS[4] and takes the slot back.
-- Returns 1 if the entry was dead-lettered now, 0 if it had been settled already.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then
  if ARGV[5] ~= '' and redis.call('SREM', KEYS[4], ARGV[5]) == 1 then
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', ARGV[5])
    redis.call('INCR', KEYS[3])
  else
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
  end
end
return acked
