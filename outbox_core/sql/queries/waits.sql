-- What the relay's own statements wait on (relay/waits.py), read on a connection of its own
-- while the relay seems held up.  Only catalog views: nothing here waits on the outbox.

-- name: relay_waits
-- The relay's sessions (by application_name) with a statement running for at least
-- after_s seconds: what each waits for (wait_event_type 'Lock': the relation and the lock
-- mode it asked for) and the sessions holding it up (pg_blocking_pids), with their
-- application_name and the first query_chars characters of their query where the
-- relay's role may see them (another role's query reads "<insufficient privilege>").
SELECT a.pid,
       a.application_name,
       extract(epoch FROM clock_timestamp() - a.query_start)::float8 AS running_s,
       a.wait_event_type,
       a.wait_event,
       w.relation,
       w.mode,
       coalesce((SELECT jsonb_agg(jsonb_build_object(
                            'pid', b.pid, 'application_name', b.application_name,
                            'state', b.state, 'query', left(b.query, %(query_chars)s::int))
                        ORDER BY b.pid)
                 FROM pg_stat_activity AS b
                 WHERE b.pid = ANY (pg_blocking_pids(a.pid))), '[]'::jsonb) AS blockers
FROM pg_stat_activity AS a
LEFT JOIN LATERAL (SELECT k.relation::regclass::text AS relation, k.mode
                   FROM pg_locks AS k
                   WHERE k.pid = a.pid AND NOT k.granted
                   LIMIT 1) AS w ON true
WHERE a.application_name = ANY (%(names)s::text[])
  AND a.state = 'active'
  AND a.pid <> pg_backend_pid()
  AND a.query_start <= clock_timestamp() - make_interval(secs => %(after_s)s::float8)
ORDER BY a.query_start
