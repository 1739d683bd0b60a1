-- lib.lua: the building blocks of the gate's rules, shared by every operation script.
--
-- redis.py puts this file in front of each operation script at load time (one script per
-- operation, one EVALSHA per call). Every function mirrors its namesake in
-- singleton_tasks/gate.py (or the KeyTransaction method it stands for): change both together.
--
-- Data of one scope+key, all under one hash tag (one Redis Cluster slot):
--   P = <namespace>:{<sha1 hex of the scope and key>}:   (the user's text is never in the tag)
--   P..'meta'              hash   scope, key (the real strings), token, seq, limit
--   P..'waiters'           zset   run ids not holding a slot, scored by seq (registration order)
--   P..'holders'           zset   run ids holding a slot, scored by token
--   P..'ghosts'            zset   pending unconfirmed registrations, scored by created_at
--   P..'run:'..run_id      hash   one run: the fields of gate.RunRecord (see load_run)
--   P..'settled:'..run_id  string '<generation> <expires_at>' of a settled run, with a PEXPIRE
--
-- Per-key scripts share one KEYS layout (use_key):
--   KEYS[1] P..'meta'  KEYS[2] P..'waiters'  KEYS[3] P..'holders'  KEYS[4] P..'ghosts'
--   KEYS[5] P..'run:'..ARGV[3]  KEYS[6] P..'settled:'..ARGV[3]
-- and start their ARGV with  ARGV[1] scope  ARGV[2] key  ARGV[3] run id.
-- Other runs' hashes are named from P inside the scripts: same hash tag, same slot.
--
-- Numbers: times come in as Python repr() strings and are stored as '%.17g', which reads back
-- as the very same double (Lua numbers are doubles, like Python floats); integers as '%d'.

-- luacheck: globals ARGV KEYS redis

local PAGE = 64

local function num(x)
  return string.format('%.17g', x)
end

local function int(x)
  return string.format('%d', x)
end

-- '' stands for None (an optional number).
local function opt_number(s)
  if s == nil or s == false or s == '' then
    return nil
  end
  return tonumber(s)
end

local K = {}

local function use_key()
  K.meta, K.waiters, K.holders, K.ghosts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  K.prefix = string.sub(KEYS[1], 1, -5) -- KEYS[1] is P..'meta'
  K.scope, K.key = ARGV[1], ARGV[2]
end

local function run_key(run_id)
  return K.prefix .. 'run:' .. run_id
end

local function settled_key(run_id)
  return K.prefix .. 'settled:' .. run_id
end

-- KeyMeta ------------------------------------------------------------------------------------

local function load_meta()
  local v = redis.call('HMGET', K.meta, 'token', 'seq', 'limit')
  if not v[1] then
    return nil
  end
  return { token = tonumber(v[1]), seq = tonumber(v[2]), limit = tonumber(v[3]) }
end

local function default_meta()
  return { token = 0, seq = 0, limit = 1 }
end

local function save_meta(meta)
  redis.call('HSET', K.meta, 'scope', K.scope, 'key', K.key, 'token', int(meta.token),
    'seq', int(meta.seq), 'limit', int(meta.limit))
end

-- RunRecord ----------------------------------------------------------------------------------

local function parse_live(s)
  local live = {}
  for g in string.gmatch(s or '', '[^,]+') do
    live[#live + 1] = tonumber(g)
  end
  return live
end

local function format_live(live)
  local out = {}
  for i, g in ipairs(live) do
    out[i] = int(g)
  end
  return table.concat(out, ',')
end

local function contains(list, value)
  for _, v in ipairs(list) do
    if v == value then
      return true
    end
  end
  return false
end

-- sorted({a, b}) of gate.py: the two generations, deduplicated, ascending.
local function sorted_pair(a, b)
  if a == b then
    return { a }
  elseif a < b then
    return { a, b }
  end
  return { b, a }
end

local function load_run(run_id)
  local flat = redis.call('HGETALL', run_key(run_id))
  if #flat == 0 then
    return nil
  end
  local h = {}
  for i = 1, #flat, 2 do
    h[flat[i]] = flat[i + 1]
  end
  return {
    run_id = run_id,
    seq = tonumber(h.seq),
    state = h.state,
    created_at = tonumber(h.created_at),
    confirmed = h.confirmed == '1',
    generation = tonumber(h.generation),
    live = parse_live(h.live),
    payload = h.payload, -- nil: None; a field, even '', is a payload
    token = tonumber(h.token),
    holder_generation = tonumber(h.holder_generation),
    admitted_at = tonumber(h.admitted_at),
    heartbeat_at = tonumber(h.heartbeat_at),
    lease_expires_at = tonumber(h.lease_expires_at),
    executing = h.executing == '1',
    lease = tonumber(h.lease),
    orphan_timeout = opt_number(h.orphan_timeout),
  }
end

-- save_run keeps the indexes in step with the record: holders by token, every other run among
-- the waiters by seq, and pending unconfirmed ones among the ghosts by created_at.
local function save_run(run)
  local key = run_key(run.run_id)
  redis.call('HSET', key,
    'seq', int(run.seq),
    'state', run.state,
    'created_at', num(run.created_at),
    'confirmed', run.confirmed and '1' or '0',
    'generation', int(run.generation),
    'live', format_live(run.live),
    'token', int(run.token),
    'holder_generation', int(run.holder_generation),
    'admitted_at', num(run.admitted_at),
    'heartbeat_at', num(run.heartbeat_at),
    'lease_expires_at', num(run.lease_expires_at),
    'executing', run.executing and '1' or '0',
    'lease', num(run.lease),
    'orphan_timeout', run.orphan_timeout and num(run.orphan_timeout) or '')
  if run.payload then
    redis.call('HSET', key, 'payload', run.payload)
  else
    redis.call('HDEL', key, 'payload')
  end
  if run.state == 'holding' then
    redis.call('ZREM', K.waiters, run.run_id)
    redis.call('ZADD', K.holders, int(run.token), run.run_id)
  else
    redis.call('ZREM', K.holders, run.run_id)
    redis.call('ZADD', K.waiters, int(run.seq), run.run_id)
  end
  if run.state == 'pending' and not run.confirmed then
    redis.call('ZADD', K.ghosts, num(run.created_at), run.run_id)
  else
    redis.call('ZREM', K.ghosts, run.run_id)
  end
end

local function delete_run(run_id)
  redis.call('DEL', run_key(run_id))
  redis.call('ZREM', K.waiters, run_id)
  redis.call('ZREM', K.holders, run_id)
  redis.call('ZREM', K.ghosts, run_id)
end

local function holders()
  local runs = {}
  for i, run_id in ipairs(redis.call('ZRANGE', K.holders, 0, -1)) do
    runs[i] = load_run(run_id)
  end
  return runs
end

local function count_runs()
  return redis.call('ZCARD', K.waiters) + redis.call('ZCARD', K.holders)
end

local function waiters_before(seq)
  return redis.call('ZCOUNT', K.waiters, '-inf', '(' .. int(seq))
end

local function unconfirmed_before(created_before)
  return redis.call('ZRANGEBYSCORE', K.ghosts, '-inf', '(' .. num(created_before))
end

local function count_unconfirmed_before(created_before)
  return redis.call('ZCOUNT', K.ghosts, '-inf', '(' .. num(created_before))
end

-- Settled markers: the expiry is checked against the caller's clock (stores never read one);
-- the PEXPIRE only lets Redis drop the marker on its own.
local function settled_generation(run_id, now)
  local marker = redis.call('GET', settled_key(run_id))
  if not marker then
    return nil
  end
  local generation, expires_at = string.match(marker, '^(%S+) (%S+)$')
  if tonumber(expires_at) > now then
    return tonumber(generation)
  end
  return nil
end

local function mark_settled(run_id, generation, expires_at, ttl)
  redis.call('SET', settled_key(run_id), int(generation) .. ' ' .. num(expires_at),
    'PX', math.max(1, math.ceil(ttl * 1000)))
end

local function clear_settled(run_id)
  redis.call('DEL', settled_key(run_id))
end

-- The rules ----------------------------------------------------------------------------------

local function passed_over(run, now)
  return run.state == 'pending' and run.orphan_timeout ~= nil and run.created_at + run.orphan_timeout < now
end

-- The first `free` waiters in seq order that are not passed over: they own the free slots.
local function slot_owners(free, now)
  local owners = {}
  if free <= 0 then
    return owners
  end
  local start = 0
  while true do
    local ids = redis.call('ZRANGE', K.waiters, start, start + PAGE - 1)
    for _, run_id in ipairs(ids) do
      local run = load_run(run_id)
      if not passed_over(run, now) then
        owners[#owners + 1] = run
        if #owners == free then
          return owners
        end
      end
    end
    if #ids < PAGE then
      return owners
    end
    start = start + PAGE
  end
end

-- Evict orphaned holders and forget ghost registrations; returns the evicted run ids.
local function housekeep(now, grace, keep)
  local evicted = {}
  for _, holder in ipairs(holders()) do
    local timeout = holder.orphan_timeout
    if timeout ~= nil and holder.lease_expires_at + timeout < now and holder.run_id ~= keep then
      delete_run(holder.run_id)
      evicted[#evicted + 1] = holder.run_id
    end
  end
  for _, ghost in ipairs(unconfirmed_before(now - grace)) do
    if ghost ~= keep then
      delete_run(ghost)
    end
  end
  return evicted
end

-- Gated waiters that now own a free slot get a fresh live generation to be published.
-- Each wake is {run_id, generation, payload or false (None)}.
local function wakes(meta, now, skip)
  local free = meta.limit - redis.call('ZCARD', K.holders)
  local out = {}
  for _, run in ipairs(slot_owners(free, now)) do
    if run.state == 'gated' and run.run_id ~= skip then
      run.generation = run.generation + 1
      local live = {}
      if #run.live > 0 then
        live[1] = run.live[#run.live]
      end
      live[#live + 1] = run.generation
      run.live = live
      run.state = 'woken'
      save_run(run)
      out[#out + 1] = { run.run_id, run.generation, run.payload or false }
    end
  end
  return out
end

-- Save the counters; an empty key keeps nothing but its token (the zsets vanish when empty).
local function finish(meta)
  if count_runs() == 0 then
    meta.seq = 0
  end
  save_meta(meta)
end

local function new_waiter(meta, run_id, now, confirmed, generation, lease, orphan_timeout)
  meta.seq = meta.seq + 1
  return {
    run_id = run_id,
    seq = meta.seq,
    state = 'pending',
    created_at = now,
    confirmed = confirmed,
    generation = generation,
    live = { generation },
    payload = nil,
    token = 0,
    holder_generation = 0,
    admitted_at = 0,
    heartbeat_at = 0,
    lease_expires_at = 0,
    executing = false,
    lease = lease,
    orphan_timeout = orphan_timeout,
  }
end

-- End of lib.lua; the operation script follows.
