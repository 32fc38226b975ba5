-- Requeue one dead letter: XADD its payload to the original stream and XDEL it from the
-- dead-letter stream, in one script (all keys share the run's or the shard's hash tag).
--
-- KEYS[1]  the dead-letter stream
-- KEYS[2]  the original stream
-- KEYS[3]  counter of released tickets (Layout.released_tickets)
-- KEYS[4]  set of open tickets (Layout.open_tickets)
-- KEYS[5..]  counters the letter added (its field "counted", read by the caller; same slot)
-- ARGV[1]  the dead entry's id
-- ARGV[2]  the payload (or its claim-check reference)
--
-- Returns the new entry id, or false if the letter was no longer there (already requeued
-- or purged): then nothing is added, so a repeated or concurrent requeue adds it once.
-- A letter that released a ticket (its field "group" holds the ticket, see deadletter.lua)
-- takes the release back: the ticket is open again (SADD KEYS[4], DECR KEYS[3]); and the
-- counters it added with the release (its field "counted") are taken back, each of KEYS[5..]
-- by what the letter added to it, in the same step (a key the letter did not count: none).
local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #found == 0 then
  return false
end
local fields = found[1][2]
local added = {}
for i = 1, #fields, 2 do
  if fields[i] == 'group' and fields[i + 1] ~= '' then
    redis.call('SADD', KEYS[4], fields[i + 1])
    redis.call('DECR', KEYS[3])
  elseif fields[i] == 'counted' then
    for _, pair in ipairs(cjson.decode(fields[i + 1])) do
      added[pair[1]] = (added[pair[1]] or 0) + pair[2]
    end
  end
end
for i = 5, #KEYS do
  if added[KEYS[i]] then
    redis.call('DECRBY', KEYS[i], added[KEYS[i]])
    added[KEYS[i]] = nil
  end
end
local id = redis.call('XADD', KEYS[2], '*', 'd', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1])
return id
