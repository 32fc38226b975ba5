-- Requeue one dead letter: XADD its payload to the original stream and XDEL it from the
-- dead-letter stream, in one script (all keys share the run's or the shard's hash tag).
--
-- KEYS[1]  the dead-letter stream
-- KEYS[2]  the original stream
-- KEYS[3]  counter of released tickets (Layout.released_tickets)
-- KEYS[4]  set of open tickets (Layout.open_tickets)
-- KEYS[5]  set of released tickets (Layout.released_ids)
-- KEYS[6]  hash of what each released ticket's letter counted (Layout.released_counts)
-- KEYS[7..]  counters the caller allows to be taken back (same slot)
-- ARGV[1]  the dead entry's id
-- ARGV[2]  the payload (or its claim-check reference)
-- ARGV[3]  the ticket the payload carries (derived by the caller from the payload), or ""
-- ARGV[4]  the most taken back from each counter of KEYS[7..]
--
-- Returns the new entry id, or false if the letter was no longer there (already requeued
-- or purged): then nothing is added, so a repeated or concurrent requeue adds it once.
-- Nothing is taken from the letter's own fields (any stage can write a letter): the ticket
-- is opened again only if deadletter.lua released it (SMOVE from KEYS[5] back to KEYS[4],
-- so once, and never a ticket that was not open), and then the release is taken back (DECR
-- KEYS[3]) with what deadletter.lua recorded for it in KEYS[6], each of KEYS[7..] by at most
-- ARGV[4]. No counter goes below zero.
local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #found == 0 then
  return false
end

local function take_back(key, most)
  local have = tonumber(redis.call('GET', key) or '0') or 0
  local take = math.min(most, have)
  if take > 0 then
    redis.call('DECRBY', key, take)
  end
end

if ARGV[3] ~= '' and redis.call('SMOVE', KEYS[5], KEYS[4], ARGV[3]) == 1 then
  take_back(KEYS[3], 1)
  local record = redis.call('HGET', KEYS[6], ARGV[3])
  redis.call('HDEL', KEYS[6], ARGV[3])
  local ok, pairs_ = false, nil
  if record then
    ok, pairs_ = pcall(cjson.decode, record)
  end
  if ok and type(pairs_) == 'table' then
    local added = {}
    for _, pair in ipairs(pairs_) do
      local n = type(pair) == 'table' and tonumber(pair[2]) or nil
      if n and n > 0 and type(pair[1]) == 'string' then
        added[pair[1]] = (added[pair[1]] or 0) + n
      end
    end
    for i = 7, #KEYS do
      if added[KEYS[i]] then
        take_back(KEYS[i], math.min(added[KEYS[i]], tonumber(ARGV[4])))
        added[KEYS[i]] = nil
      end
    end
  end
end
local id = redis.call('XADD', KEYS[2], '*', 'd', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1])
return id
