-- claim: decide one delivery (gate.claim): admit, gate, defer a busy duplicate, or drop a
-- stale copy; housekeeping (orphaned holders, ghosts) first.
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope        ARGV[2] key          ARGV[3] run id
-- ARGV[4] now          ARGV[5] generation of this delivery
-- ARGV[6] limit        ARGV[7] lease        ARGV[8] orphan_timeout ('' = never)
-- ARGV[9] registration_grace
-- ARGV[10] '1' if a payload is given, '0' for None    ARGV[11] payload (bytes)
-- Returns {decision, token, generation, position, takeover, evicted, wakes}:
--   decision 'admitted' | 'gated' | 'busy' | 'stale'; token, generation, position are
--   integers or false (None); takeover 1/0; evicted a list of run ids; wakes a list of
--   {run_id, generation, payload or false}.

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = tonumber(ARGV[4])
local generation = tonumber(ARGV[5])
local lease = tonumber(ARGV[7])
local orphan_timeout = opt_number(ARGV[8])
local payload = false
if ARGV[10] == '1' then
  payload = ARGV[11]
end

local meta = load_meta() or default_meta()
meta.limit = tonumber(ARGV[6])
local evicted = housekeep(now, tonumber(ARGV[9]), run_id)

local function admit(run, takeover)
  meta.token = meta.token + 1
  run.state = 'holding'
  run.token = meta.token
  run.holder_generation = generation
  run.live = { generation }
  run.admitted_at = now
  run.heartbeat_at = now
  run.lease_expires_at = now + lease
  run.executing = true
  run.payload = nil
  save_run(run)
  local woken = wakes(meta, now, run_id)
  finish(meta)
  return { 'admitted', run.token, false, false, takeover and 1 or 0, evicted, woken }
end

local run = load_run(run_id)
local first_sight = run == nil
if run == nil then
  local settled = settled_generation(run_id, now)
  if settled ~= nil and settled ~= generation then
    local woken = {}
    if #evicted > 0 then
      woken = wakes(meta, now, nil)  -- an evicted slot goes to the next waiter at once
    end
    finish(meta)
    return { 'stale', false, false, false, 0, evicted, woken }
  end
  -- Never registered (send_task, or a settled run re-driven): first sight (SPEC §4).
  clear_settled(run_id)
  run = new_waiter(meta, run_id, now, true, generation, lease, orphan_timeout)
elseif not contains(run.live, generation) then
  local woken = wakes(meta, now, nil)
  finish(meta)
  return { 'stale', false, false, false, 0, evicted, woken }
end
run.lease = lease
run.orphan_timeout = orphan_timeout

if run.state == 'holding' then
  if run.executing and run.lease_expires_at > now then
    run.generation = run.generation + 1
    -- This copy stays live until its deferred copy is published (gate.py says why).
    run.live = sorted_generations(run.holder_generation, generation, run.generation)
    save_run(run)
    local woken = {}
    if #evicted > 0 then
      woken = wakes(meta, now, nil)
    end
    finish(meta)
    return { 'busy', false, run.generation, false, 0, evicted, woken }
  end
  return admit(run, run.executing)
end

take_place(run, payload or nil)
if first_sight then
  save_run(run) -- into the line (at its back) before the slots are counted
end
-- A registered run is already in the line: its slot is judged from this record (gated or
-- woken, never passed over) without saving it first, so an admitted run writes once and
-- its payload never reaches the store.
for _, owner in ipairs(slot_owners(meta.limit - zcard(K.holders), now, run)) do
  if owner[1] == run_id then
    return admit(run, false)
  end
end
run.generation = run.generation + 1
run.live = sorted_generations(generation, run.generation)
run.state = 'gated'
save_run(run)
local woken = wakes(meta, now, run_id)
local position = waiters_before(run.seq) + 1
finish(meta)
return { 'gated', false, run.generation, position, 0, evicted, woken }
