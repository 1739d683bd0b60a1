-- snapshot: one key's records, read-only, for inspection.
--
-- KEYS[1] P..'meta'   KEYS[2] P..'waiters'   KEYS[3] P..'holders'   (see lib.lua)
-- Returns {} if the key has no holders or waiters, else {meta, runs}: meta the flat HGETALL
-- of the meta hash; runs a list of {run_id, fields, index score, payload size}, holders by token
-- then waiters by seq. fields is the flat name/value list of the run's FIELDS (lib.lua) that
-- the hash holds, empty for a phantom (its score is its token or seq). The payload is never
-- read, only measured: its size in bytes, -1 when the run has none.

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
  local hash = prefix .. 'run:' .. run_id
  local values = redis.call('HMGET', hash, unpack(FIELDS))
  local fields = {}
  if values[2] then -- save_run writes every field: no state, no record (a phantom)
    for j, name in ipairs(FIELDS) do
      if values[j] then
        fields[#fields + 1] = name
        fields[#fields + 1] = values[j]
      end
    end
  end
  local payload_size = -1
  if redis.call('HEXISTS', hash, 'payload') == 1 then
    payload_size = redis.call('HSTRLEN', hash, 'payload')
  end
  runs[#runs + 1] = { run_id, fields, kind, entries[i + 1], payload_size }
end
return { redis.call('HGETALL', KEYS[1]), runs }
