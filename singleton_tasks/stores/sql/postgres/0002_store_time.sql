-- Migration 2: store-side time and bounded state. Each run records when a live copy of it was
-- last seen and when it is passed over; idle keys expire; settled markers are swept
-- namespace-wide. Keys idle at the upgrade are forgotten at once (tokens now come from the
-- store clock and stay above every token of version 1).

ALTER TABLE singleton_keys ADD COLUMN IF NOT EXISTS idle_until double precision;
ALTER TABLE singleton_runs ADD COLUMN IF NOT EXISTS recheck double precision NOT NULL DEFAULT 10.25;
ALTER TABLE singleton_runs ADD COLUMN IF NOT EXISTS seen_at double precision NOT NULL DEFAULT 0;
ALTER TABLE singleton_runs ADD COLUMN IF NOT EXISTS passed_over_at double precision;

UPDATE singleton_runs SET
    seen_at = created_at,
    passed_over_at = CASE
        WHEN NOT confirmed THEN created_at + 10.0
        WHEN orphan_timeout IS NULL THEN NULL
        ELSE created_at + orphan_timeout + recheck
    END;
UPDATE singleton_keys SET idle_until = 0
WHERE NOT EXISTS (
    SELECT 1 FROM singleton_runs AS r
    WHERE r.namespace = singleton_keys.namespace AND r.scope = singleton_keys.scope AND r.key = singleton_keys.key
);

DROP INDEX IF EXISTS singleton_runs_unconfirmed;
CREATE INDEX IF NOT EXISTS singleton_runs_overdue ON singleton_runs (namespace, scope, key, passed_over_at)
    WHERE state <> 'holding' AND passed_over_at IS NOT NULL;
DROP INDEX IF EXISTS singleton_settled_expiry;
CREATE INDEX IF NOT EXISTS singleton_settled_expiry ON singleton_settled (namespace, expires_at);
CREATE INDEX IF NOT EXISTS singleton_keys_idle ON singleton_keys (namespace, idle_until)
    WHERE idle_until IS NOT NULL;

INSERT INTO singleton_schema_version (version) VALUES (2) ON CONFLICT DO NOTHING;
