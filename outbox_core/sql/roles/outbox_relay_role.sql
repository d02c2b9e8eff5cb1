-- The relay's least-privilege role: NOLOGIN group role "outbox_relay".
--
-- Run once per database, after `outbox-relay migrate`, as the role that owns the
-- outbox tables and may create roles (or a superuser):
-- psql -f, or one execute() from any driver (no psql meta-commands, no parameters).  Idempotent and convergent: every run first
-- revokes whatever the role held on the relay's tables, then grants exactly the
-- list below, so an older, wider grant does not survive a re-run.  The tables are
-- looked up in current_schema(), where the relay finds them through search_path.
--
-- What the relay runs, and why each privilege (sql/queries/*.sql):
--   outbox                 SELECT                claim_batch, backlog, status_backlog,
--                                                dead_letter's RETURNING o.*
--                          UPDATE (published_at, attempts, last_error, retry_at, xid)
--                                                mark_published, record_failure,
--                                                sweep (restamps xid); the
--                                                column privilege also allows the row
--                                                locks of cleanup_batch (FOR UPDATE)
--                          DELETE                dead_letter (moves a row), cleanup_batch,
--                                                delete_published (--keep-published false)
--   outbox_dead_letters    SELECT, INSERT        dead_letter (INSERT ... RETURNING id),
--                                                status, dead-letters list / show
--   outbox_relay_shards    SELECT, UPDATE (owner, lease_until, token)
--                                                claim_shards / heartbeat (renewal) / release; the
--                                                FOR SHARE / FOR UPDATE row locks of
--                                                mark_published, record_failure,
--                                                dead_letter and claim_shards need UPDATE
--   outbox_relay_replicas  SELECT, INSERT, UPDATE (seen_until, stalled), DELETE
--                                                heartbeat (upsert), forget_replica
--   outbox_relay_settings  SELECT                read_settings (the shard count)
--   outbox_relay_replays   SELECT, UPDATE (state, finished_at)
--                                                list_replays, replay_batch,
--                                                finish_replay (0007)
--   outbox_relay_replay_progress  SELECT, INSERT, UPDATE
--                                                load_progress, advance_progress (0007)
--   the database           CONNECT; the schema: USAGE.  LISTEN and the wake-up
--                          advisory lock (go_to_sleep / wake_up) need no privilege.
--
-- Deliberately NOT granted:
--   * pg_read_all_stats (or pg_monitor): it would let the relay read the SQL text of
--     every session of every database.  The relay needs no other session's activity;
--     a run of this script revokes it from a role that an older version granted it to.
--   * INSERT on outbox: the relay never writes events.  `dead-letters requeue`
--     (DELETE outbox_dead_letters + INSERT outbox) and `dead-letters purge`
--     (DELETE outbox_dead_letters) are operator commands: run them with the role
--     that owns the schema, or an operator role such as
--         CREATE ROLE outbox_relay_operator NOLOGIN IN ROLE outbox_relay;
--         GRANT INSERT ON outbox TO outbox_relay_operator;
--         GRANT DELETE ON outbox_dead_letters TO outbox_relay_operator;
--         GRANT INSERT ON outbox_relay_replays TO outbox_relay_operator;  -- `replay`
--   * anything on outbox_schema_migrations: only `migrate` reads it, and migrate
--     needs the owner role anyway (CREATE on the schema).  `run`, `status`,
--     `cleanup` (plain outbox) and `dead-letters list|show` work under this role.
--   * anything on outbox_inbox (the consumer SDK's table) or other tables.
--   * CREATE on the database or the schema.  PostgreSQL 15 and later no longer
--     give PUBLIC the CREATE privilege on schema public; on older servers run
--         REVOKE CREATE ON SCHEMA public FROM PUBLIC;
--     PUBLIC keeps TEMPORARY on every database by default; where temporary tables
--     are unwanted too:  REVOKE TEMPORARY ON DATABASE <db> FROM PUBLIC;
--
-- The outbox under another name (--table / OUTBOX_RELAY_TABLE, e.g. the view that
-- `migrate --debezium-table` makes over a Debezium outbox): this script grants on
-- "outbox"; grant the same SELECT, DELETE and column UPDATE on that view instead.
--
-- A partitioned outbox (`migrate --partitioned`): the grants on the parent cover
-- every partition reached through it (the relay's statements, `status`,
-- `dead-letters list`).  Partition maintenance is DDL and reads partitions
-- directly, so it needs the owner of outbox: run `outbox-relay cleanup` (a daily
-- job) with the owner's DSN.  Note: `run` currently maintains the partitions of a
-- partitioned outbox itself and stops when that is refused, so this role suits a
-- plain outbox until `run` can leave maintenance to that job.
--
-- A login role for the relay process (one per deployment; rotate by creating a
-- new one and dropping the old):
--     CREATE ROLE outbox_relay_login LOGIN PASSWORD '...' IN ROLE outbox_relay;
-- and point OUTBOX_RELAY_DSN (or OUTBOX_RELAY_DSN_FILE) at it: the deploy examples
-- (deploy/k8s/secret.example.yaml) log in as outbox_relay_login.  The group role
-- itself cannot log in.

DO $role$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_relay') THEN
        BEGIN
            CREATE ROLE outbox_relay NOLOGIN;
        EXCEPTION WHEN duplicate_object THEN
            NULL;  -- created meanwhile by a concurrent run of this script
        END;
    END IF;
    -- A group role never logs in and holds no role attribute.  Altered only when needed:
    -- changing some attributes takes a superuser, even to the value they already have.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_relay'
               AND (rolcanlogin OR rolsuper OR rolcreatedb OR rolcreaterole
                    OR rolreplication OR rolbypassrls)) THEN
        ALTER ROLE outbox_relay NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
            NOBYPASSRLS;
    END IF;
    -- Older versions of this script granted pg_read_all_stats: take it back.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_auth_members AS m
               WHERE m.member = 'outbox_relay'::regrole
                 AND m.roleid = 'pg_read_all_stats'::regrole) THEN
        REVOKE pg_read_all_stats FROM outbox_relay;
    END IF;
END
$role$;

DO $grants$
DECLARE
    schema_name text := pg_catalog.current_schema();
    tbl text;
BEGIN
    IF schema_name IS NULL THEN
        RAISE EXCEPTION 'no current schema: set search_path to the outbox schema first';
    END IF;
    IF pg_catalog.to_regclass(pg_catalog.format('%I.outbox', schema_name)) IS NULL THEN
        RAISE EXCEPTION 'table %.outbox not found: run `outbox-relay migrate` first', schema_name;
    END IF;

    EXECUTE pg_catalog.format('GRANT CONNECT ON DATABASE %I TO outbox_relay',
                              pg_catalog.current_database());
    EXECUTE pg_catalog.format('GRANT USAGE ON SCHEMA %I TO outbox_relay', schema_name);

    -- Converge: start from nothing on every table of the relay and the SDK.
    FOREACH tbl IN ARRAY ARRAY['outbox', 'outbox_dead_letters', 'outbox_relay_shards',
                               'outbox_relay_replicas', 'outbox_relay_settings',
                               'outbox_schema_migrations', 'outbox_inbox',
                               'outbox_relay_replays', 'outbox_relay_replay_progress'] LOOP
        IF pg_catalog.to_regclass(pg_catalog.format('%I.%I', schema_name, tbl)) IS NOT NULL THEN
            EXECUTE pg_catalog.format('REVOKE ALL ON TABLE %I.%I FROM outbox_relay', schema_name, tbl);
        END IF;
    END LOOP;

    EXECUTE pg_catalog.format(
        'GRANT SELECT, DELETE, UPDATE (published_at, attempts, last_error, retry_at, xid) '
        'ON TABLE %I.outbox TO outbox_relay', schema_name);
    EXECUTE pg_catalog.format(
        'GRANT SELECT, INSERT ON TABLE %I.outbox_dead_letters TO outbox_relay', schema_name);
    EXECUTE pg_catalog.format(
        'GRANT SELECT, UPDATE (owner, lease_until, token) '
        'ON TABLE %I.outbox_relay_shards TO outbox_relay', schema_name);
    EXECUTE pg_catalog.format(
        'GRANT SELECT, INSERT, DELETE, UPDATE (seen_until, stalled) '
        'ON TABLE %I.outbox_relay_replicas TO outbox_relay', schema_name);
    EXECUTE pg_catalog.format(
        'GRANT SELECT ON TABLE %I.outbox_relay_settings TO outbox_relay', schema_name);
    IF pg_catalog.to_regclass(pg_catalog.format('%I.outbox_relay_replays', schema_name)) IS NOT NULL THEN
        EXECUTE pg_catalog.format(
            'GRANT SELECT, UPDATE (state, finished_at) '
            'ON TABLE %I.outbox_relay_replays TO outbox_relay', schema_name);
        EXECUTE pg_catalog.format(
            'GRANT SELECT, INSERT, UPDATE '
            'ON TABLE %I.outbox_relay_replay_progress TO outbox_relay', schema_name);
    END IF;
END
$grants$;
