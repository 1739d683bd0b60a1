-- Migration 3: the Redis store lists its busy keys in an index (docs/deployment.md#schema-upgrades).
-- The SQL schema does not change: `inspect` already starts from singleton_runs, which holds
-- the busy keys' runs only. The version is shared by every store, so it is recorded here too.

INSERT INTO singleton_schema_version (version) VALUES (3) ON CONFLICT DO NOTHING;
