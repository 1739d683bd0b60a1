-- Migration 4: the store keeps the line (docs/deployment.md#schema-upgrades). No waiter is passed
-- over any more: each run records when it is issued again if no copy of it shows up
-- (reissue_at, which takes the place of passed_over_at), each key when it is next due for work
-- of its own (due_at). Every key with runs is due at once after the upgrade, so the first
-- heartbeat recomputes its due_at by the new rules.

-- A rename keeps the column's place; migrations re-applied (version rows lost) re-add
-- passed_over_at beside reissue_at, and then it is dropped.
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM information_schema.columns
        WHERE table_name = 'singleton_runs' AND column_name = 'passed_over_at'
          AND table_schema = current_schema()
    ) THEN
        IF EXISTS (
            SELECT 1 FROM information_schema.columns
            WHERE table_name = 'singleton_runs' AND column_name = 'reissue_at'
              AND table_schema = current_schema()
        ) THEN
            ALTER TABLE singleton_runs DROP COLUMN passed_over_at;
        ELSE
            ALTER TABLE singleton_runs RENAME COLUMN passed_over_at TO reissue_at;
        END IF;
    END IF;
END $$;
DROP INDEX IF EXISTS singleton_runs_overdue;
ALTER TABLE singleton_keys ADD COLUMN IF NOT EXISTS due_at double precision;
UPDATE singleton_keys SET due_at = 0
WHERE EXISTS (
    SELECT 1 FROM singleton_runs AS r
    WHERE r.namespace = singleton_keys.namespace AND r.scope = singleton_keys.scope AND r.key = singleton_keys.key
);
CREATE INDEX IF NOT EXISTS singleton_runs_unconfirmed ON singleton_runs (namespace, scope, key, created_at)
    WHERE NOT confirmed;
CREATE INDEX IF NOT EXISTS singleton_keys_due ON singleton_keys (namespace, due_at)
    WHERE due_at IS NOT NULL;

INSERT INTO singleton_schema_version (version) VALUES (4) ON CONFLICT DO NOTHING;
