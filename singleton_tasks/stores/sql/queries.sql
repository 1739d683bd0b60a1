-- Runtime statements of the SQL stores, shared by SQLite and PostgreSQL.
--
-- A section starts with `-- name: NAME` (both dialects) or `-- name: NAME (DIALECT)` (overrides
-- NAME for that dialect only). Parameters are written `:name`; the PostgreSQL store converts
-- them to psycopg's `%(name)s` when the file is loaded. Comment lines inside a section are
-- dropped at load. Data is always bound, never formatted into the text.
--
-- Run columns are always selected in RunRecord field order (see _sql.py).

-- name: lock_key
-- SQLite: the whole database is already write-locked by BEGIN IMMEDIATE.
SELECT token, seq, slot_limit FROM singleton_keys
WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: lock_key (postgres)
-- The key's row lock serializes every operation on this key and no other.
SELECT token, seq, slot_limit FROM singleton_keys
WHERE namespace = :namespace AND scope = :scope AND key = :key
FOR UPDATE;

-- name: insert_key
INSERT INTO singleton_keys (namespace, scope, key, token, seq, slot_limit)
VALUES (:namespace, :scope, :key, 0, 0, 1)
ON CONFLICT (namespace, scope, key) DO NOTHING;

-- name: update_key
UPDATE singleton_keys SET token = :token, seq = :seq, slot_limit = :slot_limit
WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: delete_key
DELETE FROM singleton_keys
WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: get_run
SELECT run_id, seq, state, created_at, confirmed, generation, live, payload, token,
       holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout
FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id;

-- name: save_run
INSERT INTO singleton_runs (
    namespace, scope, key, run_id, seq, state, created_at, confirmed, generation, live, payload, token,
    holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout
) VALUES (
    :namespace, :scope, :key, :run_id, :seq, :state, :created_at, :confirmed, :generation, :live, :payload,
    :token, :holder_generation, :admitted_at, :heartbeat_at, :lease_expires_at, :executing, :lease,
    :orphan_timeout
)
ON CONFLICT (namespace, scope, key, run_id) DO UPDATE SET
    seq = excluded.seq,
    state = excluded.state,
    created_at = excluded.created_at,
    confirmed = excluded.confirmed,
    generation = excluded.generation,
    live = excluded.live,
    payload = excluded.payload,
    token = excluded.token,
    holder_generation = excluded.holder_generation,
    admitted_at = excluded.admitted_at,
    heartbeat_at = excluded.heartbeat_at,
    lease_expires_at = excluded.lease_expires_at,
    executing = excluded.executing,
    lease = excluded.lease,
    orphan_timeout = excluded.orphan_timeout;

-- name: delete_run
DELETE FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id;

-- name: key_summary
-- The number of runs and the holders, one row per holder (one row of NULLs without holders).
-- Run after the key is locked, so PostgreSQL reads it with a snapshot taken after the lock.
SELECT c.runs,
       r.run_id, r.seq, r.state, r.created_at, r.confirmed, r.generation, r.live, r.payload, r.token,
       r.holder_generation, r.admitted_at, r.heartbeat_at, r.lease_expires_at, r.executing, r.lease,
       r.orphan_timeout
FROM (
    SELECT count(*) AS runs FROM singleton_runs
    WHERE namespace = :namespace AND scope = :scope AND key = :key
) AS c
LEFT JOIN singleton_runs AS r
    ON r.namespace = :namespace AND r.scope = :scope AND r.key = :key AND r.state = 'holding'
ORDER BY r.token;

-- name: waiters_from
-- The state literals match the partial indexes' predicates, so the planners can use them.
SELECT run_id, seq, state, created_at, confirmed, generation, live, payload, token,
       holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout
FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND state <> 'holding' AND seq > :after_seq
ORDER BY seq
LIMIT :count;

-- name: waiters_before
SELECT count(*) FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND state <> 'holding' AND seq < :seq;

-- name: unconfirmed_before
SELECT run_id FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key
  AND state = 'pending' AND NOT confirmed AND created_at < :created_before
ORDER BY created_at, run_id;

-- name: settled_generation
SELECT generation FROM singleton_settled
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id
  AND expires_at > :now;

-- name: delete_expired_settled
DELETE FROM singleton_settled
WHERE namespace = :namespace AND scope = :scope AND key = :key AND expires_at <= :now;

-- name: mark_settled
INSERT INTO singleton_settled (namespace, scope, key, run_id, generation, expires_at)
VALUES (:namespace, :scope, :key, :run_id, :generation, :expires_at)
ON CONFLICT (namespace, scope, key, run_id) DO UPDATE SET
    generation = excluded.generation,
    expires_at = excluded.expires_at;

-- name: clear_settled
DELETE FROM singleton_settled
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id;

-- name: snapshot
-- One statement, so one consistent view without locking any key.
SELECT k.scope, k.key, k.token, k.seq, k.slot_limit,
       r.run_id, r.seq, r.state, r.created_at, r.confirmed, r.generation, r.live, r.payload, r.token,
       r.holder_generation, r.admitted_at, r.heartbeat_at, r.lease_expires_at, r.executing, r.lease,
       r.orphan_timeout
FROM singleton_keys AS k
JOIN singleton_runs AS r ON r.namespace = k.namespace AND r.scope = k.scope AND r.key = k.key
WHERE k.namespace = :namespace
  AND (CAST(:scope AS TEXT) IS NULL OR k.scope = :scope)
  AND (CAST(:key AS TEXT) IS NULL OR k.key = :key);

-- name: schema_table_exists (sqlite)
SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'singleton_schema_version';

-- name: schema_table_exists (postgres)
SELECT count(*) FROM (SELECT to_regclass('singleton_schema_version') AS t) AS found WHERE t IS NOT NULL;

-- name: schema_version
SELECT max(version) FROM singleton_schema_version;

-- name: clear_schema_version
-- Tests only: pretend another library version wrote this database.
DELETE FROM singleton_schema_version;

-- name: insert_schema_version
INSERT INTO singleton_schema_version (version) VALUES (:version);

-- name: migration_lock (postgres)
-- Concurrent `migrate` callers queue here; released at the end of the transaction.
SELECT pg_advisory_xact_lock(7311984462152335937);
