-- suspend: a holder waits for its retry and keeps its slot, not executing (gate.suspend).
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope   ARGV[2] key   ARGV[3] run id
-- ARGV[4] now     ARGV[5] token ARGV[6] delay (seconds until the retry)
-- Returns 1 if the run holds its slot with that token (lease now covers the delay), else 0.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
local now = tonumber(ARGV[4])
if run == nil or run.state ~= 'holding' or run.token ~= tonumber(ARGV[5]) then
  return 0
end
run.executing = false
run.heartbeat_at = now
run.lease_expires_at = now + tonumber(ARGV[6]) + run.lease
save_run(run)
return 1
