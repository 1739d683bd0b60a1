-- tick: what a due key does by itself (gate.tick): evict orphaned holders, drop registrations
-- never published, issue the owners whose copies are lost; a heartbeat thread's call
-- (RedisStore.tick_due) on a key the due index lists.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua, from the key's hash tag: ARGV[1] and
-- ARGV[2] (scope, key) and ARGV[3] (run id) are '', the key's own scope and key are read from
-- its meta hash (tick never creates one).
-- Returns {} if the key is unknown or idle (then no longer listed as due), else
-- {scope, key, wakes, evicted, removed}: wakes a list of {run_id, generation, payload or
-- false}; evicted and removed lists of run ids.

use_key(KEYS, ARGV)
local now = K.now
local meta = load_meta(now)
if meta == nil then
  redis.call('ZREM', K.due, K.tag)
  return {}
end
local names = redis.call('HMGET', K.meta, 'scope', 'key')
K.scope, K.key = names[1], names[2]
housekeep(now, nil)
local woken = hand_on(meta, now, nil)
finish(meta)
return { K.scope, K.key, woken, EVICTED, REMOVED }
