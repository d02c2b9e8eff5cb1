-- The worker pool's own sessions (consumer_sdk/jobs/_conn.py): the dispatcher's, the
-- heartbeat's and the lock-wait watch's, never the connection a handler works on (its
-- session settings are the handler's).  Not sent behind a transaction pooler: a session
-- setting would stay on whichever server session the pooler lent, for its other clients.

-- name: pool_session_setup
-- The dispatcher's and the heartbeat's connections: a worker frozen inside a transaction is
-- disconnected after %(idle_ms)s ms (as session_setup in jobs.sql); with %(statement_ms)s > 0
-- each statement is cancelled (57014) once it has run that long (pool_statement_timeout_s);
-- 0 leaves the role's or database's statement_timeout as it is.
SELECT set_config('idle_in_transaction_session_timeout', %(idle_ms)s::text, false),
       CASE WHEN %(statement_ms)s::int > 0
            THEN set_config('statement_timeout', %(statement_ms)s::text, false) END

-- name: watch_session_setup
-- The lock-wait watch's connection: named %(name)s (the pool's application_name with
-- ':watch'), so that pg_stat_activity tells it from the pool's working connections; its
-- catalog read cancelled after %(statement_ms)s ms when > 0 (pool_statement_timeout_s).
SELECT set_config('application_name', %(name)s::text, false),
       CASE WHEN %(statement_ms)s::int > 0
            THEN set_config('statement_timeout', %(statement_ms)s::text, false) END
