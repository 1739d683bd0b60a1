-- singleton-tasks schema for SQLite, at the latest version: what `migrate` installs on an
-- empty database. Upgrades go through sqlite/NNNN_*.sql; tests/test_sql_schema.py checks that
-- applying every migration gives exactly this schema.

CREATE TABLE IF NOT EXISTS singleton_schema_version (
    version INTEGER PRIMARY KEY
);

-- Per scope+key counters. A key without runs is idle: its row is deleted once `idle_until`
-- has passed (docs/deployment.md#retention; tokens come from the store clock, so they keep increasing after that).
-- (SQLite serializes every operation with BEGIN IMMEDIATE: one writer per database.)
CREATE TABLE IF NOT EXISTS singleton_keys (
    namespace TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    token INTEGER NOT NULL DEFAULT 0,
    seq INTEGER NOT NULL DEFAULT 0,
    slot_limit INTEGER NOT NULL DEFAULT 1,
    idle_until REAL,
    due_at REAL,
    PRIMARY KEY (namespace, scope, key)
);

-- One row per registered run of a key (holders and waiters): every RunRecord field.
CREATE TABLE IF NOT EXISTS singleton_runs (
    namespace TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'gated', 'woken', 'holding')),
    created_at REAL NOT NULL,
    confirmed INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    live TEXT NOT NULL,
    payload BLOB,
    token INTEGER NOT NULL,
    holder_generation INTEGER NOT NULL,
    admitted_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    lease_expires_at REAL NOT NULL,
    executing INTEGER NOT NULL,
    lease REAL NOT NULL,
    orphan_timeout REAL,
    recheck REAL NOT NULL DEFAULT 10.25,
    seen_at REAL NOT NULL DEFAULT 0,
    reissue_at REAL,
    PRIMARY KEY (namespace, scope, key, run_id)
);

-- Waiters in registration order: waiters_from / waiters_before are range scans of this index.
CREATE INDEX IF NOT EXISTS singleton_runs_waiters ON singleton_runs (namespace, scope, key, seq)
    WHERE state <> 'holding';
CREATE INDEX IF NOT EXISTS singleton_runs_holders ON singleton_runs (namespace, scope, key, token)
    WHERE state = 'holding';
-- Registrations not confirmed yet: dropped once their grace has passed.
CREATE INDEX IF NOT EXISTS singleton_runs_unconfirmed ON singleton_runs (namespace, scope, key, created_at)
    WHERE confirmed = 0;

-- Admitted generations of recently settled runs (stale-copy detection), for `retention`;
-- expired rows are swept namespace-wide.
CREATE TABLE IF NOT EXISTS singleton_settled (
    namespace TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    run_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    expires_at REAL NOT NULL,
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
