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
--   P..'meta'              hash   scope, key (the real strings), token, seq, limit, idle_until (set
--                                 while the key has no runs: then it expires after `retention`)
--   P..'waiters'           zset   run ids not holding a slot, scored by seq (registration order)
--   P..'holders'           zset   run ids holding a slot, scored by token
--   P..'overdue'           zset   waiters that can be passed over, scored by passed_over_at
--   P..'run:'..run_id      hash   one run: the fields of gate.RunRecord (see load_run)
--   P..'settled:'..run_id  string '<generation> <expires_at>' of a settled run, expiring with it
-- and, outside P, the namespace's index of busy keys (a key is busy while it has holders or
-- waiters: its holders or waiters zset exists):
--   I                      set    the hash tags ('{<sha1 hex>}') of the busy keys; redis.py names
--                                 it (RedisStore._index_key): one per namespace on one server,
--                                 one per hash slot on Redis Cluster (in the slot of the keys it
--                                 lists, so a script updates it atomically with their state)
--
-- Per-key scripts share one KEYS layout (use_key):
--   KEYS[1] P..'meta'  KEYS[2] P..'waiters'  KEYS[3] P..'holders'  KEYS[4] P..'overdue'
--   KEYS[5] P..'run:'..ARGV[3]  KEYS[6] P..'settled:'..ARGV[3]  KEYS[7] I
-- and one ARGV start:
--   ARGV[1] scope  ARGV[2] key  ARGV[3] run id
--   ARGV[4] the time to decide at, '' for the server's clock (TIME; only tests pass a time)
--   ARGV[5] registration_grace  ARGV[6] retention   (seconds)
-- Other runs' hashes are named from P inside the scripts: same hash tag, same slot.
--
-- Numbers: times come in as Python repr() strings and are stored as '%.17g', which reads back
-- as the very same double (Lua numbers are doubles, like Python floats); integers as '%d'.
-- Tokens and generations are clock microseconds (about 1.8e15): exact in a double below 2^53.
--
-- Cost: every call runs on the hot path of every singleton run, so records are read with HMGET
-- of the fields a rule needs (never the payload unless a wake publishes it) and written back
-- field by field, only where a value changed; the indexes are touched only when the fields they
-- index changed. Both rely on the invariant that save_run/delete_run are the only writers of a
-- run's hash and indexes (heartbeat.lua only moves lease times, which no index holds).
--
-- A "phantom" is an index entry whose run hash is gone (data lost by the server, e.g. evicted):
-- a phantom holder is evicted and a phantom waiter removed as soon as a call meets it.

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

local function server_time()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- gate.micros / gate._next / gate.issued_before
local function micros(t)
  return math.floor(t * 1000000)
end

local function next_counter(counter, now)
  return math.max(counter + 1, micros(now))
end

local function issued_before(generation, moment)
  return generation ~= 0 and generation < micros(moment)
end

-- gate.issued_in_a_lost_write: a copy the store issued in a write it has lost (a failover).
local function issued_in_a_lost_write(run, generation)
  return generation > run.generation and generation >= micros(run.created_at)
end

local K = {}

-- The sizes of the holders and waiters zsets, read at most once per call and kept in step by
-- every write to them (ZADD / ZREM answer how many members they added / removed).
local SIZE = {}

-- Run ids this call evicted (holders) and removed (waiters long gone, phantoms).
local EVICTED, REMOVED = {}, {}

-- Every per-key operation starts here. Loaded as a function library, this file's locals live
-- as long as the library, so what one call learned (SIZE, EVICTED, REMOVED) is forgotten here.
local function use_key(keys, argv)
  K.meta, K.waiters, K.holders, K.overdue = keys[1], keys[2], keys[3], keys[4]
  K.prefix = string.sub(keys[1], 1, -5) -- keys[1] is P..'meta'
  K.index, K.tag = keys[7], string.sub(keys[1], -47, -6) -- P ends with '{<40 hex>}:'
  K.scope, K.key = argv[1], argv[2]
  K.now = opt_number(argv[4]) or server_time()
  K.grace, K.retention = tonumber(argv[5]), tonumber(argv[6])
  SIZE, EVICTED, REMOVED = {}, {}, {}
end

local function run_key(run_id)
  return K.prefix .. 'run:' .. run_id
end

local function settled_key(run_id)
  return K.prefix .. 'settled:' .. run_id
end

local function ms(seconds)
  return math.max(1, math.ceil(seconds * 1000))
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
  return removed
end

-- KeyMeta ------------------------------------------------------------------------------------

-- meta.saved: the stored values, so save_meta writes only what changed (nil: a new key).
-- gate._meta: a key idle past its idle_until is forgotten, whether Redis expired it yet or not.
local function load_meta(now)
  local v = redis.call('HMGET', K.meta, 'token', 'seq', 'limit', 'idle_until')
  local idle_until = opt_number(v[4])
  if not v[1] or (idle_until ~= nil and idle_until < now) then
    return nil
  end
  local token, seq, limit = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  return {
    token = token,
    seq = seq,
    limit = limit,
    idle_until = idle_until,
    saved = { token = token, seq = seq, limit = limit, idle_until = idle_until },
  }
