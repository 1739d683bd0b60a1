-- confirm: mark a registration as published (gate.confirm): it is seen now.
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
  seen(run, K.now)
  save_run(run)
end
return 1
