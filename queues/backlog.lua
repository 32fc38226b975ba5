-- The state of one consumer group, with a lag that a wrong `entries-read` cannot fool.
-- Read-only (run with EVALSHA_RO / EVAL_RO by every role that observes a stream).
--
-- KEYS[1]  the stream
-- ARGV[1]  the group
--
-- Redis derives a group's `lag` from its `entries-read` counter; Redis 7.0 loses that counter
-- when it loads a rewritten AOF (lag 50 forever for a group that has read everything), so the
-- reported lag is checked against what it can never exceed:
-- - nothing after the group's last-delivered id: the lag is 0;
-- - the entries after the last-delivered id are at most the stream's length less the group's
--   pending entries (pending entries are at or below that id and still in the stream);
-- a reported lag that breaks either (or that Redis cannot tell: nil after deletions) is
-- replaced by the count of entries after the last-delivered id.
--
-- Returns {length, found (0/1), reported lag (-1: none), lag, pending, consumers,
--          last-generated id, the server's time in ms}. A missing stream: zeros and '0-0'.
local stream = KEYS[1]
local group = ARGV[1]

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if redis.call('EXISTS', stream) == 0 then return {0, 0, -1, 0, 0, 0, '0-0', now_ms} end
local length = redis.call('XLEN', stream)
local sinfo = redis.call('XINFO', 'STREAM', stream)
local last_generated = '0-0'
for i = 1, #sinfo, 2 do
  if sinfo[i] == 'last-generated-id' then last_generated = sinfo[i + 1] end
end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == group then
    local reported = info['lag']  -- false when Redis cannot tell
    local pending = tonumber(info['pending'])
    local after = '(' .. info['last-delivered-id']
    local lag
    if #redis.call('XRANGE', stream, after, '+', 'COUNT', 1) == 0 then
      lag = 0
    elseif reported and reported > 0 and reported <= length - pending then
      lag = reported
    else
      lag = #redis.call('XRANGE', stream, after, '+')
    end
    return {length, 1, reported or -1, lag, pending, tonumber(info['consumers']), last_generated,
            now_ms}
  end
end
return {length, 0, -1, length, 0, 0, last_generated, now_ms}
