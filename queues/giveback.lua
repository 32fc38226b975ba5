-- Give entries back uncharged: each entry still pending in this consumer with the delivery
-- count it was handed out with gets that count less one, its idle time kept (XCLAIM to
-- itself with RETRYCOUNT and JUSTID), so the read that handed it out is not charged.
--
-- KEYS[1]  the stream
-- ARGV[1]  consumer group
-- ARGV[2]  this consumer
-- ARGV[3..]  pairs: entry id, the delivery count it was handed out with
--
-- An entry settled meanwhile, taken over by another consumer, or delivered again since (its
-- count moved on) is left as it is. Returns how many entries were given back.
local given = 0
for i = 3, #ARGV, 2 do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  local row = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1, ARGV[2])
  if #row == 1 and n > 0 and tonumber(row[1][4]) == n then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', row[1][3],
               'RETRYCOUNT', n - 1, 'JUSTID')
    given = given + 1
  end
end
return given
