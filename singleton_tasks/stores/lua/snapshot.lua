-- snapshot: one key's records, read-only, for inspection.
--
-- KEYS[1] P..'meta'   KEYS[2] P..'waiters'   KEYS[3] P..'holders'   (see lib.lua)
-- Returns {} if the key has no holders or waiters, else {meta, runs}: meta the flat HGETALL
-- of the meta hash; runs a list of {run_id, flat HGETALL of the run hash, index score}, holders
-- by token then waiters by seq (a phantom's HGETALL is empty; its score is its token or seq).

local prefix = string.sub(KEYS[1], 1, -5)
local entries = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
local holders = #entries / 2
for _, value in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')) do
  entries[#entries + 1] = value
end
if #entries == 0 then
  return {}
end
local runs = {}
for i = 1, #entries, 2 do
  local run_id = entries[i]
  local kind = (i + 1) / 2 <= holders and 'holder' or 'waiter'
  runs[#runs + 1] = { run_id, redis.call('HGETALL', prefix .. 'run:' .. run_id), kind, entries[i + 1] }
end
return { redis.call('HGETALL', KEYS[1]), runs }
