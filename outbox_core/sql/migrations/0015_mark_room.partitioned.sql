-- 0015, partitioned variant: see 0015_mark_room.sql for why.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A partitioned index holds no entries and takes no storage parameters, so the fillfactor
-- goes on each partition's own primary key and event_id index: here for the partitions
-- that exist, and by relay/partitions.py for each partition it creates from now on.
DO $$
DECLARE
    part_index regclass;
BEGIN
    FOR part_index IN
        SELECT i.inhrelid::regclass
        FROM pg_inherits AS i
        WHERE i.inhparent IN ('outbox_pkey'::regclass, 'outbox_event_id_unique'::regclass)
    LOOP
        EXECUTE format('ALTER INDEX %s SET (fillfactor = 50)', part_index);
    END LOOP;
END
$$;
