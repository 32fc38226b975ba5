-- Dead-letter a message, atomically: acknowledge it and copy it to the dead-letter stream.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- KEYS[3]  counter of released tickets (Layout.released_tickets, same slot)
-- KEYS[4]  set of open tickets (Layout.open_tickets, same slot)
-- KEYS[5]  set of released tickets (Layout.released_ids, same slot)
-- KEYS[6]  hash: released ticket -> what its letter counted (Layout.released_counts, same slot)
-- KEYS[7..6+c]  counters the letter adds when it releases its ticket (same slot)
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
-- ARGV[5]  the ticket the entry claims to carry, or "" for none
-- ARGV[6..5+c]  the increment of each counter of KEYS[7..]
--
-- Only an entry that was still pending is copied: when two consumers hold the same entry
-- (one reclaimed it from the other, a call replayed after a lost reply) it is dead-lettered
-- once. The letter releases the ticket (INCR KEYS[3]) only if the ticket is still open: it
-- is moved from KEYS[4] to KEYS[5] in the same step (SMOVE: a forged or never-opened ticket,
-- or a second letter with the same ticket, releases none, and KEYS[5] only ever holds
-- tickets that were open); the counters of KEYS[7..] are added in that same step, so they
-- too count a ticket once, and recorded under the ticket in KEYS[6] (JSON [[key, increment],
-- ...]). requeue.lua gives back what these records say, never what a letter's fields claim:
-- the fields "group" (the ticket) and "counted" (the same JSON) are for humans reading the
-- stream. What the pipeline uses tickets for: protocol/names.py.
-- Returns 1 if the entry was dead-lettered now, 0 if it had been settled already.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 1 then
  if ARGV[5] ~= '' and redis.call('SMOVE', KEYS[4], KEYS[5], ARGV[5]) == 1 then
    local counted = {}
    for i = 7, #KEYS do
      redis.call('INCRBY', KEYS[i], ARGV[i - 1])
      counted[#counted + 1] = {KEYS[i], tonumber(ARGV[i - 1])}
    end
    if #counted > 0 then
      local json = cjson.encode(counted)
      redis.call('HSET', KEYS[6], ARGV[5], json)
      redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', ARGV[5],
                 'counted', json)
    else
      redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4], 'group', ARGV[5])
    end
    redis.call('INCR', KEYS[3])
  else
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
  end
end
return acked
