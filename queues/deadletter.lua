-- Dead-letter a message, atomically: copy it to the dead-letter stream, then acknowledge it.
--
-- KEYS[1]  input stream
-- KEYS[2]  dead-letter stream
-- ARGV[1]  consumer group of the input stream
-- ARGV[2]  entry id
-- ARGV[3]  encoded DeadLetter (field "d")
-- ARGV[4]  error text (field "error", for humans reading the stream)
redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'error', ARGV[4])
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
