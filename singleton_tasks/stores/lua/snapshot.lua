-- snapshot: one key's records, read-only, for inspection.
--
-- KEYS[1] P..'meta'   KEYS[2] P..'waiters'   KEYS[3] P..'holders'   (see lib.lua)
-- Returns {} if the key has no holders or waiters, else {meta, runs}: meta the flat HGETALL
-- of the meta hash; runs a list of {run_id, flat HGETALL of the run hash}, holders by token
-- then waiters by seq.

local prefix = string.sub(KEYS[1], 1, -5)
local ids = redis.call('ZRANGE', KEYS[3], 0, -1)
for _, run_id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  ids[#ids + 1] = run_id
end
if #ids == 0 then
  return {}
end
local runs = {}
for i, run_id in ipairs(ids) do
  runs[i] = { run_id, redis.call('HGETALL', prefix .. 'run:' .. run_id) }
end
return { redis.call('HGETALL', KEYS[1]), runs }
