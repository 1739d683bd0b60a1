-- Migration 1: the initial schema (idempotent: safe over a partly created one). Each migration
-- runs in one transaction with the others that are due and records its version.

CREATE TABLE IF NOT EXISTS singleton_schema_version (
    version integer PRIMARY KEY
);

-- Per scope+key counters; the row (and its token) outlives the key's runs (docs/concepts.md#fencing-tokens).
-- Its row lock is the key's lock: every operation on the key locks it first.
CREATE TABLE IF NOT EXISTS singleton_keys (
    namespace text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    token bigint NOT NULL DEFAULT 0,
    seq bigint NOT NULL DEFAULT 0,
    slot_limit integer NOT NULL DEFAULT 1,
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
    namespace text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    run_id text NOT NULL,
    generation bigint NOT NULL,
    expires_at double precision NOT NULL,
    PRIMARY KEY (namespace, scope, key, run_id)
);

CREATE INDEX IF NOT EXISTS singleton_settled_expiry ON singleton_settled (namespace, scope, key, expires_at);

INSERT INTO singleton_schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;
