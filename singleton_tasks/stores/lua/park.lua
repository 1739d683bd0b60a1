-- park: a registration published held back waits gated with its payload (gate.park).
-- Only a pending run is parked; one already delivered is left to its delivery.
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope   ARGV[2] key   ARGV[3] run id   ARGV[4] now   ARGV[5] payload (bytes)
-- Returns the wakes, a list of {run_id, generation, payload or false}: the run itself among
-- them if a slot freed since it registered.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil or run.state ~= 'pending' then
  return {}
end
take_place(run, ARGV[5])
save_run(run)
return wakes(load_meta() or default_meta(), tonumber(ARGV[4]), nil)
