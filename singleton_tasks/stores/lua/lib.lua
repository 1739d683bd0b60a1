-- lib.lua: the building blocks of the gate's rules, shared by every operation script.
--
-- redis.py loads this file once, in front of the operations, as a function library (Redis 7+:
-- one FCALL per call); without functions it puts it in front of each operation script (one
-- EVALSHA per call). Either way KEYS and ARGV reach lib.lua only as use_key's arguments, and
-- nothing here may keep what one call learned for the next. Every function mirrors its namesake in
-- singleton_tasks/gate.py or generations.py (or the KeyTransaction method of records.py it stands
-- for): change both together.
--
-- Data of one scope+key, all under one hash tag (one Redis Cluster slot):
--   P = <namespace>:{<sha1 hex of the scope and key>}:   (the user's text is never in the tag)
--   P..'meta'              hash   scope, key (the real strings), token, seq, limit, idle_until (set
--                                 while the key has no runs: then it expires after `retention`),
--                                 due_at (records.KeyMeta.due_at; absent or '' for None)
--   P..'waiters'           zset   run ids not holding a slot, scored by seq (registration order)
--   P..'holders'           zset   run ids holding a slot, scored by token
--   P..'unconfirmed'       zset   unconfirmed run ids not holding a slot, scored by created_at
--   P..'run:'..run_id      hash   one run: the fields of records.RunRecord (see load_run)
--   P..'settled:'..run_id  string '<generation> <expires_at>' of a settled run, expiring with it
-- and, outside P, the namespace's index of busy keys (a key is busy while it has holders or
-- waiters: its holders or waiters zset exists) and its index of due keys:
--   I                      set    the hash tags ('{<sha1 hex>}') of the busy keys; redis.py names
--                                 it (RedisStore._index_key): one per namespace on one server,
--                                 one per hash slot on Redis Cluster (in the slot of the keys it
--                                 lists, so a script updates it atomically with their state)
--   D                      zset   the hash tags of the keys with a due_at, scored by it
--                                 (RedisStore._due_index_key): one per namespace or hash slot, as I
--
-- Per-key scripts share one KEYS layout (use_key):
--   KEYS[1] P..'meta'  KEYS[2] P..'waiters'  KEYS[3] P..'holders'  KEYS[4] P..'unconfirmed'
--   KEYS[5] P..'run:'..ARGV[3]  KEYS[6] P..'settled:'..ARGV[3]  KEYS[7] I  KEYS[8] D
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

-- generations.micros / generations.next_counter / generations.issued_before
local function micros(t)
  return math.floor(t * 1000000)
end

local function next_counter(counter, now)
  return math.max(counter + 1, micros(now))
end

local function issued_before(generation, moment)
  return generation ~= 0 and generation < micros(moment)
end

-- generations.issued_in_a_lost_write: a copy the store issued in a write it has lost (a failover).
local function issued_in_a_lost_write(run, generation)
  return generation > run.generation and generation >= micros(run.created_at)
end

local K = {}

-- The sizes of the holders and waiters zsets, read at most once per call and kept in step by
-- every write to them (ZADD / ZREM answer how many members they added / removed).
local SIZE = {}

-- Run ids this call evicted (holders) and removed (abandoned waiters, phantoms).
local EVICTED, REMOVED = {}, {}

-- {lease_expires_at, orphan_timeout} of the holders this call read or wrote, by run id: a
-- holder's eviction time (hand_on's due_at) is read at most once per call.
local LEASES = {}

-- Every per-key operation starts here. Loaded as a function library, this file's locals live
-- as long as the library, so what one call learned (SIZE, EVICTED, REMOVED, LEASES) is forgotten here.
local function use_key(keys, argv)
  K.meta, K.waiters, K.holders, K.unconfirmed = keys[1], keys[2], keys[3], keys[4]
  K.prefix = string.sub(keys[1], 1, -5) -- keys[1] is P..'meta'
  K.index, K.tag = keys[7], string.sub(keys[1], -47, -6) -- P ends with '{<40 hex>}:'
  K.due = keys[8]
  K.scope, K.key = argv[1], argv[2]
  K.now = opt_number(argv[4]) or server_time()
  K.grace, K.retention = tonumber(argv[5]), tonumber(argv[6])
  SIZE, EVICTED, REMOVED, LEASES = {}, {}, {}, {}
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
-- gate._meta: a key idle past its idle_until is forgotten, whether Redis expired it yet or not;
-- now == nil: the record as stored, idle or not (KeyTransaction.meta).
local function load_meta(now)
  local v = redis.call('HMGET', K.meta, 'token', 'seq', 'limit', 'idle_until', 'due_at')
  local idle_until = opt_number(v[4])
  if not v[1] or (now ~= nil and idle_until ~= nil and idle_until < now) then
    return nil
  end
  local token, seq, limit, due_at = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), opt_number(v[5])
  return {
    token = token,
    seq = seq,
    limit = limit,
    idle_until = idle_until,
    due_at = due_at,
    saved = { token = token, seq = seq, limit = limit, idle_until = idle_until, due_at = due_at },
  }
