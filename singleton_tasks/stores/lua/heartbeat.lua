-- heartbeat: extend the leases of running holders, many keys in one call (gate.heartbeat).
--
-- KEYS[i] the run hash of holder i (P..'run:'..run_id, see lib.lua); on Redis Cluster all in
-- one hash slot (the store calls once per slot).
-- ARGV[1] the time to decide at, '' for the server's clock   ARGV[1 + i] holder i's token
-- Returns {alive, now}: alive a list, 1 where holder i still holds its slot (lease extended),
-- 0 where it lost it; now the time the leases were extended from ('%.17g').

local now = opt_number(ARGV[1]) or server_time()
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
return { alive, num(now) }
