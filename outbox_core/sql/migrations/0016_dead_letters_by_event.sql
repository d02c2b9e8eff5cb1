-- 0016: the dead letters keyed by event_id, no longer by the outbox row's id.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A partitioned outbox keeps (id, created_at) unique, not id: a back-fill with OVERRIDING
-- SYSTEM VALUE, or a switchover from logical replication that left the sequence behind,
-- gives two rows one id.  The relay moves each row to the dead letters by its id and its
-- event_id on that layout; with the dead letters' primary key on id, the second of two
-- such rows to be refused for good failed on it (unique_violation) and stayed in the
-- outbox, retried for ever.  event_id was unique here already and is what requeue, purge
-- and show go by: it becomes the primary key (a table that logical replication publishes
-- needs one), and id keeps an ordinary index.
--
-- The dead letters are few and the relay writes them only when it gives a row up: the
-- index is built under a lock that holds up such a move for as long as that takes.
DO $$
BEGIN
    IF EXISTS (SELECT 1
               FROM pg_constraint AS c
               JOIN pg_attribute AS a ON a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)
               WHERE c.conrelid = 'outbox_dead_letters'::regclass AND c.contype = 'p'
                 AND a.attname = 'id') THEN
        ALTER TABLE outbox_dead_letters
            DROP CONSTRAINT outbox_dead_letters_pkey,
            DROP CONSTRAINT IF EXISTS outbox_dead_letters_event_id_key,
            ALTER COLUMN id SET NOT NULL,
            ADD CONSTRAINT outbox_dead_letters_event_id_pkey PRIMARY KEY (event_id);
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS outbox_dead_letters_id_idx ON outbox_dead_letters (id);
