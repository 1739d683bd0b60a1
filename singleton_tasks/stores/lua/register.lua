-- register: a pending waiter, atomically with the backlog cap (gate.register; SPEC §3.1, §5, §7).
--
-- KEYS: the per-key layout of lib.lua (meta, waiters, holders, ghosts, run, settled)
-- ARGV[1] scope         ARGV[2] key              ARGV[3] run id
-- ARGV[4] now           ARGV[5] confirmed '1'/'0'
-- ARGV[6] limit         ARGV[7] max_queue_depth ('' = unbounded)
-- ARGV[8] lease         ARGV[9] orphan_timeout ('' = never)
-- ARGV[10] registration_grace (an unconfirmed registration older than this is a ghost)
-- Returns {status, in_flight}: status 'registered' | 'exists' | 'full'; in_flight counts
-- holders + waiters after the call (ghosts left out of 'full' and 'registered').

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = tonumber(ARGV[4])
local limit = tonumber(ARGV[6])
local depth = opt_number(ARGV[7])

if redis.call('EXISTS', run_key(run_id)) == 1 then
  return { 'exists', count_runs() }
end
local ghosts = count_unconfirmed_before(now - tonumber(ARGV[10]))
local in_flight = count_runs() - ghosts
if depth ~= nil and in_flight >= limit + depth then
  return { 'full', in_flight }
end
local meta = load_meta() or default_meta()
meta.limit = limit
clear_settled(run_id)
save_run(new_waiter(meta, run_id, now, ARGV[5] == '1', 0, tonumber(ARGV[8]), opt_number(ARGV[9])))
save_meta(meta)
return { 'registered', in_flight + 1 }