end

local function default_meta()
  return { token = 0, seq = 0, limit = 1 }
end

-- With meta.idle_until set the key has no runs: Redis deletes the hash `retention` from now.
local function save_meta(meta)
  local old = meta.saved or {}
  local a = {}
  if meta.saved == nil then
    -- A stored meta hash always holds scope and key: every first write puts them.
    a = { 'scope', K.scope, 'key', K.key }
  end
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
  if meta.idle_until ~= old.idle_until or meta.saved == nil then
    a[#a + 1] = 'idle_until'
    a[#a + 1] = meta.idle_until and num(meta.idle_until) or ''
  end
  if #a > 0 then
    redis.call('HSET', K.meta, unpack(a))
  end
  if meta.idle_until ~= nil then
    redis.call('PEXPIRE', K.meta, ms(K.retention))
  elseif meta.saved == nil or old.idle_until ~= nil then
    redis.call('PERSIST', K.meta) -- a forgotten key's hash may still be there, expiring
  end
  meta.saved = { token = meta.token, seq = meta.seq, limit = meta.limit, idle_until = meta.idle_until }
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

local FIELDS = { 'seq', 'state', 'created_at', 'confirmed', 'generation', 'live', 'token', 'holder_generation',
  'admitted_at', 'heartbeat_at', 'lease_expires_at', 'executing', 'lease', 'orphan_timeout', 'recheck', 'seen_at',
  'passed_over_at' }

-- run.saved: the stored values of the fields (live as its text), compared by save_run.
local function remember(run, live_text)
  local saved = {}
  for _, f in ipairs(FIELDS) do
    saved[f] = run[f]
  end
  saved.live = live_text
  run.saved = saved
end

local function load_run(run_id)
  local v = redis.call('HMGET', run_key(run_id), unpack(FIELDS))
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
    recheck = tonumber(v[15]),
    seen_at = tonumber(v[16]),
    passed_over_at = opt_number(v[17]),
  }
  remember(run, v[6] or '')
  return run
end

-- The fields that settling a run reads: {state, token, holder_generation, passed_over_at}, or nil.
local function load_brief(run_id)
  local v = redis.call('HMGET', run_key(run_id), 'state', 'token', 'holder_generation', 'passed_over_at')
  if not v[1] then
    return nil
  end
  return { state = v[1], token = tonumber(v[2]), holder_generation = tonumber(v[3]), passed_over_at = opt_number(v[4]) }
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

local function text_of(field, value)
  if field == 'confirmed' or field == 'executing' then
    return value and '1' or '0'
  elseif field == 'state' then
    return value
  elseif field == 'seq' or field == 'generation' or field == 'token' or field == 'holder_generation' then
    return int(value)
  elseif value == nil then
    return '' -- orphan_timeout, passed_over_at: None
  end
  return num(value)
end

-- The passed_over_at a waiter is indexed by in 'overdue' (holders are in no such index).
local function overdue_score(state, passed_over_at)
  if state == 'holding' then
    return nil
  end
  return passed_over_at
end

-- save_run keeps the indexes in step with the record: holders by token, every other run among
-- the waiters by seq, and waiters with a passed_over_at among the overdue by it.
local function save_run(run)
  local key = run_key(run.run_id)
  local old = run.saved -- nil: a new record, in no index yet
  local live = format_live(run.live)
  local a = {}
  -- Texts are formatted only for the fields that are written.
  for _, f in ipairs(FIELDS) do
    if f == 'live' then
      if old == nil or live ~= old.live then put(a, 'live', live) end
    elseif old == nil or run[f] ~= old[f] then
      put(a, f, text_of(f, run[f]))
    end
  end
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
  local score = overdue_score(run.state, run.passed_over_at)
  local old_score = old and overdue_score(old.state, old.passed_over_at)
  if score ~= old_score then
    if score ~= nil then
      redis.call('ZADD', K.overdue, num(score), run.run_id)
    else
      redis.call('ZREM', K.overdue, run.run_id)
    end
  end
  remember(run, live)
end

-- stored: the run's stored {state} (says which indexes hold it), or nil (all of them).
local function delete_run(run_id, stored)
  redis.call('DEL', run_key(run_id))
  if stored == nil or stored.state ~= 'holding' then
    zrem(K.waiters, run_id)
    redis.call('ZREM', K.overdue, run_id)
  end
  if stored == nil or stored.state == 'holding' then
    zrem(K.holders, run_id)
  end
end

local function count_runs()
  return zcard(K.waiters) + zcard(K.holders)
end

local function waiters_before(seq)
  return redis.call('ZCOUNT', K.waiters, '-inf', '(' .. int(seq))
end

local function count_passed_over(now)
  return redis.call('ZCOUNT', K.overdue, '-inf', '(' .. num(now))
end

local function passed_over_before(before)
  return redis.call('ZRANGEBYSCORE', K.overdue, '-inf', '(' .. num(before))
end

-- Settled markers: the expiry is checked against the store's clock; the PEXPIRE lets Redis
-- drop the marker on its own.
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

local function mark_settled(run_id, generation, expires_at)
  redis.call('SET', settled_key(run_id), int(generation) .. ' ' .. num(expires_at), 'PX', ms(K.retention))
end

local function clear_settled(run_id)
  redis.call('DEL', settled_key(run_id))
end

-- The rules ----------------------------------------------------------------------------------

local function passed_over(passed_over_at, now)
  return passed_over_at ~= nil and passed_over_at < now
end

-- gate._seen: a live copy of the run (or its registration) reached the store.
local function seen(run, now)
  run.seen_at = now
  if not run.confirmed then
    run.passed_over_at = now + K.grace
  elseif run.orphan_timeout == nil then
    run.passed_over_at = nil
  else
    run.passed_over_at = now + run.orphan_timeout + run.recheck
  end
end

-- The first `free` waiters in seq order that are not passed over: they own the free slots.
-- Each owner is {run_id, state}. `self` (a run of this call, or nil) is judged from its
-- in-memory record rather than the store, so a claim need not save it before asking.
-- A phantom met on the way is removed.
local function slot_owners(free, now, self)
  local owners = {}
  if free <= 0 then
    return owners
  end
  local start, count = 0, math.min(free, PAGE) -- most often the first `free` ids are the owners
  while true do
    local ids = redis.call('ZRANGE', K.waiters, start, start + count - 1)
    local phantoms = 0
    for _, run_id in ipairs(ids) do
      local state, over
      if self ~= nil and run_id == self.run_id then
        state = self.state
        over = passed_over(self.passed_over_at, now)
      else
        local v = redis.call('HMGET', run_key(run_id), 'state', 'passed_over_at')
        state = v[1]
        over = passed_over(opt_number(v[2]), now)
      end
      if not state then
        delete_run(run_id, nil)
        REMOVED[#REMOVED + 1] = run_id
        phantoms = phantoms + 1
      elseif not over then
        owners[#owners + 1] = { run_id, state }
        if #owners == free then
          return owners
        end
      end
    end
    if #ids < count then
      if start == 0 then
        SIZE[K.waiters] = #ids - phantoms
      end
      return owners
    end
    start = start + count - phantoms
    count = PAGE
  end
end

-- Evict orphaned holders and remove waiters long gone; `keep` (the caller's run) stays.
local function housekeep(now, keep)
  local ids = redis.call('ZRANGE', K.holders, 0, -1)
  SIZE[K.holders] = #ids
  for _, run_id in ipairs(ids) do
    if run_id ~= keep then -- `keep` is never evicted: its lease needs no reading
      local v = redis.call('HMGET', run_key(run_id), 'lease_expires_at', 'orphan_timeout')
      local timeout = opt_number(v[2])
      if not v[1] or (timeout ~= nil and tonumber(v[1]) + timeout < now) then
        delete_run(run_id, { state = 'holding' })
        EVICTED[#EVICTED + 1] = run_id
      end
    end
  end
  for _, run_id in ipairs(passed_over_before(now - K.retention)) do
    if run_id ~= keep then
      delete_run(run_id, { state = 'waiting' })
      REMOVED[#REMOVED + 1] = run_id
    end
  end
end

-- Gated waiters that now own a free slot get a fresh live generation to be published.
-- Each wake is {run_id, generation, payload or false (None)}.
local function wakes(meta, now, skip)
  local free = meta.limit - zcard(K.holders)
  local out = {}
  for _, owner in ipairs(slot_owners(free, now, nil)) do
    if owner[2] == 'gated' and owner[1] ~= skip then
      local run = load_run(owner[1])
      run.generation = next_counter(run.generation, now)
      -- Every copy in flight stays live beside the wake (gate._wakes).
      local live = run.live
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
-- a pending one becomes gated: it takes its place in line again (docs/concepts.md#passed-over-waiters). gate._take_place.
local function take_place(run, payload)
  run.confirmed = true
  run.payload = payload
  if run.state == 'pending' then
    run.state = 'gated'
  end
end

-- Save the counters; an empty key is forgotten after `retention` (the zsets vanish when empty).
-- Every script that adds or removes a run ends here (confirm, suspend and heartbeat only change
-- runs already in line; park may remove a phantom, but its own pending run stays), so the busy
-- index is kept exact here: the key is in it exactly while it has runs (SADD/SREM are
-- idempotent; an empty index set vanishes with its last member). A new script that adds or
-- removes runs must end with finish too.
local function finish(meta)
  if zcard(K.holders) == 0 and zcard(K.waiters) == 0 then
    meta.seq = 0
    meta.idle_until = K.now + K.retention
    redis.call('SREM', K.index, K.tag)
  else
    meta.idle_until = nil
    redis.call('SADD', K.index, K.tag)
  end
  save_meta(meta)
end

local function new_waiter(meta, run_id, now, confirmed, generation, lease, orphan_timeout, recheck)
  meta.seq = meta.seq + 1
  local run = {
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
    recheck = recheck,
  }
  seen(run, now)
  return run
end

-- End of lib.lua; the operation script follows.
