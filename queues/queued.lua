-- How many of the given entries are still in a consumer group's backlog: not delivered to
-- the group yet (after its last-delivered id), or delivered and not acknowledged (pending).
-- Read-only (EVALSHA_RO / EVAL_RO); ids.lua in front (`less`).
--
-- KEYS[1]  the stream
-- ARGV[1]  the group
-- ARGV[2..]  entry ids of that stream
--
-- A missing stream: 0. A missing group: every id (nothing was delivered).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local last = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == ARGV[1] then last = info['last-delivered-id'] end
end
if last == nil then return #ARGV - 1 end
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if less(last, id) or #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0 then
    n = n + 1
  end
end
return n
