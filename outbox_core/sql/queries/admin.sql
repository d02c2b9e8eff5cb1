-- Named queries of the admin commands: migrate, status, cleanup, dead-letters.

-- name: migrations_table
CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migration_lock
-- Two replicas starting `migrate` at once take turns.
SELECT pg_advisory_xact_lock(hashtext('outbox-relay-migrate'))

-- name: migration_lifts_timeouts
-- First in each of migrate's transactions.  A role's or database's statement_timeout
-- (ALTER ROLE app SET statement_timeout = '50ms') is meant for the application's queries:
-- it cancelled a schema migration part way (rolled back, the same at every try), and an
-- idle_in_transaction_session_timeout would end the transaction holding the run lock.
-- migrate's waits are bounded by its own lock_timeout instead (migration_lock_timeout).
-- Local to the transaction: through a transaction pooler nothing stays on the server
-- connection the application gets next.
SELECT set_config('statement_timeout', '0', true),
       set_config('idle_in_transaction_session_timeout', '0', true)

-- name: migration_run_lock_try
-- Held for a whole `migrate` run by a transaction kept open beside the migrations' own
-- (relay/migrate.py _hold_run_lock): a second `migrate` tries again until it has it, then
-- finds the work done.  Tried, not waited for: a statement waiting holds a snapshot, which
-- the first one's CREATE INDEX CONCURRENTLY would wait for; and a role's or database's
-- lock_timeout, meant for the application's statements, ended that wait (lock_not_available)
-- while another migrate ran longer than it.
SELECT pg_try_advisory_xact_lock(hashtext('outbox-relay-migrate-run')) AS locked

-- name: migration_checksum
-- Read under migration_lock: a migration another `migrate` applied meanwhile is skipped.
SELECT checksum FROM outbox_schema_migrations WHERE version = %(version)s

-- name: migration_lock_timeout
-- A migration's transaction waits this long for a table lock (ALTER TABLE takes ACCESS
-- EXCLUSIVE: while it waits, every writer of the table queues behind it), then fails
-- with lock_not_available and relay/migrate.py tries again.  Local to the transaction.
SELECT set_config('lock_timeout', %(lock_timeout)s, true)

-- name: migration_blockers
-- After a migration gave up waiting: this database's other sessions whose transactions
-- are older than one wait and hold a table lock, oldest first (what to end, or wait for).
SELECT a.pid, coalesce(nullif(a.application_name, ''), 'no application_name') AS app,
       coalesce(a.state, 'another role''s session') AS state,
       extract(epoch FROM now() - a.xact_start)::float8 AS age_s
FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.xact_start < now() - make_interval(secs => %(older_than_s)s)
  AND EXISTS (SELECT 1 FROM pg_locks AS l
              WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.granted)
ORDER BY a.xact_start
LIMIT 5

-- name: applied_migrations
SELECT version, name, checksum FROM outbox_schema_migrations ORDER BY version

-- name: record_migration
INSERT INTO outbox_schema_migrations (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s)
ON CONFLICT (version) DO NOTHING

-- name: status_backlog
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_pending_age_s,
       count(*) FILTER (WHERE retry_at IS NOT NULL) AS retrying
FROM {table}
WHERE published_at IS NULL

-- name: status_dead_letters
SELECT count(*) AS dead_letters FROM outbox_dead_letters

-- name: status_stalled
-- Partitions live replicas wait on (a leader missing), one row per replica, topic and
-- partition (see sql/migrations/0008_replica_stalls.sql).
SELECT r.owner, t.key AS topic, p.key AS partition, p.value::bigint AS rows_waiting
FROM outbox_relay_replicas AS r
CROSS JOIN LATERAL jsonb_each(r.stalled) AS t
CROSS JOIN LATERAL jsonb_each_text(t.value) AS p
WHERE r.seen_until > now()
ORDER BY t.key, p.key, r.owner

