-- Runtime statements of the SQL stores, shared by SQLite and PostgreSQL.
--
-- A section starts with `-- name: NAME` (both dialects) or `-- name: NAME (DIALECT)` (overrides
-- NAME for that dialect only). Parameters are written `:name`; the PostgreSQL store converts
-- them to psycopg's `%(name)s` when the file is loaded. Comment lines inside a section are
-- dropped at load. Data is always bound, never formatted into the text.
--
-- A run is read by column name (_sql.py), so a statement that reads a run selects every RunRecord
-- field under its own name (tests/test_record_shape.py checks).

-- name: lock_key
-- SQLite: the whole database is already write-locked by BEGIN IMMEDIATE; the store's clock is
-- the host's, read in Python (:now).
SELECT token, seq, slot_limit, idle_until, :now, due_at FROM singleton_keys
WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: lock_key (postgres)
-- The key's row lock serializes every operation on this key and no other. The last column is
-- the store's clock: the server's (or the test clock's :now), read once the lock is held.
SELECT token, seq, slot_limit, idle_until,
       COALESCE(CAST(:now AS double precision), extract(epoch FROM clock_timestamp())::double precision),
       due_at
FROM singleton_keys
WHERE namespace = :namespace AND scope = :scope AND key = :key
FOR UPDATE;

-- name: server_time
-- SQLite: the host's clock, read in Python (:now).
SELECT :now;

-- name: server_time (postgres)
SELECT COALESCE(CAST(:now AS double precision), extract(epoch FROM clock_timestamp())::double precision);

-- name: insert_key
INSERT INTO singleton_keys (namespace, scope, key, token, seq, slot_limit)
VALUES (:namespace, :scope, :key, 0, 0, 1)
ON CONFLICT (namespace, scope, key) DO NOTHING;

-- name: delete_key
DELETE FROM singleton_keys WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: update_key
UPDATE singleton_keys
SET token = :token, seq = :seq, slot_limit = :slot_limit, idle_until = :idle_until, due_at = :due_at
WHERE namespace = :namespace AND scope = :scope AND key = :key;

-- name: sweep_keys
-- A few keys of the namespace idle past their idle_until (a key never has runs then). In index
-- order, so the LIMIT stops early on the (namespace, idle_until) index instead of a table scan.
DELETE FROM singleton_keys WHERE rowid IN (
    SELECT rowid FROM singleton_keys
    WHERE namespace = :namespace AND idle_until IS NOT NULL AND idle_until < :now
    ORDER BY idle_until
    LIMIT :count
);

-- name: sweep_keys (postgres)
-- SKIP LOCKED: a key another transaction holds is in use, never waited for.
DELETE FROM singleton_keys WHERE ctid IN (
    SELECT ctid FROM singleton_keys
    WHERE namespace = :namespace AND idle_until IS NOT NULL AND idle_until < :now
    ORDER BY idle_until
    LIMIT :count
    FOR UPDATE SKIP LOCKED
);

-- name: get_run
SELECT run_id, seq, state, created_at, confirmed, generation, live, payload, token,
       holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout,
       recheck, seen_at, reissue_at
FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id;

-- name: save_run
INSERT INTO singleton_runs (
    namespace, scope, key, run_id, seq, state, created_at, confirmed, generation, live, payload, token,
    holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout,
    recheck, seen_at, reissue_at
) VALUES (
    :namespace, :scope, :key, :run_id, :seq, :state, :created_at, :confirmed, :generation, :live, :payload,
    :token, :holder_generation, :admitted_at, :heartbeat_at, :lease_expires_at, :executing, :lease,
    :orphan_timeout, :recheck, :seen_at, :reissue_at
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
    orphan_timeout = excluded.orphan_timeout,
    recheck = excluded.recheck,
    seen_at = excluded.seen_at,
    reissue_at = excluded.reissue_at;

-- name: delete_run
DELETE FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id;

-- name: key_summary
-- The number of runs and the holders, one row per holder (one row of NULLs without holders).
-- Run after the key is locked, so PostgreSQL reads it with a snapshot taken after the lock.
SELECT c.runs,
       r.run_id, r.seq, r.state, r.created_at, r.confirmed, r.generation, r.live, r.payload, r.token,
       r.holder_generation, r.admitted_at, r.heartbeat_at, r.lease_expires_at, r.executing, r.lease,
       r.orphan_timeout, r.recheck, r.seen_at, r.reissue_at
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
       holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout,
       recheck, seen_at, reissue_at
FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND state <> 'holding' AND seq > :after_seq
ORDER BY seq
LIMIT :count;

-- name: newest_waiter
-- The waiter registered last (on_full="replace"), on the waiters' partial index.
SELECT run_id, seq, state, created_at, confirmed, generation, live, payload, token,
       holder_generation, admitted_at, heartbeat_at, lease_expires_at, executing, lease, orphan_timeout,
       recheck, seen_at, reissue_at
FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND state <> 'holding'
ORDER BY seq DESC
LIMIT 1;

-- name: waiters_before
SELECT count(*) FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key AND state <> 'holding' AND seq < :seq;

-- name: unconfirmed_before
SELECT run_id FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key
  AND NOT confirmed AND created_at < :before
ORDER BY created_at, run_id;

-- name: unconfirmed_before (sqlite)
-- The literal matches the partial index's predicate, so the planner can use it.
SELECT run_id FROM singleton_runs
WHERE namespace = :namespace AND scope = :scope AND key = :key
  AND confirmed = 0 AND created_at < :before
ORDER BY created_at, run_id;

-- name: due_keys
-- Keys whose due_at has passed, earliest first, on the (namespace, due_at) index.
SELECT scope, key FROM singleton_keys
WHERE namespace = :namespace AND due_at IS NOT NULL AND due_at < :now
ORDER BY due_at
LIMIT :count;

-- name: settled_generation
SELECT generation FROM singleton_settled
WHERE namespace = :namespace AND scope = :scope AND key = :key AND run_id = :run_id
  AND expires_at > :now;

-- name: sweep_settled
-- A few expired markers of the namespace (each settlement adds one and sweeps two), in the order
-- of the (namespace, expires_at) index: its LIMIT stops early instead of scanning the table.
DELETE FROM singleton_settled WHERE rowid IN (
    SELECT rowid FROM singleton_settled
    WHERE namespace = :namespace AND expires_at <= :now
    ORDER BY expires_at
    LIMIT :count
);

-- name: sweep_settled (postgres)
DELETE FROM singleton_settled WHERE ctid IN (
    SELECT ctid FROM singleton_settled
    WHERE namespace = :namespace AND expires_at <= :now
    ORDER BY expires_at
    LIMIT :count
    FOR UPDATE SKIP LOCKED
);

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
-- One statement, so one consistent view without locking any key. It starts from the runs, so
-- idle keys (which have none) cost nothing.
SELECT k.scope, k.key, k.token, k.seq, k.slot_limit,
       r.run_id, r.seq, r.state, r.created_at, r.confirmed, r.generation, r.live, r.payload, r.token,
       r.holder_generation, r.admitted_at, r.heartbeat_at, r.lease_expires_at, r.executing, r.lease,
       r.orphan_timeout, r.recheck, r.seen_at, r.reissue_at
FROM singleton_runs AS r
JOIN singleton_keys AS k ON r.namespace = k.namespace AND r.scope = k.scope AND r.key = k.key
WHERE r.namespace = :namespace
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
