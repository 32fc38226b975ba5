-- Dead-letter a message, atomically: acknowledge it and copy it to the dead-letter stream.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- KEYS[3]  counter of released tickets (Layout.released_tickets, same slot)
-- KEYS[4]  set of open tickets (Layout.open_tickets, same slot)
-- KEYS[5..4+c]  counters the letter adds when it releases its ticket (same slot)
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
-- ARGV[5]  the ticket the entry claims to carry, or "" for none
-- ARGV[6..5+c]  the increment of each counter of KEYS[5..]
--
-- Only an entry that was still pending is copied: when two consumers hold the same entry
-- (one reclaimed it from the other, a call replayed after a lost reply) it is dead-lettered
-- once. The letter releases the ticket (INCR KEYS[3]) only if the ticket is still open: it
-- is taken out of KEYS[4] in the same step, so a ticket is released once (a forged or
-- never-opened ticket, or a second letter with the same ticket, releases none); the counters
-- of KEYS[5..] are added in that same step, so they too count a ticket once. Such a
-- letter carries the ticket in its field "group" (the stored name) and the counters it added
-- in its field "counted" (JSON [[key, increment], ...]), and requeue.lua opens the ticket
-- again and takes the release and the counters back. What the pipeline uses tickets for:
-- protocol/names.py.
-- Returns 1 if the entry was dead-lettered now, 0 if it had been settled already.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then
  if ARGV[5] ~= '' and redis.call('SREM', KEYS[4], ARGV[5]) == 1 then
    local counted = {}
    for i = 5, #KEYS do
      redis.call('INCRBY', KEYS[i], ARGV[i + 1])
      counted[#counted + 1] = {KEYS[i], tonumber(ARGV[i + 1])}
    end
    if #counted > 0 then
      redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', ARGV[5],
                 'counted', cjson.encode(counted))
    else
      redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', ARGV[5])
    end
    redis.call('INCR', KEYS[3])
  else
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
  end
end
return acked
