-- The worker pool's own sessions (consumer_sdk/jobs/_conn.py), never the connection a
-- handler works on (its session settings are the handler's).  Not sent behind a transaction
-- pooler: a session setting would stay on whichever server session the pooler lent, for its
-- other clients.

-- name: watch_session_setup
-- The lock-wait watch's connection: named %(name)s (the pool's application_name with
-- ':watch'), so that pg_stat_activity tells it from the pool's working connections.
SELECT set_config('application_name', %(name)s::text, false)
