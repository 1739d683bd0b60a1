-- claim: decide one delivery (gate.claim): admit, gate, defer a busy duplicate, or drop a
-- stale copy; housekeeping (orphaned holders, registrations never published) first. Every
-- answer names the waiters the store issues now (hand_on).
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] generation of this delivery   ARGV[8] limit   ARGV[9] lease
-- ARGV[10] orphan_timeout ('' = never)   ARGV[11] recheck
-- ARGV[12] '1' if a payload is given, '0' for None, '2' for PAYLOAD_ON_REQUEST
-- ARGV[13] payload (bytes)
-- Returns {decision, token, generation, position, takeover, evicted, wakes, removed}:
--   decision 'admitted' | 'gated' | 'busy' | 'stale' | 'payload_needed' (only for '2', before
--   anything is written: the run has no stored payload and holds no slot); token, generation, position are
--   integers or false (None); takeover 1/0; evicted and removed lists of run ids; wakes a list
--   of {run_id, generation, payload or false}.

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = K.now
local generation = tonumber(ARGV[7])
local lease = tonumber(ARGV[9])
local orphan_timeout = opt_number(ARGV[10])
local recheck = tonumber(ARGV[11])
local payload = false
if ARGV[12] == '1' then
  payload = ARGV[13]
elseif ARGV[12] == '2' and redis.call('HEXISTS', KEYS[5], 'payload') == 0
    and redis.call('HGET', KEYS[5], 'state') ~= 'holding' then
  -- gate.claim's PAYLOAD_ON_REQUEST: no message to issue this run from, should it wait.
  return { 'payload_needed', false, false, false, 0, {}, {}, {} }
end

local meta = load_meta(K.now) or default_meta()
meta.limit = tonumber(ARGV[8])
housekeep(now, run_id)

local function answer(decision, token, new_generation, position, takeover, woken)
  return { decision, token or false, new_generation or false, position or false, takeover and 1 or 0, EVICTED,
    woken, REMOVED }
end

local function stale()
  local woken = hand_on(meta, now, nil)
  finish(meta)
  return answer('stale', nil, nil, nil, false, woken)
end

local function admit(run, takeover)
  meta.token = next_counter(meta.token, now)
  run.state = 'holding'
  run.token = meta.token
  run.holder_generation = generation
  run.live = { generation }
  run.admitted_at = now
  run.heartbeat_at = now
  run.lease_expires_at = now + lease
  run.executing = true
  run.payload = nil -- a holder is never issued again: an evicted one ran, or runs no more
  run.reissue_at = nil
  save_run(run)
  local woken = hand_on(meta, now, run_id)
  finish(meta)
  return answer('admitted', run.token, nil, nil, takeover, woken)
end

local run = load_run(run_id)
if run == nil then
  local settled = settled_generation(run_id, now)
  if settled ~= nil and settled ~= generation then
    return stale() -- a dead copy of a settled run
  end
  if settled == nil and issued_before(generation, now - K.retention) then
    return stale() -- issued before anything the store remembers: its run settled
  end
  -- Never registered (send_task, or a settled run re-driven): first sight (docs/concepts.md#what-other-deliveries-see).
  clear_settled(run_id)
  run = new_waiter(meta, run_id, now, true, generation, payload or nil, 0, lease, orphan_timeout, recheck)
elseif not contains(run.live, generation) then
  if not issued_in_a_lost_write(run, generation) then
    return stale()
  end
  run.live = sorted_generations(generation, unpack(run.live)) -- the record of the copy, restored
  run.generation = generation
end
run.lease = lease
run.orphan_timeout = orphan_timeout
run.recheck = recheck

if run.state == 'holding' then
  if run.executing and run.lease_expires_at > now then
    run.generation = next_counter(run.generation, now)
    -- This copy stays live until its deferred copy is published (gate.py says why).
    run.live = sorted_generations(run.holder_generation, generation, run.generation)
    save_run(run)
    local woken = hand_on(meta, now, nil)
    finish(meta)
    return answer('busy', nil, run.generation, nil, false, woken)
  end
  return admit(run, run.executing)
end

take_place(run, payload or nil)
seen(run, now)
-- gate.claim saves the run here; its slot is judged without saving it first (a registered run
-- is in the line already, a first sight's seq is past every waiter's: waiters_before counts
-- the same), so an admitted run writes once and a delivered payload never reaches the store.
local free = meta.limit - zcard(K.holders)
if free > 0 and waiters_before(run.seq) < free then
  return admit(run, false)
end
run.generation = next_counter(run.generation, now)
run.live = sorted_generations(generation, run.generation)
run.state = 'gated'
save_run(run)
local woken = hand_on(meta, now, run_id)
local position = waiters_before(run.seq) + 1
finish(meta)
return answer('gated', nil, run.generation, position, false, woken)
