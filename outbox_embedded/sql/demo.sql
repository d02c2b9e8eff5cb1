-- Named queries of `outbox-relay demo` (the bench writes with `write_event` too).

-- name: write_event
-- What a service does inside its own transaction: only topic, key and payload
-- are needed (event_id is given here so the demo can follow each event).
INSERT INTO outbox (event_id, topic, key, payload)
VALUES (%(event_id)s, %(topic)s, %(key)s, %(payload)s::jsonb)

-- name: count_published
SELECT count(*) FROM outbox WHERE published_at IS NOT NULL