end

local function default_meta()
  return { token = 0, seq = 0, limit = 1 }
end

-- With meta.idle_until set the key has no runs: Redis deletes the hash `retention` from now.
-- The due index lists the key by meta.due_at exactly while it has one (tick_due finds it there).
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
  if meta.due_at ~= old.due_at then -- a new key's hash holds no due_at: None needs no write
    a[#a + 1] = 'due_at'
    a[#a + 1] = meta.due_at and num(meta.due_at) or ''
    if meta.due_at ~= nil then
      redis.call('ZADD', K.due, num(meta.due_at), K.tag)
    else
      redis.call('ZREM', K.due, K.tag)
    end
  end
  if #a > 0 then
    redis.call('HSET', K.meta, unpack(a))
  end
  if meta.idle_until ~= nil then
    redis.call('PEXPIRE', K.meta, ms(K.retention))
  elseif meta.saved == nil or old.idle_until ~= nil then
    redis.call('PERSIST', K.meta) -- a forgotten key's hash may still be there, expiring
  end
  meta.saved = {
    token = meta.token, seq = meta.seq, limit = meta.limit, idle_until = meta.idle_until,
    due_at = meta.due_at,
  }
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

-- run.payload == STORED: whatever the hash holds, not read (see has_payload); nil: None.
local STORED = {}

local FIELDS = { 'seq', 'state', 'created_at', 'confirmed', 'generation', 'live', 'token', 'holder_generation',
  'admitted_at', 'heartbeat_at', 'lease_expires_at', 'executing', 'lease', 'orphan_timeout', 'recheck', 'seen_at',
  'reissue_at' }

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
    reissue_at = opt_number(v[17]),
  }
  remember(run, v[6] or '')
  return run
end

-- The fields that settling a run reads: {state, token, holder_generation, confirmed}, or nil.
local function load_brief(run_id)
  local v = redis.call('HMGET', run_key(run_id), 'state', 'token', 'holder_generation', 'confirmed')
  if not v[1] then
    return nil
  end
  return { state = v[1], token = tonumber(v[2]), holder_generation = tonumber(v[3]), confirmed = v[4] == '1' }
end

-- run.payload is not None, without reading a stored payload (HEXISTS).
local function has_payload(run)
  if run.payload == STORED then
    return redis.call('HEXISTS', run_key(run.run_id), 'payload') == 1
  end
  return run.payload ~= nil
end

-- gate._own_due: when a confirmed waiter that owns a slot has work of its own: its re-issue,
-- or (no payload to be issued from) its abandonment; nil for an unconfirmed one.
local function own_due(run)
  if not run.confirmed or run.reissue_at == nil then
    return nil
  end
  if has_payload(run) then
    return run.reissue_at
  end
  return math.max(run.reissue_at, run.seen_at + K.retention)
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
    return '' -- orphan_timeout, reissue_at: None
  end
  return num(value)
end

-- The created_at a run is indexed by in 'unconfirmed': a waiter not confirmed yet (a holder
-- always is).
local function unconfirmed_score(state, confirmed, created_at)
  if state == 'holding' or confirmed then
    return nil
  end
  return created_at
end

-- save_run keeps the indexes in step with the record: holders by token, every other run among
-- the waiters by seq, and unconfirmed waiters among the unconfirmed by created_at.
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
    elseif old ~= nil and old.state ~= 'holding' then
      -- Only a waiter keeps a payload (register and claim store it, admit drops it).
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
  local score = unconfirmed_score(run.state, run.confirmed, run.created_at)
  local old_score = old and unconfirmed_score(old.state, old.confirmed, old.created_at)
  if score ~= old_score then
    if score ~= nil then
      redis.call('ZADD', K.unconfirmed, num(score), run.run_id)
    else
      redis.call('ZREM', K.unconfirmed, run.run_id)
    end
  end
  if run.state == 'holding' then
    LEASES[run.run_id] = { run.lease_expires_at, run.orphan_timeout }
  end
  remember(run, live)
end

-- stored: the run's stored {state, confirmed} (says which indexes hold it), or nil (all of them).
local function delete_run(run_id, stored)
  redis.call('DEL', run_key(run_id))
  if stored == nil or stored.state ~= 'holding' then
    zrem(K.waiters, run_id)
    if stored == nil or not stored.confirmed then
      redis.call('ZREM', K.unconfirmed, run_id)
    end
  end
  if stored == nil or stored.state == 'holding' then
    zrem(K.holders, run_id)
  end
end

local function count_runs()
  return zcard(K.waiters) + zcard(K.holders)
end

-- The waiter registered last: the highest seq not holding a slot, or nil. A phantom met on the
-- way is removed.
local function newest_waiter()
  while true do
    local ids = redis.call('ZREVRANGE', K.waiters, 0, 0)
    if #ids == 0 then
      return nil
    end
    local run = load_run(ids[1])
    if run ~= nil then
      return run
    end
    delete_run(ids[1], nil)
  end
end

local function waiters_before(seq)
  return redis.call('ZCOUNT', K.waiters, '-inf', '(' .. int(seq))
end

local function unconfirmed_before(before)
  return redis.call('ZRANGEBYSCORE', K.unconfirmed, '-inf', '(' .. num(before))
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

-- generations.NO_COPY_GENERATION: the settled generation of a run replaced in line or of a
-- waiter settled without a generation; no copy carries it, so every copy of the run is stale.
local NO_COPY_GENERATION = -2

local function mark_settled(run_id, generation, expires_at)
  redis.call('SET', settled_key(run_id), int(generation) .. ' ' .. num(expires_at), 'PX', ms(K.retention))
end

local function clear_settled(run_id)
  redis.call('DEL', settled_key(run_id))
end

-- The rules ----------------------------------------------------------------------------------

-- gate._earliest: the earlier of two optional times.
local function earliest(a, b)
  if a == nil then
    return b
  elseif b == nil then
    return a
  end
  return math.min(a, b)
end

-- gate._reissue_at: when the run, owning a slot with no copy of it seen meanwhile, is issued again.
local function reissue_time(run, now, delay)
  if run.orphan_timeout == nil then
    return nil
  end
  return now + delay + run.orphan_timeout + run.recheck
end

-- gate._seen: a live copy of the run (or its registration) reached the store: it is not lost.
-- A run sent with a delay is not expected before its delay is up.
local function seen(run, now, delay)
  run.seen_at = now
  run.reissue_at = reissue_time(run, now, delay or 0)
end

-- gate._issue: give a waiter a fresh live generation, to be published from its payload (given:
-- the caller read it; false: None). Every copy in flight stays live beside it (gate.py says why).
-- Returns the wake {run_id, generation, payload or false}.
local function issue(run, now, payload)
  run.generation = next_counter(run.generation, now)
  local live = run.live
  live[#live + 1] = run.generation
  run.live = live
  run.state = 'woken'
  run.reissue_at = reissue_time(run, now, 0) -- the issued copy is expected by then
  return { run.run_id, run.generation, payload }
end

-- gate._lower_due: make the key due by `when` at the latest (a hint: tick recomputes it).
local function lower_due(meta, when)
  if meta == nil or when == nil or (meta.due_at ~= nil and meta.due_at <= when) then
    return
  end
  meta.due_at = when
  save_meta(meta)
end

-- Evict orphaned holders and drop registrations never published; `keep` (the caller's run)
-- stays. A phantom holder is evicted too. gate._housekeep.
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
      else
        LEASES[run_id] = { tonumber(v[1]), timeout }
      end
    end
  end
  for _, run_id in ipairs(unconfirmed_before(now - K.grace)) do
    if run_id ~= keep then
      delete_run(run_id, { state = 'pending', confirmed = false })
    end
  end
end

-- gate._eviction_due: the earliest time one of the key's holders can be evicted (nil: none can).
local function eviction_due()
  local due = nil
  for _, run_id in ipairs(redis.call('ZRANGE', K.holders, 0, -1)) do
    local lease = LEASES[run_id]
    if lease == nil then
      local v = redis.call('HMGET', run_key(run_id), 'lease_expires_at', 'orphan_timeout')
      lease = { tonumber(v[1]), opt_number(v[2]) }
    end
    if lease[1] ~= nil and lease[2] ~= nil then
      due = earliest(due, lease[1] + lease[2])
    end
  end
  return due
end

-- gate._hand_on: issue the waiters that own a free slot and need a copy; set meta.due_at.
-- The first `limit - holders` waiters in line own the free slots. A confirmed gated owner is
-- woken (its turn came). A confirmed owner with a payload none of whose copies reached the store
-- by its reissue_at is issued again, or abandoned (removed) when nothing reached the store for
-- `retention`. Unconfirmed owners hold their place until their grace ends. Each owner is read
-- by HMGET of the fields the rule needs; its payload (HEXISTS otherwise) and its whole record
-- only when it is issued; a phantom met on the way is removed.
-- Returns the wakes, each {run_id, generation, payload or false (None)}.
local function hand_on(meta, now, skip)
  local free = meta.limit - zcard(K.holders)
  local out = {}
  local due = nil
  if free > 0 then
    local owners = 0
    local start, count = 0, math.min(free, PAGE) -- most often the first `free` ids are the owners
    while owners < free do
      local ids = redis.call('ZRANGE', K.waiters, start, start + count - 1)
      local gone = 0 -- left the line on this page (phantoms, abandoned waiters)
      for _, run_id in ipairs(ids) do
        local key = run_key(run_id)
        local v = redis.call('HMGET', key, 'state', 'confirmed', 'created_at', 'reissue_at', 'seen_at')
        local state, confirmed, reissue_at = v[1], v[2] == '1', opt_number(v[4])
        local moves_up = false -- the run leaves the line: the next waiter moves up into its slot
        if not state then
          delete_run(run_id, nil) -- a phantom
          REMOVED[#REMOVED + 1] = run_id
          moves_up = true
        else
          local payload = false -- read only to be issued: its presence alone otherwise
          local with_payload = false
          if confirmed then
            if run_id ~= skip and (state == 'gated' or (reissue_at ~= nil and reissue_at <= now)) then
              payload = redis.call('HGET', key, 'payload')
              with_payload = payload ~= false
            else
              with_payload = redis.call('HEXISTS', key, 'payload') == 1
            end
          end
          if run_id ~= skip and confirmed then
            -- A gated owner is woken even without a payload (Celery arguments JSON cannot
            -- carry): the wake is not published, its deferred copy re-checks it.
            local issuing = state == 'gated'
            if not issuing and reissue_at ~= nil and reissue_at <= now then
              -- Abandoned once issued at least once, or when it cannot be issued (no payload).
              if now - tonumber(v[5]) > K.retention and (state == 'woken' or not with_payload) then
                delete_run(run_id, { state = state, confirmed = true })
                REMOVED[#REMOVED + 1] = run_id
                moves_up = true
              elseif with_payload then
                issuing = true
              end
            end
            if issuing then
              local run = load_run(run_id)
              out[#out + 1] = issue(run, now, payload)
              save_run(run)
              reissue_at = run.reissue_at
            end
          end
          if not moves_up then
            if not confirmed then
              due = earliest(due, tonumber(v[3]) + K.grace)
            elseif with_payload then -- own_due, from the fields read here
              due = earliest(due, reissue_at)
            elseif reissue_at ~= nil then -- only its abandonment is to come
              due = earliest(due, math.max(reissue_at, tonumber(v[5]) + K.retention))
            end
            owners = owners + 1
            if owners == free then
              break
            end
          end
        end
        if moves_up then
          gone = gone + 1
        end
      end
      if owners < free then
        if #ids < count then
          if start == 0 then
            SIZE[K.waiters] = #ids - gone
          end
          break
        end
        start = start + count - gone
        count = PAGE
      end
    end
  end
  if zcard(K.waiters) > 0 and zcard(K.holders) > 0 then -- a holder's eviction would hand its slot on
    due = earliest(due, eviction_due())
  end
  meta.due_at = due
  return out
end

-- gate._take_place: a delivered waiter: its message was published, and the delivered copy is
-- the one to issue (payload nil: the stored one stays).
local function take_place(run, payload)
  run.confirmed = true
  if payload ~= nil then
    run.payload = payload
  end
  if run.state == 'pending' then
    run.state = 'gated'
  end
end

-- Save the counters; an empty key is forgotten after `retention` (the zsets vanish when empty).
-- Every script that adds or removes a run ends here (confirm, suspend and heartbeat only change
-- runs already in line), so the busy index is kept exact here: the key is in it exactly while
-- it has runs (SADD/SREM are idempotent; an empty index set vanishes with its last member). A
-- new script that adds or removes runs must end with finish too. gate._finish.
local function finish(meta)
  if zcard(K.holders) == 0 and zcard(K.waiters) == 0 then
    meta.seq = 0
    meta.idle_until = K.now + K.retention
    meta.due_at = nil
    redis.call('SREM', K.index, K.tag)
  else
    meta.idle_until = nil
    redis.call('SADD', K.index, K.tag)
  end
  save_meta(meta)
end

-- gate._new_waiter; payload nil: None; seq nil: at the back of the line, else at that place (the
-- place of a run it replaces).
local function new_waiter(meta, run_id, now, confirmed, generation, payload, delay, lease, orphan_timeout,
                          recheck, seq)
  if seq == nil then
    meta.seq = meta.seq + 1
    seq = meta.seq
  end
  local run = {
    run_id = run_id,
    seq = seq,
    state = 'pending',
    created_at = now,
    confirmed = confirmed,
    generation = generation,
    live = { generation },
    payload = payload,
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
  seen(run, now, delay)
  return run
end

-- End of lib.lua; the operation script follows.
