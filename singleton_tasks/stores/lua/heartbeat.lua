-- heartbeat: extend the leases of running holders, many keys in one call (gate.heartbeat).
--
-- KEYS[i] the run hash of holder i (P..'run:'..run_id, see lib.lua)
-- ARGV[1] now     ARGV[1 + i] the token holder i was admitted with
-- Returns a list: 1 where holder i still holds its slot (lease extended), 0 where it lost it.
-- (Holders of several keys span several hash slots: on Redis Cluster, call once per slot.)

local now = tonumber(ARGV[1])
local alive = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'state', 'token', 'lease')
  if v[1] == 'holding' and tonumber(v[2]) == tonumber(ARGV[1 + i]) then
    redis.call('HSET', key, 'heartbeat_at', num(now), 'lease_expires_at', num(now + tonumber(v[3])))
    alive[i] = 1
  else
    alive[i] = 0
  end
end
return alive
