-- confirm: mark a registration as published (gate.confirm): its message is on its way; the
-- key is due by the run's reissue_at at the latest.
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
  if has_payload(run) then
    lower_due(load_meta(nil), run.reissue_at)
  end
end
return 1
