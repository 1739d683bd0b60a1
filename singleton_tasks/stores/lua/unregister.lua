-- unregister: undo a registration whose publish failed (gate.unregister).
-- Only a PENDING run is removed; holders and delivered runs are left alone.
--
-- KEYS, ARGV[1..6]: the per-key layout of lib.lua
-- Returns 1 if the registration was removed, else 0.

use_key(KEYS, ARGV)
local run = load_brief(ARGV[3])
if run == nil or run.state ~= 'pending' then
  return 0
end
delete_run(ARGV[3], run)
local meta = load_meta(K.now) or default_meta()
meta.due_at = K.now -- the line moved: the next heartbeat recomputes what is due
finish(meta)
return 1