-- name: cleanup_batch
-- Published rows past retention, a small batch at a time; SKIP LOCKED so the
-- relay is never blocked and never waits; unpublished rows are never touched.
-- %(after)s (the newest published_at of the round's previous batch) starts the
-- index scan past the entries this round already deleted, which stay in the index
-- until vacuum; a row published at an earlier time but committed later is left
-- for the next round, which starts from the beginning.
WITH doomed AS (
    SELECT id FROM {table}
    WHERE published_at IS NOT NULL
      AND published_at >= coalesce(%(after)s::timestamptz, '-infinity'::timestamptz)
      AND published_at < now() - make_interval(secs => %(retention_s)s)
    ORDER BY published_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {table} AS o
    USING doomed
    WHERE o.id = doomed.id AND o.published_at IS NOT NULL
    RETURNING o.published_at
)
SELECT count(*) AS deleted, max(published_at) AS last_published_at FROM gone

-- name: dead_letters_list
-- A key's first %(key_chars)s characters and its size in bytes: a row dead-lettered for its
-- size can carry a key of many megabytes, and a list of 200 such keys is gigabytes.
SELECT id, event_id::text AS event_id, topic, left(key, %(key_chars)s) AS key,
       octet_length(key) AS key_bytes, reason, error, attempts, created_at, dead_at
FROM outbox_dead_letters
ORDER BY dead_at, id
LIMIT %(limit)s

-- name: dead_letter_show
-- The whole row (%(max_chars)s NULL), or its key, payload and headers cut to their first
-- %(max_chars)s characters (the console's page of one row), with each one's size in bytes.
SELECT id, event_id::text AS event_id, topic,
       CASE WHEN %(max_chars)s::int IS NULL THEN key ELSE left(key, %(max_chars)s) END AS key,
       CASE WHEN %(max_chars)s::int IS NULL THEN payload::text
            ELSE left(payload::text, %(max_chars)s) END AS payload,
       CASE WHEN %(max_chars)s::int IS NULL THEN encode(payload_bytes, 'base64')
            ELSE encode(substr(payload_bytes, 1, %(max_chars)s), 'base64') END
           AS payload_bytes_base64,
       CASE WHEN %(max_chars)s::int IS NULL THEN headers::text
            ELSE left(headers::text, %(max_chars)s) END AS headers,
       octet_length(key) AS key_bytes,
       coalesce(octet_length(payload::text), octet_length(payload_bytes)) AS payload_size,
       octet_length(headers::text) AS header_bytes,
       reason, error, attempts, created_at, dead_at, owner
FROM outbox_dead_letters
WHERE event_id::text = %(event_id)s

-- name: dead_letter_requeue
-- Back into the outbox with the same event_id, as a new row (a new id and xid,
-- so it is ordered after what was written meanwhile), in one statement.
WITH moved AS (
    DELETE FROM outbox_dead_letters
    WHERE (%(all)s OR event_id::text = ANY(%(event_ids)s::text[]))
    RETURNING event_id, topic, key, payload, payload_bytes, headers, created_at
)
INSERT INTO {table} (event_id, topic, key, payload, payload_bytes, headers)
SELECT event_id, topic, key, payload, payload_bytes, headers FROM moved
RETURNING event_id::text AS event_id

-- name: dead_letter_purge
DELETE FROM outbox_dead_letters
WHERE (%(all)s OR event_id::text = ANY(%(event_ids)s::text[]))
RETURNING event_id::text AS event_id

-- name: print_lock_timeout
-- For `migrate --print`, first: the session's lock_timeout, as `migrate` sets it for each
-- migration (--lock-timeout-s); filled in with psycopg.sql.Literal.  A statement that
-- waits longer for a table lock (ALTER TABLE: every writer of the table queues behind
-- it meanwhile) fails with lock_not_available: run the script again later.  And, as
-- `migrate` does in its own transactions, no statement_timeout nor idle-in-transaction
-- timeout from the role or the database (meant for the application's queries): a
-- migration they cancel is rolled back, the same at every run.
SET lock_timeout = {timeout};
SET statement_timeout = 0;
SET idle_in_transaction_session_timeout = 0;

-- name: print_shards
-- For `migrate --print`: the shard rows that `migrate` creates; the count is
-- filled in with psycopg.sql.Literal.
INSERT INTO outbox_relay_settings (singleton, shards) VALUES (true, {shards})
    ON CONFLICT (singleton) DO NOTHING;
INSERT INTO outbox_relay_shards (shard)
    SELECT g FROM generate_series(0, (SELECT shards FROM outbox_relay_settings) - 1) AS g
    ON CONFLICT (shard) DO NOTHING;

-- name: pending_index_create
-- The claim's index on PostgreSQL 17 and later: the pending rows in (xid, id) order, with
-- each row's shard for the database's shard count as a third key column (the count filled
-- in with psycopg.sql.Literal, the name carrying it; run with empty parameters, so that
-- its %% is PostgreSQL's %).  A replica holding some of the shards has the claim's shard
-- test in the index condition (the claim's own expression: PostgreSQL plans each claim for
-- its values and matches it), so the rows of its peers' shards are stepped over in the
-- index instead of being read from the table (issue 18: a replica holding a quarter of the
-- shards spent 2.1 times a lone relay's execution per claimed row).  It serves every other
-- reader of the pending rows by its first two columns, as the (xid, id) index it replaces
-- did.  On an outbox of CONCURRENTLY_FROM_BYTES or more (relay/migrate_index.py) migrate
-- builds it CONCURRENTLY ({concurrently}: that word and a space), outside a transaction, on the table or on each
-- partition ({target}): a plain CREATE INDEX holds every writer of the table for as long as
-- it reads the whole table, published rows included (a partial index's build reads them all
-- to test its predicate).  On a smaller outbox, in migrate's transaction, under its
-- lock_timeout.
CREATE INDEX {concurrently}IF NOT EXISTS {index}
    ON {target} (xid, id, ((hashtext(coalesce(key, event_id::text)) & 2147483647) %% {shards}))
    WHERE published_at IS NULL;

-- name: pending_index_xid_id
-- The claim's index before PostgreSQL 17: migration 0001's.  Before 17 a btree scan with
-- an "= ANY" condition on its third column does not return (xid, id) order, so the planner
-- weighs the shard test in the index condition followed by a sort of every matching row
-- against the test as a filter on the ordered scan, by estimates: PostgreSQL 15 sorted a
-- replica's 52,500 pending rows (65 ms, on disk) for a claim of 1,000.  Filled in as
-- pending_index_create is ({index} outbox_pending_idx on the outbox).
CREATE INDEX {concurrently}IF NOT EXISTS {index} ON {target} (xid, id) WHERE published_at IS NULL;

-- name: print_pending_index
-- For `migrate --print`, last: what migrate does with the claim's index, for the count it
-- is given (pending_index_create, filled in the same way; the printed %% is a %).
DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 170000 THEN
-- include: pending_index_create
        DROP INDEX IF EXISTS outbox_pending_idx;
    END IF;
END
$$;

-- name: pending_indexes
-- The claim's indexes on the outbox: migration 0001's (xid, id) index and those built by
-- pending_index_create; migrate keeps the one for the shard count and drops the others.
-- ``valid`` is false for a concurrent build that did not finish (an invalid index, which
-- migrate drops and builds again) and for a partitioned outbox's index whose partitions are
-- not all attached yet.
SELECT c.relname::text AS name, x.indisvalid AS valid
FROM pg_index AS x
JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = to_regclass('outbox')
  AND (c.relname = 'outbox_pending_idx' OR c.relname ~ '^outbox_pending_by_[0-9]+_shards_idx$')
ORDER BY 1

-- name: drop_index
DROP INDEX IF EXISTS {index};

-- name: outbox_heap_bytes
-- The outbox's table data, every partition of a partitioned one: what a build of an index
-- reads (migrate builds the claim's index CONCURRENTLY from CONCURRENTLY_FROM_BYTES on).
-- (pg_partition_tree lists no row for a table that is not partitioned).
SELECT greatest(pg_relation_size('outbox'::regclass),
                (SELECT coalesce(sum(pg_relation_size(t.relid)), 0)
                 FROM pg_partition_tree('outbox'::regclass) AS t WHERE t.isleaf))::bigint AS heap_bytes

-- name: pending_index_partitions
-- A partitioned outbox's partitions without their part of the claim's index %(index)s (built
-- ON ONLY the outbox, invalid until every partition's part is attached), each with the name
-- migrate gives that part and whether an index of that name exists already (true: valid,
-- false: a concurrent build that did not finish; NULL: none).
SELECT c.relname::text AS part, left(c.relname, 40) || %(suffix)s AS child,
       (SELECT x.indisvalid FROM pg_class AS ic JOIN pg_index AS x ON x.indexrelid = ic.oid
        WHERE ic.relname = left(c.relname, 40) || %(suffix)s AND x.indrelid = c.oid) AS child_valid
FROM pg_partition_tree('outbox'::regclass) AS t
JOIN pg_class AS c ON c.oid = t.relid
WHERE t.isleaf AND NOT EXISTS (
    SELECT 1 FROM pg_inherits AS i JOIN pg_index AS x ON x.indexrelid = i.inhrelid
    WHERE i.inhparent = to_regclass(%(index)s) AND x.indrelid = t.relid)
ORDER BY 1

-- name: attach_index
-- A partition's part of a partitioned index, built CONCURRENTLY on its own: attached, and
-- the partitioned index valid once every partition's part is.
ALTER INDEX {index} ATTACH PARTITION {child}

-- name: index_build_progress
-- A CREATE INDEX CONCURRENTLY of migrate's on %(table)s, as its watch reads it: the phase
-- ("waiting for writers before build", "waiting for old snapshots", ...: it holds no writer
-- then, it waits for their transactions to end) and the session it waits for.
SELECT p.pid, p.phase, p.current_locker_pid
FROM pg_stat_progress_create_index AS p
WHERE p.datname = current_database() AND p.relid = to_regclass(%(table)s)
  AND p.command = 'CREATE INDEX CONCURRENTLY'

-- name: index_build_blockers
-- A concurrent build waited too long: the session it waits for now, and this database's
-- other transactions older than the build that hold a transaction id or a snapshot (what it
-- waits for next), oldest first.
SELECT a.pid, coalesce(nullif(a.application_name, ''), 'no application_name') AS app,
       coalesce(a.state, 'another role''s session') AS state,
       coalesce(extract(epoch FROM now() - a.xact_start), 0)::float8 AS age_s
FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid() AND a.pid <> %(builder)s
  AND (a.pid = %(locker)s
       OR (a.xact_start < (SELECT b.xact_start FROM pg_stat_activity AS b WHERE b.pid = %(builder)s)
           AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)))
ORDER BY a.xact_start NULLS LAST

-- name: adopted_table_of_view
-- The table under the view %(view)s the relay reads (made by migrate --debezium-table; each
-- part of the name quoted, as schema_check looks it up): its schema-qualified name, its
-- schema and its name, whose claim index relay/adopt_index.py reads.  No row: not such a
-- view.
WITH target AS (
    SELECT to_regclass(string_agg(quote_ident(p.part), '.' ORDER BY p.n)) AS oid
    FROM unnest(string_to_array(%(view)s, '.')) WITH ORDINALITY AS p(part, n)
), base AS (
    SELECT DISTINCT d.refobjid AS oid
    FROM target AS t
    JOIN pg_rewrite AS r ON r.ev_class = t.oid
    JOIN pg_depend AS d ON d.classid = 'pg_rewrite'::regclass AND d.objid = r.oid
                       AND d.refclassid = 'pg_class'::regclass AND d.refobjid <> r.ev_class
)
SELECT b.oid::regclass::text AS adopted, n.nspname::text AS schema, b.relname::text AS name
FROM base
JOIN pg_class AS b ON b.oid = base.oid AND b.relkind IN ('r', 'p')
JOIN pg_namespace AS n ON n.oid = b.relnamespace
WHERE EXISTS (SELECT 1 FROM pg_attribute AS a
              WHERE a.attrelid = b.oid AND a.attname = 'relay_seq' AND NOT a.attisdropped)
