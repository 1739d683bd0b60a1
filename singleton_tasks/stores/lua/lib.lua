-- lib.lua: the building blocks of the gate's rules, shared by every operation script.
--
-- redis.py loads this file once, in front of the operations, as a function library (Redis 7+:
-- one FCALL per call); without functions it puts it in front of each operation script (one
-- EVALSHA per call). Either way KEYS and ARGV reach lib.lua only as use_key's arguments, and
-- nothing here may keep what one call learned for the next. Every function mirrors its namesake in
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
--
-- Cost: every call runs on the hot path of every singleton run, so records are read with HMGET
-- of the fields a rule needs (never the payload unless a wake publishes it) and written back
-- field by field, only where a value changed; the indexes are touched only when the fields they
-- index changed. Both rely on the invariant that save_run/delete_run are the only writers of a
-- run's hash and indexes (heartbeat.lua only moves lease times, which no index holds).

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

-- The sizes of the holders and waiters zsets, read at most once per call and kept in step by
-- every write to them (ZADD / ZREM answer how many members they added / removed).
local SIZE = {}

-- Every per-key operation starts here. Loaded as a function library, this file's locals live
-- as long as the library, so what one call learned (SIZE) is forgotten here.
local function use_key(keys, argv)
  K.meta, K.waiters, K.holders, K.ghosts = keys[1], keys[2], keys[3], keys[4]
  K.prefix = string.sub(keys[1], 1, -5) -- keys[1] is P..'meta'
  K.scope, K.key = argv[1], argv[2]
  SIZE = {}
end

local function run_key(run_id)
  return K.prefix .. 'run:' .. run_id
end

local function settled_key(run_id)
  return K.prefix .. 'settled:' .. run_id
end

-- Index sizes -------------------------------------------------------------------------------

local function zcard(index)
  local n = SIZE[index]
  if n == nil then
    n = redis.call('ZCARD', index)
    SIZE[index] = n
  end
  return n
end

local function zadd(index, score, member)
  local added = redis.call('ZADD', index, score, member)
  if SIZE[index] ~= nil then
    SIZE[index] = SIZE[index] + added
  end
end

local function zrem(index, member)
  local removed = redis.call('ZREM', index, member)
  if SIZE[index] ~= nil then
    SIZE[index] = SIZE[index] - removed
  end
end

-- KeyMeta ------------------------------------------------------------------------------------

-- meta.saved: the stored values, so save_meta writes only what changed (nil: a new key).
local function load_meta()
  local v = redis.call('HMGET', K.meta, 'token', 'seq', 'limit')
  if not v[1] then
    return nil
  end
  local token, seq, limit = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  return { token = token, seq = seq, limit = limit, saved = { token = token, seq = seq, limit = limit } }
end

local function default_meta()
  return { token = 0, seq = 0, limit = 1 }
end

