-- suspend: a holder waits for its retry and keeps its slot, not executing (gate.suspend).
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] token   ARGV[8] delay (seconds until the retry)
-- Returns 1 if the run holds its slot with that token (lease now covers the delay), else 0.

use_key(KEYS, ARGV)
local run = load_run(ARGV[3])
if run == nil or run.state ~= 'holding' or run.token ~= tonumber(ARGV[7]) then
  return 0
end
run.executing = false
run.heartbeat_at = K.now
run.lease_expires_at = K.now + tonumber(ARGV[8]) + run.lease
save_run(run)
return 1
