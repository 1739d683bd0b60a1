-- singleton-tasks schema for PostgreSQL, at the latest version: what `migrate` installs on an
-- empty database. Upgrades go through postgres/NNNN_*.sql; tests/test_sql_schema.py checks that
-- applying every migration gives exactly this schema.

CREATE TABLE IF NOT EXISTS singleton_schema_version (
    version integer PRIMARY KEY
);

-- Per scope+key counters. A key without runs is idle: its row is deleted once `idle_until`
-- has passed (docs/deployment.md#retention; tokens come from the store clock, so they keep increasing after that).
-- Its row lock is the key's lock: every operation on the key locks it first.
CREATE TABLE IF NOT EXISTS singleton_keys (
    namespace text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    token bigint NOT NULL DEFAULT 0,
    seq bigint NOT NULL DEFAULT 0,
    slot_limit integer NOT NULL DEFAULT 1,
    idle_until double precision,
    due_at double precision,
    PRIMARY KEY (namespace, scope, key)
);

-- One row per registered run of a key (holders and waiters): every RunRecord field.
CREATE TABLE IF NOT EXISTS singleton_runs (
    namespace text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    run_id text NOT NULL,
    seq bigint NOT NULL,
    state text NOT NULL CHECK (state IN ('pending', 'gated', 'woken', 'holding')),
    created_at double precision NOT NULL,
    confirmed boolean NOT NULL,
    generation bigint NOT NULL,
    live text NOT NULL,
    payload bytea,
    token bigint NOT NULL,
    holder_generation bigint NOT NULL,
    admitted_at double precision NOT NULL,
    heartbeat_at double precision NOT NULL,
    lease_expires_at double precision NOT NULL,
    executing boolean NOT NULL,
    lease double precision NOT NULL,
    orphan_timeout double precision,
    recheck double precision NOT NULL DEFAULT 10.25,
    seen_at double precision NOT NULL DEFAULT 0,
    reissue_at double precision,
    PRIMARY KEY (namespace, scope, key, run_id)
);

-- Waiters in registration order: waiters_from / waiters_before are range scans of this index.
CREATE INDEX IF NOT EXISTS singleton_runs_waiters ON singleton_runs (namespace, scope, key, seq)
    WHERE state <> 'holding';
CREATE INDEX IF NOT EXISTS singleton_runs_holders ON singleton_runs (namespace, scope, key, token)
    WHERE state = 'holding';
-- Registrations not confirmed yet: dropped once their grace has passed.
CREATE INDEX IF NOT EXISTS singleton_runs_unconfirmed ON singleton_runs (namespace, scope, key, created_at)
    WHERE NOT confirmed;

-- Admitted generations of recently settled runs (stale-copy detection), for `retention`;
-- expired rows are swept namespace-wide.
CREATE TABLE IF NOT EXISTS singleton_settled (
    namespace text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    run_id text NOT NULL,
    generation bigint NOT NULL,
    expires_at double precision NOT NULL,
    PRIMARY KEY (namespace, scope, key, run_id)
);

CREATE INDEX IF NOT EXISTS singleton_settled_expiry ON singleton_settled (namespace, expires_at);

CREATE INDEX IF NOT EXISTS singleton_keys_idle ON singleton_keys (namespace, idle_until)
    WHERE idle_until IS NOT NULL;
-- Keys with work of their own due (re-issues, evictions): the workers' heartbeats find them here.
CREATE INDEX IF NOT EXISTS singleton_keys_due ON singleton_keys (namespace, due_at)
    WHERE due_at IS NOT NULL;

INSERT INTO singleton_schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;
INSERT INTO singleton_schema_version (version) VALUES (2) ON CONFLICT DO NOTHING;
INSERT INTO singleton_schema_version (version) VALUES (3) ON CONFLICT DO NOTHING;
INSERT INTO singleton_schema_version (version) VALUES (4) ON CONFLICT DO NOTHING;
