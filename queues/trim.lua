-- Trim a work stream, atomically, without ever deleting an entry some group still needs.
--
-- KEYS[1]  the stream
-- ARGV[1]  retain: keep at least this many newest entries even if acknowledged (replay)
-- ARGV[2]  limit: delete at most this many entries per call (bounded script time)
-- ARGV[3]  claim-check reference prefix (payloads starting with it name a blob key)
-- ARGV[4]  forget consumers idle longer than this many ms that hold no pending entries
--          (restarted processes leave their old names behind; 0: keep all)
--
-- The boundary is the lowest of, over every consumer group: its oldest pending entry, or,
-- with nothing pending, its last delivered id (everything below it was acknowledged). A
-- stream without groups is left alone. Entries below the boundary are deleted (XTRIM
-- MINID, exact) together with their claim-check blobs: only a reference naming a blob of
-- this stream (<stream>:blob:...) has its key deleted; a forged one naming any other key
-- (a counter, another stream's blob) is trimmed with its entry, the key left alone.
-- Returns the number of entries deleted.
local stream = KEYS[1]
local retain = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local prefix = ARGV[3]
local forget_idle_ms = tonumber(ARGV[4])
local blobs = stream .. ':blob:'

-- parse(id), less(a, b): ids.lua, put in front by queues/scripts.py
if redis.call('EXISTS', stream) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', stream)
if #groups == 0 then return 0 end
local boundary = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local candidate = info['last-delivered-id']
  if tonumber(info['pending']) > 0 then
    candidate = redis.call('XPENDING', stream, info['name'])[2]
  end
  if boundary == nil or less(candidate, boundary) then boundary = candidate end
  if forget_idle_ms > 0 then
    for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, info['name'])) do
      local ci = {}
      for i = 1, #c, 2 do ci[c[i]] = c[i + 1] end
      if tonumber(ci['pending']) == 0 and tonumber(ci['idle']) > forget_idle_ms then
        redis.call('XGROUP', 'DELCONSUMER', stream, info['name'], ci['name'])
      end
    end
  end
end
if retain > 0 then
  local newest = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', retain)
  if #newest < retain then return 0 end
  local oldest_kept = newest[#newest][1]
  if less(oldest_kept, boundary) then boundary = oldest_kept end
end

-- At most `limit` entries strictly below the boundary, deleting their blobs first.
local doomed = redis.call('XRANGE', stream, '-', '(' .. boundary, 'COUNT', limit)
if #doomed == 0 then return 0 end
for _, entry in ipairs(doomed) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    local v = fields[i + 1]
    if string.sub(v, 1, #prefix) == prefix then
      local key = string.sub(v, #prefix + 1)
      if string.sub(key, 1, #blobs) == blobs then redis.call('DEL', key) end
    end
  end
end
local last = doomed[#doomed][1]
if #doomed == limit then
  -- trim through `last` only: MINID keeps ids >= the argument, so step one past it
  local ms, seq = parse(last)
  boundary = ms .. '-' .. (seq + 1)
end
return redis.call('XTRIM', stream, 'MINID', boundary)
