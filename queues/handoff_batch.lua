-- Many stage hand-offs of one input stream in one call: for each, publish its outputs once,
-- then acknowledge its entry. The script runs atomically, so each hand-off's publish and ack
-- happen together (as in handoff.lua), with one round trip and one XACK for the batch.
--
-- KEYS[1]    input stream
-- KEYS[2..]  for each hand-off with k > 0 outputs, c > 0 counters, s > 0 stores or d > 0
--            deletes, in order: its dedup key, then its k output streams (may repeat), its c
--            counter keys, its s hash keys, its d keys to delete, then (shape -2) the set
--            of open tickets
-- ARGV[1]    consumer group of the input stream
-- ARGV[2]    dedup key TTL in seconds
-- ARGV[3..]  for each hand-off, in order: entry id, its shape, its k payloads (field "d"),
--            its c increments (INCRBY, one per counter key), then for each hash key: field,
--            value, TTL in seconds (HSET, EXPIRE). The shape is k alone when c = s = d = 0
--            (the common hand-off: two header arguments), else -1, k, c, s, d, or -2, k, c,
--            s, d, ticket: then its counters are added only if the ticket is in the set of
--            open tickets (SISMEMBER: a group never admitted, or settled already, counts
--            nothing; its outputs are published all the same)
--
-- A hand-off with none of those is only acknowledged (no dedup key). One whose dedup key
-- exists (its outputs were published by an earlier delivery) publishes, counts, stores and
-- deletes nothing and is acknowledged: a counter moves with the first publication of the
-- hand-off that causes it, so a replayed hand-off (redelivery, reclaim, a call repeated
-- after a lost reply) never counts twice.
-- Returns {published: hand-offs whose outputs were added, acked: entries acknowledged}.
--
-- If an XADD or INCRBY fails (e.g. a key of the wrong type), the hand-offs before it stay
-- done and are acknowledged, its dedup key is dropped (SET with a 1 ms expiry: roles may SET
-- their dedup keys but not DEL them, see queues/acl.py) and it and the ones after it stay
-- pending (a redelivery publishes it again, so outputs it added before the failure may
-- repeat: at least once; its counters are added after all its outputs, so only a failing
-- INCRBY can leave some of them counted); the error is returned.
local group = ARGV[1]
local ttl = ARGV[2]  -- passed on as is: no number-to-string conversion per SET
local ids = {}

local function ack()
  local acked = 0
  for first = 1, #ids, 1000 do
    local last = math.min(first + 999, #ids)
    acked = acked + redis.call('XACK', KEYS[1], group, unpack(ids, first, last))
  end
  return acked
end

local published = 0
local k_at = 2
local a_at = 3
local n_args = #ARGV
local function failed(reply, dedup)
  if type(reply) == 'table' and reply.err then
    redis.call('SET', dedup, '0', 'PX', 1)
    ack()
    return true
  end
  return false
end

while a_at <= n_args do
  local id = ARGV[a_at]
  local k = tonumber(ARGV[a_at + 1])
  local c, s, d, o = 0, 0, 0, 0
  local ticket = nil
  if k < 0 then
    if k == -2 then
      ticket, o = ARGV[a_at + 6], 1
    end
    k = tonumber(ARGV[a_at + 2])
    c = tonumber(ARGV[a_at + 3])
    s = tonumber(ARGV[a_at + 4])
    d = tonumber(ARGV[a_at + 5])
    a_at = a_at + 6 + o
  else
    a_at = a_at + 2
  end
  if k + c + s + d > 0 then
    local dedup = KEYS[k_at]
    if redis.call('SET', dedup, '1', 'NX', 'EX', ttl) then
      for j = 1, s do  -- stored first: an entry published below may reference them
        local at = a_at + k + c + 3 * (j - 1)
        local stored = redis.pcall('HSET', KEYS[k_at + k + c + j], ARGV[at], ARGV[at + 1])
        if failed(stored, dedup) then return stored end
        redis.call('EXPIRE', KEYS[k_at + k + c + j], ARGV[at + 2])
      end
      for j = 1, k do
        local added = redis.pcall('XADD', KEYS[k_at + j], '*', 'd', ARGV[a_at + j - 1])
        if failed(added, dedup) then return added end
      end
      -- a hand-off with a ticket counts only if the ticket is open
      local counting = not ticket
        or redis.call('SISMEMBER', KEYS[k_at + k + c + s + d + 1], ticket) == 1
      for j = 1, (counting and c or 0) do
        local counted = redis.pcall('INCRBY', KEYS[k_at + k + j], ARGV[a_at + k + j - 1])
        if failed(counted, dedup) then return counted end
      end
      for j = 1, d do
        redis.call('DEL', KEYS[k_at + k + c + s + j])
      end
      published = published + 1
    end
    k_at = k_at + 1 + k + c + s + d + o
    a_at = a_at + k + c + 3 * s
  end
  ids[#ids + 1] = id
end
return {published, ack()}
