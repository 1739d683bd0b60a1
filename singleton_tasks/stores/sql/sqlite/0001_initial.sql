-- Migration 1: the initial schema (idempotent: safe over a partly created one). Each migration
-- runs in one transaction with the others that are due and records its version.

CREATE TABLE IF NOT EXISTS singleton_schema_version (
    version INTEGER PRIMARY KEY
);

-- Per scope+key counters; the row (and its token) outlives the key's runs (docs/concepts.md#fencing-tokens).
-- (SQLite serializes every operation with BEGIN IMMEDIATE: one writer per database.)
CREATE TABLE IF NOT EXISTS singleton_keys (
    namespace TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    token INTEGER NOT NULL DEFAULT 0,
    seq INTEGER NOT NULL DEFAULT 0,
    slot_limit INTEGER NOT NULL DEFAULT 1,
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
    PRIMARY KEY (namespace, scope, key, run_id)
);

-- Waiters in registration order: waiters_from / waiters_before are range scans of this index.
CREATE INDEX IF NOT EXISTS singleton_runs_waiters ON singleton_runs (namespace, scope, key, seq)
    WHERE state <> 'holding';
CREATE INDEX IF NOT EXISTS singleton_runs_holders ON singleton_runs (namespace, scope, key, token)
    WHERE state = 'holding';
CREATE INDEX IF NOT EXISTS singleton_runs_unconfirmed ON singleton_runs (namespace, scope, key, created_at)
    WHERE state = 'pending' AND NOT confirmed;

-- Admitted generations of recently settled runs (stale-copy detection); expired rows are
-- deleted when the key settles another run.
CREATE TABLE IF NOT EXISTS singleton_settled (
    namespace TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    run_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (namespace, scope, key, run_id)
);

CREATE INDEX IF NOT EXISTS singleton_settled_expiry ON singleton_settled (namespace, scope, key, expires_at);

INSERT INTO singleton_schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;
