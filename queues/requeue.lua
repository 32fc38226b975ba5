-- Requeue one dead letter: XADD its payload to the original stream and XDEL it from the
-- dead-letter stream, in one script (both keys share the run's or the shard's hash tag).
--
-- KEYS[1]  the dead-letter stream
-- KEYS[2]  the original stream
-- ARGV[1]  the dead entry's id
-- ARGV[2]  the payload (or its claim-check reference)
--
-- Returns the new entry id, or false if the letter was no longer there (already requeued
-- or purged): then nothing is added, so a repeated or concurrent requeue adds it once.
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', 'd', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1])
return id
