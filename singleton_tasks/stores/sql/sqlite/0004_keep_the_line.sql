-- Migration 4: the store keeps the line (docs/deployment.md#schema-upgrades). No waiter is passed
-- over any more: each run records when it is issued again if no copy of it shows up
-- (reissue_at, which takes the place of passed_over_at, dropped), each key when it is next due for work
-- of its own (due_at). Every key with runs is due at once after the upgrade, so the first
-- heartbeat recomputes its due_at by the new rules.

ALTER TABLE singleton_runs ADD COLUMN reissue_at REAL;
UPDATE singleton_runs SET reissue_at = passed_over_at;
DROP INDEX IF EXISTS singleton_runs_overdue;
ALTER TABLE singleton_runs DROP COLUMN passed_over_at;
ALTER TABLE singleton_keys ADD COLUMN due_at REAL;
UPDATE singleton_keys SET due_at = 0
WHERE EXISTS (
    SELECT 1 FROM singleton_runs AS r
    WHERE r.namespace = singleton_keys.namespace AND r.scope = singleton_keys.scope AND r.key = singleton_keys.key
);
CREATE INDEX IF NOT EXISTS singleton_runs_unconfirmed ON singleton_runs (namespace, scope, key, created_at)
    WHERE confirmed = 0;
CREATE INDEX IF NOT EXISTS singleton_keys_due ON singleton_keys (namespace, due_at)
    WHERE due_at IS NOT NULL;

INSERT INTO singleton_schema_version (version) VALUES (4) ON CONFLICT DO NOTHING;
