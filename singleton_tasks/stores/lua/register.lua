-- register: a pending waiter, atomically with the backlog cap (gate.register; docs/concepts.md#the-life-of-a-run).
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] confirmed '1'/'0'   ARGV[8] limit   ARGV[9] max_queue_depth ('' = unbounded)
-- ARGV[10] lease   ARGV[11] orphan_timeout ('' = never)   ARGV[12] recheck
-- Returns {status, in_flight}: status 'registered' | 'exists' | 'full'; in_flight counts
-- holders + waiters after the call (waiters passed over left out of 'full' and 'registered').

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = K.now
local limit = tonumber(ARGV[8])
local depth = opt_number(ARGV[9])

if redis.call('EXISTS', run_key(run_id)) == 1 then
  return { 'exists', count_runs() }
end
local in_flight = count_runs() - count_passed_over(now)
if depth ~= nil and in_flight >= limit + depth then
  return { 'full', in_flight }
end
local meta = load_meta(K.now) or default_meta()
meta.limit = limit
clear_settled(run_id)
save_run(new_waiter(meta, run_id, now, ARGV[7] == '1', 0, tonumber(ARGV[10]), opt_number(ARGV[11]),
  tonumber(ARGV[12])))
finish(meta)
return { 'registered', in_flight + 1 }
