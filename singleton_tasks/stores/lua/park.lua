-- park: a registration published held back waits gated with its payload (gate.park).
-- Only a pending run with a payload is parked; one already delivered is left to its delivery.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- Returns the wakes, a list of {run_id, generation, payload or false}: the run itself among
-- them if a slot freed since it registered.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil or run.state ~= 'pending' or not has_payload(run) then
  return {}
end
local now = K.now
take_place(run, nil)
seen(run, now)
save_run(run)
local meta = load_meta(now) or default_meta()
local woken = hand_on(meta, now, nil)
finish(meta)
return woken
