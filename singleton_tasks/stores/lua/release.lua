-- release: settle a run (gate.release): free its slot or its place in line, remember its
-- live generation for a while, and name the gated waiters that now own a free slot.
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope        ARGV[2] key          ARGV[3] run id
-- ARGV[4] now          ARGV[5] token ('' = None: settle whatever the run is)
-- ARGV[6] generation ('' = None)            ARGV[7] registration_grace
-- ARGV[8] settled_ttl (seconds a settled run's marker lives)
-- Returns {released 1/0, lost 1/0, wakes, evicted}: wakes a list of
-- {run_id, generation, payload or false}; evicted a list of run ids.

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = tonumber(ARGV[4])
local token = opt_number(ARGV[5])
local generation = opt_number(ARGV[6])
local ttl = tonumber(ARGV[8])

local meta = load_meta() or default_meta()
local evicted = housekeep(now, tonumber(ARGV[7]), run_id)
local run = load_brief(run_id)
if run == nil then
  -- Settled already (idempotent: async interrupts settle twice) or taken from us.
  local lost = token ~= nil and settled_generation(run_id, now) == nil
  local woken = {}
  if #evicted > 0 then
    woken = wakes(meta, now, nil)
  end
  finish(meta)
  return { 0, lost and 1 or 0, woken, evicted }
end
if token ~= nil and (run.state ~= 'holding' or run.token ~= token) then
  local woken = {}
  if #evicted > 0 then
    woken = wakes(meta, now, nil)
  end
  finish(meta)
  return { 0, 1, woken, evicted }
end
delete_run(run_id, run)
local settled = generation or -1
if run.state == 'holding' then
  settled = run.holder_generation
end
mark_settled(run_id, settled, now + ttl, ttl)
local woken = wakes(meta, now, nil)
finish(meta)
return { 1, 0, woken, evicted }
