-- Repair a consumer group's `entries-read` where it is wrong, without moving the group.
-- Run by a consumer of the group (its role may XGROUP SETID on its own input stream).
--
-- KEYS[1]  the stream
-- ARGV[1]  the group
--
-- Redis 7.0 loses `entries-read` when it loads a rewritten AOF, and from then on reports a
-- lag too large by the same amount, forever. The right value is the stream's entries-added
-- less the entries after the group's last-delivered id; it is set with XGROUP SETID at that
-- same id (atomically: the group cannot move meanwhile), so nothing is delivered again or
-- skipped. Left alone: a group whose range after its last-delivered id had entries deleted
-- (XDEL: entries-read cannot be told), a group without entries-read yet, and a missing stream
-- or group.
--
-- Returns {} when nothing was wrong, else {entries-read before, after, lag now}.
local stream = KEYS[1]
local group = ARGV[1]

-- parse(id), less(a, b): ids.lua, put in front by queues/scripts.py
if redis.call('EXISTS', stream) == 0 then return {} end
local sinfo = {}
local raw = redis.call('XINFO', 'STREAM', stream)
for i = 1, #raw, 2 do sinfo[raw[i]] = raw[i + 1] end
local added = tonumber(sinfo['entries-added'])
local deleted = sinfo['max-deleted-entry-id'] or '0-0'
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == group then
    local cursor = info['last-delivered-id']
    if deleted ~= '0-0' and not less(deleted, cursor) then return {} end
    local read = info['entries-read']
    if not read then return {} end  -- none yet (a new group): Redis estimates the lag itself
    local expected = added - read
    -- the entries after the cursor, counted no further than needed
    local after = #redis.call('XRANGE', stream, '(' .. cursor, '+', 'COUNT', expected + 1)
    if after > expected then after = #redis.call('XRANGE', stream, '(' .. cursor, '+') end
    local want = added - after
    if read == want then return {} end
    redis.call('XGROUP', 'SETID', stream, group, cursor, 'ENTRIESREAD', want)
    return {read, want, after}
  end
end
return {}
