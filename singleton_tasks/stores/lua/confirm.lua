-- confirm: mark a registration as published (gate.confirm): its message is on its way; the
-- key is due by the run's own due time (own_due) at the latest.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- Returns 1 if the run is registered (now confirmed), 0 if it is unknown.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil then
  return 0
end
if not run.confirmed then
  run.confirmed = true
  save_run(run)
  lower_due(load_meta(nil), own_due(run))
end
return 1
