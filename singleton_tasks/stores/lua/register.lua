-- register: a pending waiter with its payload, atomically with the backlog cap (gate.register;
-- docs/concepts.md#the-life-of-a-run). Every registered run counts until it settles;
-- registrations never published (unconfirmed past their grace) are dropped first.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- ARGV[7] confirmed '1'/'0'   ARGV[8] limit   ARGV[9] max_queue_depth ('' = unbounded)
-- ARGV[10] lease   ARGV[11] orphan_timeout ('' = never)   ARGV[12] recheck
-- ARGV[13] '1' if a payload is given, '0' for None   ARGV[14] payload (bytes)
-- ARGV[15] delay (seconds the run's message is delayed by)
-- ARGV[16] '1': over the cap, take the newest waiter's place (on_full="replace")
-- Returns {status, in_flight, replaced}: status 'registered' | 'exists' | 'full' | 'replaced';
-- in_flight counts holders + waiters after the call (registrations never published left out of
-- 'full' and 'registered'); replaced: the run id whose place the new run took ('replaced' only).

use_key(KEYS, ARGV)
local run_id = ARGV[3]
local now = K.now
local limit = tonumber(ARGV[8])
local depth = opt_number(ARGV[9])
local payload = nil
if ARGV[13] == '1' then
  payload = ARGV[14]
end

if redis.call('EXISTS', run_key(run_id)) == 1 then
  return { 'exists', count_runs() }
end
local never_published = unconfirmed_before(now - K.grace)
local in_flight = count_runs() - #never_published
local full = depth ~= nil and in_flight >= limit + depth
-- Never-published registrations are waiters, never holders: are there others to replace?
if full and (ARGV[16] ~= '1' or zcard(K.waiters) <= #never_published) then
  return { 'full', in_flight }
end
for _, id in ipairs(never_published) do
  delete_run(id, { state = 'pending', confirmed = false })
end
local replaced = nil
if full then
  replaced = newest_waiter()
  if replaced == nil then -- only phantoms were left (a damaged store): they are gone now
    finish(load_meta(now) or default_meta())
    return { 'full', in_flight }
  end
  delete_run(replaced.run_id, replaced)
  mark_settled(replaced.run_id, NO_COPY_GENERATION, now + K.retention)
end
local meta = load_meta(now) or default_meta()
meta.limit = limit
local ahead = zcard(K.waiters) -- waiters before the new run (a replaced run was last)
if ahead == 0 and zcard(K.holders) > 0 then -- the first waiter: an eviction hands it on
  meta.due_at = earliest(meta.due_at, eviction_due())
end
clear_settled(run_id)
local confirmed = ARGV[7] == '1'
local run = new_waiter(meta, run_id, now, confirmed, 0, payload, tonumber(ARGV[15]), tonumber(ARGV[10]),
  opt_number(ARGV[11]), tonumber(ARGV[12]), replaced and replaced.seq)
save_run(run)
meta.due_at = earliest(meta.due_at, own_due(run))
if not confirmed and ahead < limit - zcard(K.holders) then
  -- An owner whose publish may never happen: dropped at its grace's end even if nothing else
  -- calls the key (gate.register).
  meta.due_at = earliest(meta.due_at, now + K.grace)
end
finish(meta)
if replaced then
  return { 'replaced', in_flight, replaced.run_id }
end
return { 'registered', in_flight + 1 }
