-- release: settle a run (gate.release): free its slot or its place in line, remember its
-- live generation for `retention`, and name the waiters the store issues now (hand_on).
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] token ('' = None: settle whatever the run is)   ARGV[8] generation ('' = None)
-- ARGV[9] '1': settle the run only while it holds no slot (gate.release's waiting_only)
-- Returns {released 1/0, lost 1/0, wakes, evicted, removed}: wakes a list of
-- {run_id, generation, payload or false}; evicted and removed lists of run ids.

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = K.now
local token = opt_number(ARGV[7])
local generation = opt_number(ARGV[8])
local waiting_only = ARGV[9] == '1'

local meta = load_meta(K.now) or default_meta()
housekeep(now, run_id)
local run = load_brief(run_id)
if run == nil and token == nil and not waiting_only and (zrem(K.holders, run_id) + zrem(K.waiters, run_id)) > 0 then
  -- A phantom (its data lost by the server) released by an operator: gone from the indexes.
  redis.call('ZREM', K.unconfirmed, run_id)
  mark_settled(run_id, generation or NO_COPY_GENERATION, now + K.retention)
  local woken = hand_on(meta, now, nil)
  finish(meta)
  return { 1, 0, woken, EVICTED, REMOVED }
end
if run == nil or (token ~= nil and (run.state ~= 'holding' or run.token ~= token))
    or (waiting_only and run.state == 'holding') then
  -- Settled already (idempotent: async interrupts settle twice), taken from us, or (only a
  -- waiter to settle) admitted meanwhile by another copy.
  local lost = token ~= nil and (run ~= nil or settled_generation(run_id, now) == nil)
  local woken = hand_on(meta, now, nil)
  finish(meta)
  return { 0, lost and 1 or 0, woken, EVICTED, REMOVED }
end
delete_run(run_id, run)
local settled = generation or NO_COPY_GENERATION
if run.state == 'holding' then
  settled = run.holder_generation
end
mark_settled(run_id, settled, now + K.retention)
local woken = hand_on(meta, now, nil)
finish(meta)
return { 1, 0, woken, EVICTED, REMOVED }
