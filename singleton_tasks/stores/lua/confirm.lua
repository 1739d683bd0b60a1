-- confirm: mark a registration as published (gate.confirm).
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope   ARGV[2] key   ARGV[3] run id
-- Returns 1 if the run is registered (now confirmed), 0 if it is unknown.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil then
  return 0
end
if not run.confirmed then
  run.confirmed = true
  save_run(run)
end
return 1
