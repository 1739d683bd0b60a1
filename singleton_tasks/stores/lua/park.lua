-- park: a registration published held back waits gated with its payload (gate.park).
-- Only a pending run is parked; one already delivered is left to its delivery.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] payload (bytes)
-- Returns the wakes, a list of {run_id, generation, payload or false}: the run itself among
-- them if a slot freed since it registered.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil or run.state ~= 'pending' then
  return {}
end
take_place(run, ARGV[7])
seen(run, K.now)
save_run(run)
return wakes(load_meta(K.now) or default_meta(), K.now, nil)
