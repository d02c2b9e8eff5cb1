-- 0003: wake the relay when rows are written.
--
-- A statement-level trigger, and PostgreSQL folds identical notifications of one
-- transaction into one: a writer pays at most one NOTIFY per transaction, never a
-- round trip per row.  The notification only speeds discovery; the relay still
-- polls, so a lost notification costs at most one poll interval.

CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS outbox_notify_insert ON outbox;
CREATE TRIGGER outbox_notify_insert
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