local function save_meta(meta)
  local old = meta.saved
  if old == nil then
    redis.call('HSET', K.meta, 'scope', K.scope, 'key', K.key, 'token', int(meta.token),
      'seq', int(meta.seq), 'limit', int(meta.limit))
  else
    -- A stored meta hash always holds scope and key: every first write puts them.
    local a = {}
    if meta.token ~= old.token then
      a[#a + 1] = 'token'
      a[#a + 1] = int(meta.token)
    end
    if meta.seq ~= old.seq then
      a[#a + 1] = 'seq'
      a[#a + 1] = int(meta.seq)
    end
    if meta.limit ~= old.limit then
      a[#a + 1] = 'limit'
      a[#a + 1] = int(meta.limit)
    end
    if #a > 0 then
      redis.call('HSET', K.meta, unpack(a))
    end
  end
  meta.saved = { token = meta.token, seq = meta.seq, limit = meta.limit }
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

-- sorted({...}) of gate.py: the given generations, deduplicated, ascending.
local function sorted_generations(...)
  local out = {}
  for _, g in ipairs({ ... }) do
    if not contains(out, g) then
      out[#out + 1] = g
    end
  end
  table.sort(out)
  return out
end

-- run.payload == STORED: whatever the hash holds, not read (see run_payload); nil: None.
local STORED = {}

-- run.saved: the stored values of the fields (live as its text), compared by save_run.
local function remember(run, live_text)
  run.saved = {
    seq = run.seq,
    state = run.state,
    created_at = run.created_at,
    confirmed = run.confirmed,
    generation = run.generation,
    live = live_text,
    token = run.token,
    holder_generation = run.holder_generation,
    admitted_at = run.admitted_at,
    heartbeat_at = run.heartbeat_at,
    lease_expires_at = run.lease_expires_at,
    executing = run.executing,
    lease = run.lease,
    orphan_timeout = run.orphan_timeout,
  }
end

local function load_run(run_id)
  local v = redis.call('HMGET', run_key(run_id), 'seq', 'state', 'created_at', 'confirmed', 'generation',
    'live', 'token', 'holder_generation', 'admitted_at', 'heartbeat_at', 'lease_expires_at', 'executing',
    'lease', 'orphan_timeout')
  if not v[2] then
    return nil -- save_run writes every field: no state, no record
  end
  local run = {
    run_id = run_id,
    seq = tonumber(v[1]),
    state = v[2],
    created_at = tonumber(v[3]),
    confirmed = v[4] == '1',
    generation = tonumber(v[5]),
    live = parse_live(v[6]),
    payload = STORED,
    token = tonumber(v[7]),
    holder_generation = tonumber(v[8]),
    admitted_at = tonumber(v[9]),
    heartbeat_at = tonumber(v[10]),
    lease_expires_at = tonumber(v[11]),
    executing = v[12] == '1',
    lease = tonumber(v[13]),
    orphan_timeout = opt_number(v[14]),
  }
  remember(run, v[6] or '')
  return run
end

-- The fields that settling a run reads: {state, confirmed, token, holder_generation}, or nil.
local function load_brief(run_id)
  local v = redis.call('HMGET', run_key(run_id), 'state', 'confirmed', 'token', 'holder_generation')
  if not v[1] then
    return nil
  end
  return { state = v[1], confirmed = v[2] == '1', token = tonumber(v[3]), holder_generation = tonumber(v[4]) }
end

-- The run's payload (bytes) or nil (None), read from the hash if it was not set in this call.
local function run_payload(run)
  if run.payload == STORED then
    run.payload = redis.call('HGET', run_key(run.run_id), 'payload') or nil
  end
  return run.payload
end

local function put(a, field, text)
  a[#a + 1] = field
  a[#a + 1] = text
end

local function is_ghost(state, confirmed)
  return state == 'pending' and not confirmed
end

-- save_run keeps the indexes in step with the record: holders by token, every other run among
-- the waiters by seq, and pending unconfirmed ones among the ghosts by created_at.
local function save_run(run)
  local key = run_key(run.run_id)
  local old = run.saved -- nil: a new record, in no index yet
  local live = format_live(run.live)
  local orphan = run.orphan_timeout
  local a = {}
  -- Texts are formatted only for the fields that are written.
  if old == nil or run.seq ~= old.seq then put(a, 'seq', int(run.seq)) end
  if old == nil or run.state ~= old.state then put(a, 'state', run.state) end
  if old == nil or run.created_at ~= old.created_at then put(a, 'created_at', num(run.created_at)) end
  if old == nil or run.confirmed ~= old.confirmed then put(a, 'confirmed', run.confirmed and '1' or '0') end
  if old == nil or run.generation ~= old.generation then put(a, 'generation', int(run.generation)) end
  if old == nil or live ~= old.live then put(a, 'live', live) end
  if old == nil or run.token ~= old.token then put(a, 'token', int(run.token)) end
  if old == nil or run.holder_generation ~= old.holder_generation then
    put(a, 'holder_generation', int(run.holder_generation))
  end
  if old == nil or run.admitted_at ~= old.admitted_at then put(a, 'admitted_at', num(run.admitted_at)) end
  if old == nil or run.heartbeat_at ~= old.heartbeat_at then put(a, 'heartbeat_at', num(run.heartbeat_at)) end
  if old == nil or run.lease_expires_at ~= old.lease_expires_at then
    put(a, 'lease_expires_at', num(run.lease_expires_at))
  end
  if old == nil or run.executing ~= old.executing then put(a, 'executing', run.executing and '1' or '0') end
  if old == nil or run.lease ~= old.lease then put(a, 'lease', num(run.lease)) end
  if old == nil or orphan ~= old.orphan_timeout then put(a, 'orphan_timeout', orphan and num(orphan) or '') end
  if run.payload ~= STORED then
    if run.payload then
      put(a, 'payload', run.payload)
    elseif old ~= nil and (old.state == 'gated' or old.state == 'woken') then
      -- Only a delivered, not admitted run keeps a payload (claim stores it, admit drops it).
      redis.call('HDEL', key, 'payload')
    end
  end
  if #a > 0 then
    redis.call('HSET', key, unpack(a))
  end
  if run.state == 'holding' then
    if old == nil or old.state ~= 'holding' then
      if old ~= nil then
        zrem(K.waiters, run.run_id)
      end
      zadd(K.holders, int(run.token), run.run_id)
    elseif run.token ~= old.token then
      zadd(K.holders, int(run.token), run.run_id)
    end
  else
    if old ~= nil and old.state == 'holding' then
      zrem(K.holders, run.run_id)
      zadd(K.waiters, int(run.seq), run.run_id)
    elseif old == nil or run.seq ~= old.seq then
      zadd(K.waiters, int(run.seq), run.run_id)
    end
  end
  local was_ghost = old ~= nil and is_ghost(old.state, old.confirmed)
  if is_ghost(run.state, run.confirmed) then
    if not was_ghost or run.created_at ~= old.created_at then
      redis.call('ZADD', K.ghosts, num(run.created_at), run.run_id)
    end
  elseif was_ghost then
    redis.call('ZREM', K.ghosts, run.run_id)
  end
  remember(run, live)
end

-- stored: the run's stored {state, confirmed} (say which indexes hold it), or nil (all of them).
local function delete_run(run_id, stored)
  redis.call('DEL', run_key(run_id))
  if stored == nil then
    zrem(K.waiters, run_id)
    zrem(K.holders, run_id)
    redis.call('ZREM', K.ghosts, run_id)
  elseif stored.state == 'holding' then
    zrem(K.holders, run_id)
  else
    zrem(K.waiters, run_id)
    if is_ghost(stored.state, stored.confirmed) then
      redis.call('ZREM', K.ghosts, run_id)
    end
  end
end

local function count_runs()
  return zcard(K.waiters) + zcard(K.holders)
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

local function passed_over(state, created_at, orphan_timeout, now)
  return state == 'pending' and orphan_timeout ~= nil and created_at + orphan_timeout < now
end

-- The first `free` waiters in seq order that are not passed over: they own the free slots.
-- Each owner is {run_id, state}. `self` (a run of this call, or nil) is judged from its
-- in-memory record rather than the store, so a claim need not save it before asking.
local function slot_owners(free, now, self)
  local owners = {}
  if free <= 0 then
    return owners
  end
  local start, count = 0, math.min(free, PAGE) -- most often the first `free` ids are the owners
  while true do
    local ids = redis.call('ZRANGE', K.waiters, start, start + count - 1)
    for _, run_id in ipairs(ids) do
      local state, over
      if self ~= nil and run_id == self.run_id then
        state = self.state
        over = passed_over(state, self.created_at, self.orphan_timeout, now)
      else
        local v = redis.call('HMGET', run_key(run_id), 'state', 'created_at', 'orphan_timeout')
        state = v[1]
        over = passed_over(state, tonumber(v[2]), opt_number(v[3]), now)
      end
      if not over then
        owners[#owners + 1] = { run_id, state }
        if #owners == free then
          return owners
        end
      end
    end
    if #ids < count then
      if start == 0 then
        SIZE[K.waiters] = #ids
      end
      return owners
    end
    start = start + count
    count = PAGE
  end
end

-- Evict orphaned holders and forget ghost registrations; returns the evicted run ids.
local function housekeep(now, grace, keep)
  local evicted = {}
  local ids = redis.call('ZRANGE', K.holders, 0, -1)
  SIZE[K.holders] = #ids
  for _, run_id in ipairs(ids) do
    if run_id ~= keep then -- `keep` is never evicted: its lease needs no reading
      local v = redis.call('HMGET', run_key(run_id), 'lease_expires_at', 'orphan_timeout')
      local timeout = opt_number(v[2])
      if timeout ~= nil and tonumber(v[1]) + timeout < now then
        delete_run(run_id, { state = 'holding' })
        evicted[#evicted + 1] = run_id
      end
    end
  end
  for _, ghost in ipairs(unconfirmed_before(now - grace)) do
    if ghost ~= keep then
      delete_run(ghost, { state = 'pending', confirmed = false })
    end
  end
  return evicted
end

-- Gated waiters that now own a free slot get a fresh live generation to be published.
-- Each wake is {run_id, generation, payload or false (None)}.
local function wakes(meta, now, skip)
  local free = meta.limit - zcard(K.holders)
  local out = {}
  for _, owner in ipairs(slot_owners(free, now, nil)) do
    if owner[2] == 'gated' and owner[1] ~= skip then
      local run = load_run(owner[1])
      run.generation = run.generation + 1
      -- A payload-less wake cannot be published: every copy in flight stays live (gate.py).
      local live = run.live
      if run_payload(run) and #live > 0 then
        live = { live[#live] }
      end
      live[#live + 1] = run.generation
      run.live = live
      run.state = 'woken'
      save_run(run)
      out[#out + 1] = { run.run_id, run.generation, run_payload(run) or false }
    end
  end
  return out
end

-- A waiter whose message is known (delivered, or published held back) keeps it to be woken;
-- a pending one becomes gated: it takes its place in line again (SPEC §6). gate._take_place.
local function take_place(run, payload)
  run.confirmed = true
  run.payload = payload
  if run.state == 'pending' then
    run.state = 'gated'
  end
end

-- Save the counters; an empty key keeps nothing but its token (the zsets vanish when empty).
local function finish(meta)
  if zcard(K.holders) == 0 and zcard(K.waiters) == 0 then
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
