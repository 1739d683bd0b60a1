-- migrate: bring one busy key written by schema version 3 to version 4 (RedisStore.migrate).
-- Run with the workers drained; running it again changes nothing but due_at.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua (run id '')
-- Each run's passed_over_at becomes its reissue_at (the same value), its unconfirmed waiters
-- are indexed by created_at, the version-3 'overdue' zset is deleted, and the key is due at once
-- (due_at 0): the first tick recomputes due_at by the new rules (gate._hand_on).
-- Returns the number of runs read.

use_key(KEYS, ARGV)
local ids = redis.call('ZRANGE', K.holders, 0, -1)
for _, run_id in ipairs(redis.call('ZRANGE', K.waiters, 0, -1)) do
  ids[#ids + 1] = run_id
end
for _, run_id in ipairs(ids) do
  local key = run_key(run_id)
  local v = redis.call('HMGET', key, 'state', 'confirmed', 'created_at', 'passed_over_at')
  if v[4] then
    redis.call('HSET', key, 'reissue_at', v[4])
    redis.call('HDEL', key, 'passed_over_at')
  end
  if v[1] and v[1] ~= 'holding' and v[2] == '0' then
    redis.call('ZADD', K.unconfirmed, v[3], run_id)
  end
end
redis.call('DEL', K.prefix .. 'overdue')
if redis.call('EXISTS', K.meta) == 1 and #ids > 0 then
  redis.call('HSET', K.meta, 'due_at', '0')
  redis.call('ZADD', K.due, '0', K.tag)
end
return #ids
