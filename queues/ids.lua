-- Stream ids in Lua, for the scripts that compare them (queues/scripts.py puts this in
-- front of a script that asks for it). An id is "<ms>-<seq>".
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end

